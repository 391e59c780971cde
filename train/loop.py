"""The training loop: distributed setup, optimizer and schedule, steps, checkpoints, logging."""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from shared.store import Store, StoreError
from shared.target import load_embed_and_head, tokenizer_fingerprint
from train.config import ConfigError, DrafterConfig, TrainConfig
from train.export import export
from train.loader import EpochPlan, RowDataset, make_loader, pack_rows
from train.loss import metrics_from_stats
from train.model import DFlashDrafter, param_count, score_memory_bytes, unwrap
from train.step import forward_loss, train_step


def log(msg: str):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, file=sys.stderr, flush=True)


# --- setup ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(cfg: TrainConfig) -> tuple[int, int, torch.device]:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; otherwise one process (gloo on CPU, nccl on a
    GPU), so the same code path runs in the tests and on N GPUs."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if cfg.gpus:
        device = torch.device("cuda", local if world > 1 else cfg.gpus[0])
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world,
                                **({"device_id": device} if backend == "nccl" else {}))
    return rank, world, device


def check_store(store: Store, dcfg: DrafterConfig, embed: torch.Tensor, head: torch.Tensor, target: str):
    """Refuse before any work when the store, the drafter config and the target tensors disagree."""
    man = store.manifest
    t = man["target"]
    problems = []
    missing = [l for l in dcfg.target_layer_ids if l not in store.layer_ids]
    if missing:
        problems.append(f"drafter target_layer_ids {dcfg.target_layer_ids} are not a subset of the store's "
                        f"layers {store.layer_ids} (missing {missing})")
    if dcfg.hidden_size != t["hidden_size"]:
        problems.append(f"drafter hidden_size {dcfg.hidden_size} != target's {t['hidden_size']}")
    if dcfg.num_target_layers != t["num_hidden_layers"]:
        problems.append(f"drafter num_target_layers {dcfg.num_target_layers} != target's {t['num_hidden_layers']}")
    if dcfg.vocab_size != t["vocab_size"]:
        problems.append(f"drafter vocab_size {dcfg.vocab_size} != target's {t['vocab_size']}")
    for name, w in (("embed_tokens", embed), ("lm_head", head)):
        if tuple(w.shape) != (t["vocab_size"], t["hidden_size"]):
            problems.append(f"{target}: {name} has shape {tuple(w.shape)}, the store's target has "
                            f"({t['vocab_size']}, {t['hidden_size']}): a store made by another target")
    if not 0 <= dcfg.mask_token_id < t["vocab_size"]:
        problems.append(f"mask_token_id {dcfg.mask_token_id} outside the vocabulary")
    tok_dir = Path(target)
    if (tok_dir / "tokenizer.json").exists() or (tok_dir / "tokenizer_config.json").exists():
        from shared.target import load_tokenizer
        fp = tokenizer_fingerprint(load_tokenizer(tok_dir))
        if fp != man["tokenizer"]["fingerprint"]:
            problems.append(f"{target}: tokenizer/chat template fingerprint {fp[:19]}... differs from the "
                            f"store's {man['tokenizer']['fingerprint'][:19]}...")
    if problems:
        raise ConfigError("refusing to train:\n  - " + "\n  - ".join(problems))


def resolve_config(cfg: TrainConfig, store: Store) -> DrafterConfig:
    if cfg.draft:
        return DrafterConfig.load(cfg.draft)
    return DrafterConfig.default_for(store.manifest, cfg.draft_layers, cfg.block_size)


def lr_lambda(total: int, warmup: int, min_ratio: float):
    def f(step):
        if step < warmup:
            return (step + 1) / max(warmup, 1)
        p = (step - warmup) / max(total - warmup, 1)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(p, 1.0)))
    return f


# --- checkpoints ----------------------------------------------------------------------------

def save_checkpoint(out: Path, state: dict, keep: int = 2):
    ck = out / "checkpoints"
    ck.mkdir(parents=True, exist_ok=True)
    name = f"step-{state['step']:08d}.pt"
    tmp = ck / (name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, ck / name)  # never a half-written checkpoint under a real name
    (ck / "latest.tmp").write_text(name)
    os.replace(ck / "latest.tmp", ck / "latest")
    for old in sorted(ck.glob("step-*.pt"))[:-keep]:
        old.unlink()


def load_latest(out: Path) -> dict | None:
    p = out / "checkpoints" / "latest"
    if not p.exists():
        return None
    return torch.load(out / "checkpoints" / p.read_text().strip(), map_location="cpu", weights_only=False)


def cfg_block(model) -> int:
    return unwrap(model).cfg.block_size


