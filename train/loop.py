"""The training loop: build the run, then step, log, evaluate and checkpoint until the schedule
ends. Setup, data, metrics and checkpoints are components of their own (train/setup.py,
loader.py, metrics.py, checkpoint.py)."""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from shared.store import Store, StoreError
from shared.target import load_embed_and_head
from train.checkpoint import Checkpointer, TrainingError
from train.config import ConfigError, TrainConfig
from train.export import export
from train.heldout import evaluate
from train.loader import EpochPlan, RowDataset, RowSpec, StepSchedule, make_loader, pack_rows
from train.metrics import Metrics
from train.model import DFlashDrafter, param_count, score_memory_bytes, unwrap
from train.setup import check_store, init_distributed, lr_lambda, resolve_config
from train.step import train_step


def log(msg: str):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, file=sys.stderr, flush=True)


def _next(it, store: str):
    """The next batch; a loader worker's StoreError comes back as the worker's traceback text:
    keep only our message, which names the store, unit and sample."""
    try:
        return next(it)
    except StoreError as e:
        lines = [l for l in str(e).strip().splitlines() if l.strip()]
        raise TrainingError(lines[-1].removeprefix("shared.store.StoreError: ")) from None


def _name_samples(store: Store, rows: dict[int, list[int]], batch_rows: list[int]) -> str:
    samples = [i for r in batch_rows for i in rows.get(r, [])]
    names = [store.describe_sample(i, with_store=False) for i in samples[:8]]
    return "; ".join(names) + (f"; and {len(samples) - 8} more" if len(samples) > 8 else "")