# --- evaluation -----------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model, embed, head, loader, cfg: TrainConfig, device, autocast) -> dict:
    """Offline acceptance estimate on held-out rows: the drafter's block predictions against the
    target's stored argmax (DESIGN.md section 6 without the target)."""
    model.eval()
    stats = torch.zeros(3, cfg_block(model), dtype=torch.float32, device=device)
    loss, weight = 0.0, 0.0
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with autocast:
            ls, st, tg = forward_loss(model, embed, head, batch, labels=cfg.labels, gamma=cfg.gamma,
                                      loss_chunk=cfg.loss_chunk)
        stats += st.float()
        loss += float(ls)
        weight += float(tg["weight"].sum())
    model.train()
    dist.all_reduce(stats)
    lw = torch.tensor([loss, weight], dtype=torch.float64, device=device)
    dist.all_reduce(lw)
    m = metrics_from_stats(stats.cpu())
    return {"eval_loss": float(lw[0] / max(lw[1], 1e-9)), "eval_tau": m["tau"], "eval_acc": m["acc"]}


# --- the loop -------------------------------------------------------------------------------

def train(cfg: TrainConfig) -> dict:
    cfg.validate()
    rank, world, device = init_distributed(cfg)
    out = Path(cfg.out)
    try:
        store = Store(cfg.store)
    except StoreError as e:
        raise ConfigError(str(e)) from None
    dcfg = resolve_config(cfg, store)
    target = cfg.target or store.manifest["target"]["path"]
    embed, head = load_embed_and_head(target)
    check_store(store, dcfg, embed, head, target)
    cuda = device.type == "cuda"
    dtype = {"auto": torch.bfloat16 if cuda else torch.float32, "bf16": torch.bfloat16,
             "fp32": torch.float32}[cfg.dtype]
    embed, head = embed.to(device, dtype), head.to(device, dtype)  # frozen, never in the optimizer
    online = None
    if cfg.online:
        from shared.target import load_target
        from train.online import OnlineFeatures
        online = OnlineFeatures(load_target(target, device, dtype), dcfg.target_layer_ids)

    backend = {"auto": "flex" if cuda else "sdpa", "flex": "flex", "sdpa": "sdpa"}[cfg.attention]
    if backend == "flex" and cfg.compile == "attention":
        backend = "flex_compiled"
    torch.manual_seed(cfg.seed)
    model = DFlashDrafter(dcfg, backend=backend).to(device)
    A, Bk = cfg.max_anchors, dcfg.block_size
    if backend == "flex" and cfg.compile == "none":
        gib = score_memory_bytes(dcfg, cfg.micro_batch, A * Bk, cfg.seq_len + A * Bk) / 2 ** 30
        log(f"warning: --compile none runs flex_attention unfused: about {gib:,.1f} GiB of score matrix "
            f"per layer (DESIGN.md section 5)")
    if cfg.compile == "full":
        model = torch.compile(model, dynamic=False)
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.AdamW([p for p in model.parameters()], lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay, fused=cuda)

    # Data: the last eval_samples samples are held out for the offline acceptance estimate.
    n = len(store)
    held = list(range(n - cfg.eval_samples, n)) if cfg.eval_samples else []
    plan = EpochPlan(store, cfg.seq_len, cfg.seed, rank, world, exclude=held)
    rows_per_step = cfg.micro_batch * cfg.grad_accum
    steps_per_epoch = len(plan.rows(0)) // rows_per_step
    if steps_per_epoch == 0:
        raise ConfigError(f"one epoch has fewer rows than one step needs ({rows_per_step}); lower "
                          f"--micro-batch/--grad-accum or --seq-len")
    total = cfg.max_steps or steps_per_epoch * cfg.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, int(cfg.warmup_ratio * total), cfg.min_lr_ratio))

    step, history, best = 0, [], None
    if cfg.resume:
        ck = load_latest(out)
        if ck is None:
            log(f"--resume: no checkpoint in {out}/checkpoints, starting fresh")
        else:
            if ck["drafter"] != asdict(dcfg):
                raise ConfigError(f"--resume: the checkpoint in {out} was made with another drafter config")
            unwrap(model).load_state_dict(ck["model"])
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
        f"{cfg.compile}; {world} rank(s) on {device.type}; {steps_per_epoch} steps/epoch, {total} steps")

    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == torch.bfloat16 else contextlib.nullcontext()
    eval_loader = None
    if held:
        eval_rows = list(enumerate(pack_rows(plan.lengths, np.asarray(held), cfg.seq_len)))[rank::world]
        eval_loader = make_loader(RowDataset(cfg.store, eval_rows, dcfg.target_layer_ids, cfg.seq_len, A,
                                             cfg.seed, -1, cfg.labels == "distill"),
                                  1, 0, cfg.prefetch, cuda)
    if rank == 0 and cfg.resume:  # drop what a killed run logged after its last checkpoint
        (out / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    metrics_f = open(out / "metrics.jsonl", "a") if rank == 0 else None
    tb = None
    if rank == 0:
        try:
            from torch.utils.tensorboard import SummaryWriter
            tb = SummaryWriter(str(out / "tb"))
        except Exception:
            tb = None

    from shared.progress import progress_bar
    bar = progress_bar(total=total, initial=step, desc="train", unit=" steps", disable=rank != 0 or not cfg.progress)
    t_last, window = time.time(), None
    params = [p for p in model.parameters() if p.requires_grad]
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    while step < total:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        rows = plan.rows(epoch)
        ds = RowDataset(cfg.store, rows, dcfg.target_layer_ids, cfg.seq_len, A, cfg.seed, epoch,
                        cfg.labels == "distill", first_row=in_epoch * rows_per_step)
        it = iter(make_loader(ds, cfg.micro_batch, cfg.workers, cfg.prefetch, cuda))
        for _ in range(in_epoch, steps_per_epoch):
            if step >= total:
                break
            mbs = [{k: v.to(device, non_blocking=True) for k, v in next(it).items()} for _ in range(cfg.grad_accum)]
            if online is not None:
                mbs = [online(mb) for mb in mbs]  # baseline: features from the target, not the store
            r = train_step(ddp, params, opt, sched, embed, head, mbs, labels=cfg.labels, gamma=cfg.gamma,
                           loss_chunk=cfg.loss_chunk, grad_clip=cfg.grad_clip, autocast=autocast)
            window = r if window is None else {k: window[k] + r[k] for k in ("loss_sum", "weight", "stats", "tokens")}
            step += 1
            bar.update(1)

            last = step == total
            if step % cfg.log_every == 0 or last:
                # weight is already global; loss, slot counts and tokens are summed over ranks here
                reduce = torch.cat([window["stats"].flatten().double(), window["loss_sum"].reshape(1),
                                    window["tokens"].double().reshape(1)])
                dist.all_reduce(reduce)
                reduce = reduce.cpu()
                m = metrics_from_stats(reduce[:-2].reshape(window["stats"].shape).float())
                now = time.time()
                rec = {"step": step, "epoch": epoch, "loss": float(reduce[-2]) / max(float(window["weight"]), 1e-9),
                       "lr": sched.get_last_lr()[0], "grad_norm": float(r["grad_norm"]), **m,
                       "tok_s": float(reduce[-1]) / max(now - t_last, 1e-9),
                       "peak_mem_gib": (torch.cuda.max_memory_allocated(device) if cuda else
                                        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2 ** 30}
                if eval_loader is not None and cfg.eval_every and (step % cfg.eval_every == 0 or last):
                    rec.update(evaluate(ddp, embed, head, eval_loader, cfg, device, autocast))
                    if best is None or rec["eval_tau"] > best["eval_tau"]:
                        best = {"step": step, "eval_tau": rec["eval_tau"]}
                        if rank == 0:
                            export(unwrap(model), out / "best")
                history.append(rec)
                if rank == 0:
                    metrics_f.write(json.dumps(rec) + "\n")
                    metrics_f.flush()
                    if tb is not None:
                        for k, v in rec.items():
                            if isinstance(v, (int, float)):
                                tb.add_scalar(k, v, step)
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", acc1=f"{m['acc'][0]:.2f}", tau=f"{m['tau']:.2f}",
                                    tok_s=f"{rec['tok_s']:,.0f}", mem=f"{rec['peak_mem_gib']:.1f}G")
                t_last, window = now, None
            if rank == 0 and (step % cfg.save_every == 0 or last):
                save_checkpoint(out, {"step": step, "model": unwrap(model).state_dict(),
                                      "optim": opt.state_dict(), "sched": sched.state_dict(),
                                      "rng": torch.get_rng_state(), "history": history, "best": best,
                                      "drafter": asdict(dcfg), "train": asdict(cfg)})
            if cfg.stop_after and step >= cfg.stop_after:  # simulates a crash: no checkpoint here
                break
        if cfg.stop_after and step >= cfg.stop_after:
            break
    bar.close()
    if rank == 0:
        export(unwrap(model), out / "export")
        if metrics_f:
            metrics_f.close()
        if tb is not None:
            tb.close()
    dist.barrier()
    return {"step": step, "history": history, "best": best, "out": str(out)}