def train(cfg: TrainConfig) -> dict:
    cfg.validate()
    rank, world, device, own_group = init_distributed(cfg)
    try:
        return _train(cfg, rank, world, device)
    finally:
        if own_group and dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: TrainConfig, rank: int, world: int, device: torch.device) -> dict:
    out = Path(cfg.out)
    try:
        store = Store(cfg.store)
    except StoreError as e:
        raise ConfigError(str(e)) from None
    dcfg = resolve_config(cfg, store)
    target = cfg.target or store.manifest.target.path
    embed, head = load_embed_and_head(target)
    check_store(store, dcfg, embed, head, target, cfg.allow_other_target)
    cuda = device.type == "cuda"
    dtype = {"auto": torch.bfloat16 if cuda else torch.float32, "bf16": torch.bfloat16,
             "fp32": torch.float32}[cfg.dtype]
    embed, head = embed.to(device, dtype), head.to(device, dtype)  # frozen, never in the optimizer
    online = None
    if cfg.online:
        from shared.target import load_target
        from train.online import OnlineFeatures
        online = OnlineFeatures(load_target(target, device, dtype), dcfg.target_layer_ids)

    # --- model and optimizer -----------------------------------------------------------------
    backend = {"auto": "flex" if cuda else "sdpa", "flex": "flex", "sdpa": "sdpa"}[cfg.attention]
    if backend == "flex" and cfg.compile == "attention":
        backend = "flex_compiled"
    torch.manual_seed(cfg.seed)
    model = DFlashDrafter(dcfg, backend=backend).to(device)
    drafter = model  # the plain module: state_dict, export, config
    A, Bk = cfg.max_anchors, dcfg.block_size
    if backend == "flex" and cfg.compile == "none":
        gib = score_memory_bytes(dcfg, cfg.micro_batch, A * Bk, cfg.seq_len + A * Bk) / 2 ** 30
        log(f"warning: --compile none runs flex_attention unfused: about {gib:,.1f} GiB of score matrix "
            f"per layer (docs/DESIGN.md, 'Selective compilation')")
    if cfg.compile == "full":
        model = torch.compile(model, dynamic=False)
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=cuda)

    # --- data and schedule: the last eval_samples samples are held out -------------------------
    n = len(store)
    held = list(range(n - cfg.eval_samples, n)) if cfg.eval_samples else []
    plan = EpochPlan(store, cfg.seq_len, cfg.seed, rank, world, exclude=held)
    spec = RowSpec(tuple(dcfg.target_layer_ids), cfg.seq_len, A, cfg.seed, cfg.labels == "distill")
    rows_per_step = cfg.micro_batch * cfg.grad_accum
    schedule = StepSchedule(plan, rows_per_step)
    if schedule.steps(0) == 0:
        raise ConfigError(f"one epoch has fewer rows than one step needs ({rows_per_step}); lower "
                          f"--micro-batch/--grad-accum or --seq-len")
    total = cfg.max_steps or schedule.total(cfg.epochs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, int(cfg.warmup_ratio * total), cfg.min_lr_ratio))
    eval_loader = None
    if held:
        eval_rows = list(enumerate(pack_rows(plan.lengths, np.asarray(held), cfg.seq_len)))[rank::world]
        eval_loader = make_loader(RowDataset(cfg.store, eval_rows, spec, None), 1, 0, cfg.prefetch, cuda)

    # --- resume --------------------------------------------------------------------------------
    ckpt = Checkpointer(out)
    step, history, best = 0, [], None
    if cfg.resume:
        ck = ckpt.load_latest()
        if ck is None:
            log(f"--resume: no checkpoint in {out}/checkpoints, starting fresh")
        else:
            if ck["drafter"] != asdict(dcfg):
                raise ConfigError(f"--resume: the checkpoint in {out} was made with another drafter config")
            drafter.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optim"])
            sched.load_state_dict(ck["sched"])
            torch.set_rng_state(ck["rng"])
            step, history, best = ck["step"], ck["history"], ck.get("best")
            log(f"resumed from step {step}")
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "drafter_config.json").write_text(json.dumps(dcfg.to_hf(), indent=2))
        (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    log(f"drafter: {param_count(model) / 1e6:,.2f}M params, {dcfg.num_hidden_layers} layers, block "
        f"{dcfg.block_size}, target layers {dcfg.target_layer_ids}; attention {backend}, compile "
        f"{cfg.compile}; {world} rank(s) on {device.type}; {schedule.steps(0)} steps in epoch 0, {total} steps")

    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == torch.bfloat16 else contextlib.nullcontext()
    metrics = Metrics(out, rank, device, total, step, history, cfg.resume, cfg.progress)

    def save():
        if rank == 0:
            ckpt.save({"step": step, "model": drafter.state_dict(), "optim": opt.state_dict(),
                       "sched": sched.state_dict(), "rng": torch.get_rng_state(), "history": history,
                       "best": best, "drafter": asdict(dcfg), "train": asdict(cfg)})

    # --- the loop --------------------------------------------------------------------------------
    stopped = False
    while step < total and not stopped:
        epoch, in_epoch = schedule.locate(step)
        rows = plan.rows(epoch)
        row_samples = dict(rows)
        ds = RowDataset(cfg.store, rows, spec, epoch, first_row=in_epoch * rows_per_step)
        it = iter(make_loader(ds, cfg.micro_batch, cfg.workers, cfg.prefetch, cuda))
        for _ in range(in_epoch, schedule.steps(epoch)):
            if step >= total:
                break
            mbs = [{k: v.to(device, non_blocking=True) for k, v in _next(it, cfg.store).items()}
                   for _ in range(cfg.grad_accum)]
            if online is not None:
                mbs = [online(mb) for mb in mbs]  # baseline: features from the target, not the store
            r = train_step(ddp, params, opt, sched, embed, head, mbs, labels=cfg.labels, gamma=cfg.gamma,
                           loss_chunk=cfg.loss_chunk, grad_clip=cfg.grad_clip, autocast=autocast)
            step += 1
            if not r["finite"]:
                batch_rows = [int(x) for mb in mbs for x in mb["row"].tolist()]
                gathered = [None] * world
                dist.all_gather_object(gathered, batch_rows)
                where = _name_samples(store, row_samples, batch_rows)
                if not cfg.skip_nonfinite:
                    raise TrainingError(
                        f"step {step}: non-finite loss or gradient (grad norm {float(r['grad_norm'])}); no weights "
                        f"were updated. Rows {sorted(x for g in gathered for x in g)} of epoch {epoch}; rank "
                        f"{rank}'s samples: {where}. Check them with `python -m extract.inspect {cfg.store} "
                        f"--verify`; --skip-nonfinite skips such steps instead (counted in metrics).")
                log(f"step {step}: non-finite gradient, step skipped ({where})")
                metrics.skipped += 1
                metrics.bar.update(1)
            else:
                metrics.add(r)
            last = step == total
            if (step % cfg.log_every == 0 or last) and metrics.window is not None:
                rec = metrics.record(step, epoch, sched.get_last_lr()[0], float(r["grad_norm"]))
                if eval_loader is not None and cfg.eval_every and (step % cfg.eval_every == 0 or last):
                    rec.update(evaluate(ddp, embed, head, eval_loader, labels=cfg.labels, gamma=cfg.gamma,
                                        loss_chunk=cfg.loss_chunk, block=Bk, device=device, autocast=autocast))
                    if best is None or rec["eval_tau"] > best["eval_tau"]:
                        best = {"step": step, "eval_tau": rec["eval_tau"]}
                        if rank == 0:
                            export(drafter, out / "best")
                metrics.write(rec)
            if step % cfg.save_every == 0 or last:
                save()
            if cfg.stop_after and step >= cfg.stop_after:  # simulates a crash: no checkpoint here
                stopped = True
                break
    metrics.close()
    if rank == 0:
        export(drafter, out / "export")
    dist.barrier()
    return {"step": step, "history": history, "best": best, "out": str(out)}
