"""Everything a training run holds, built from its config: the store and drafter config, the
target's frozen tensors, the model and its wrappers, the optimizer and schedule, the data plan,
the held-out loader, and the state resumed from the last checkpoint. The loop (train/loop.py)
only steps it."""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from shared.progress import log
from shared.store import Store, StoreError
from shared.target import compute_dtype, load_embed_and_head
from train.checkpoint import Checkpointer
from train.config import ConfigError, DrafterConfig, TrainConfig
from train.init import init_from_target
from train.loader import EpochPlan, RowDataset, RowSpec, StepSchedule, make_loader, pack_rows
from train.model import DFlashDrafter, attention_backend, compile_drafter, param_count, score_memory_bytes
from train.precision import MasterWeights
from train.setup import check_store, lr_lambda, resolve_config
from train.step import StepConfig


@dataclass
class Run:
    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    store: Store
    dcfg: DrafterConfig
    embed: torch.Tensor
    head: torch.Tensor
    drafter: DFlashDrafter             # the plain module: export
    model: torch.nn.Module             # what steps call: DDP over (compiled) drafter
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    plan: EpochPlan
    spec: RowSpec
    schedule: StepSchedule
    total: int
    step_cfg: StepConfig
    autocast: object
    ckpt: Checkpointer
    eval_loader: object = None
    online: object = None              # the online baseline's target forward
    master: MasterWeights | None = None  # float32 masters of bf16 weights (--weights bf16)
    step: int = 0
    history: list = field(default_factory=list)
    best: dict | None = None
    graphs: int = 0                    # dynamo graphs compiled by the first step of this process
    recompiles: int = 0                # graphs compiled by any later step (0 when shapes are static)

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)

    @property
    def target_tensors(self) -> str:
        """The store target's embed/lm_head fingerprint, recorded in every export."""
        return self.store.manifest.target.tensors_fingerprint

    @property
    def rows_per_step(self) -> int:
        return self.cfg.micro_batch * self.cfg.grad_accum

    def loader(self, epoch: int, in_epoch: int):
        rows = self.plan.rows(epoch)
        ds = RowDataset(self.cfg.store, rows, self.spec, epoch, first_row=in_epoch * self.rows_per_step)
        return rows, iter(make_loader(ds, self.cfg.micro_batch, self.cfg.workers, self.cfg.prefetch,
                                      self.device.type == "cuda"))

    def save(self):
        if self.rank == 0:
            model = self.master.state_dict() if self.master else self.drafter.state_dict()
            self.ckpt.save({"step": self.step, "model": model, "optim": self.opt.state_dict(),
                            "sched": self.sched.state_dict(), "rng": torch.get_rng_state(), "history": self.history,
                            "best": self.best, "drafter": asdict(self.dcfg), "train": asdict(self.cfg)})


def build_run(cfg: TrainConfig, rank: int, world: int, device: torch.device) -> Run:
    try:
        store = Store(cfg.store)
    except StoreError as e:
        raise ConfigError(str(e)) from None
    dcfg = resolve_config(cfg, store)
    target = cfg.target or store.manifest.target.path
    embed, head = load_embed_and_head(target)
    check_store(store, dcfg, embed, head, target, cfg.allow_other_target)
    cuda = device.type == "cuda"
    dtype = compute_dtype(cfg.dtype, device)
    embed, head = embed.to(device, dtype), head.to(device, dtype)  # frozen, never in the optimizer
    online = None
    if cfg.online:
        from shared.target import load_target
        from train.online import OnlineFeatures
        online = OnlineFeatures(load_target(target, device, dtype), dcfg.target_layer_ids)

    # model and optimizer
    mode = cfg.compile if cfg.compile != "auto" else ("blocks" if cuda else "none")
    backend = attention_backend(cfg.attention, mode, cuda)
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter(dcfg, backend=backend, kernel_options=cfg.flex_options).to(device)
    if cfg.init_from_target and not (cfg.resume and Checkpointer(cfg.out).has_latest()):  # a resume loads its own
        log(init_from_target(drafter, target))
    if cfg.weights == "bf16" and dtype != torch.bfloat16:
        raise ConfigError("--weights bf16 needs --dtype bf16 (or auto on a GPU)")
    master = MasterWeights(drafter) if cfg.weights == "bf16" or (
        cfg.weights == "auto" and dtype == torch.bfloat16) else None
    A, Bk = cfg.max_anchors, dcfg.block_size
    if backend == "flex" and mode == "none":
        gib = score_memory_bytes(dcfg, cfg.micro_batch, A * Bk, cfg.seq_len + A * Bk) / 2 ** 30
        log(f"warning: --compile none runs flex_attention unfused: about {gib:,.1f} GiB of score matrix "
            f"per layer (docs/DESIGN.md, 'Selective compilation')")
    model = DDP(compile_drafter(drafter, mode), device_ids=[device.index] if cuda else None)
    params = master.masters if master else [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=cuda)

    # data and schedule: the last eval_samples samples are held out
    held = held_out(store, cfg.eval_samples)
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
    step_cfg = StepConfig(dcfg, "sdpa" if backend == "sdpa" else "flex", cfg.labels, cfg.gamma, cfg.loss_chunk,
                          cfg.grad_clip, compile_mask=False if mode == "none" else None)  # none: nothing compiled
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == torch.bfloat16 else contextlib.nullcontext()
    run = Run(cfg, rank, world, device, store, dcfg, embed, head, drafter, model, opt, sched, plan, spec,
              schedule, total, step_cfg, autocast, Checkpointer(cfg.out), eval_loader, online, master)
    resume(run)
    if rank == 0:
        run.out.mkdir(parents=True, exist_ok=True)
        (run.out / "drafter_config.json").write_text(json.dumps(dcfg.to_hf(), indent=2))
        (run.out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    log(f"drafter: {param_count(drafter) / 1e6:,.2f}M params, {dcfg.num_hidden_layers} layers, block "
        f"{dcfg.block_size}, target layers {dcfg.target_layer_ids}; attention {backend}, compile "
        f"{mode}; weights {'bf16 (float32 masters)' if master else 'fp32'}; {world} rank(s) on {device.type}; "
        f"{schedule.steps(0)} steps in epoch 0, {total} steps")
    return run


def resume(run: Run):
    if not run.cfg.resume:
        return
    ck = run.ckpt.load_latest()
    if ck is None:
        log(f"--resume: no checkpoint in {run.out}/checkpoints, starting fresh")
        return
    if ck["drafter"] != asdict(run.dcfg):
        raise ConfigError(f"--resume: the checkpoint in {run.out} was made with another drafter config")
    diffs = run.cfg.resume_differences(ck.get("train", {}))
    if diffs:  # kept silently, the old values would train while train_config.json recorded the new
        raise ConfigError(f"--resume: the run in {run.out} was started with other options: {'; '.join(diffs)}. "
                          f"Resume with the same options, or use another --out")
    (run.master or run.drafter).load_state_dict(ck["model"])
    run.opt.load_state_dict(ck["optim"])
    run.sched.load_state_dict(ck["sched"])
    torch.set_rng_state(ck["rng"])
    run.step, run.history, run.best = ck["step"], ck["history"], ck.get("best")
    log(f"resumed from step {run.step}")


def held_out(store: Store, n_eval: int) -> list[int]:
    """The store's last n_eval samples, widened to whole source rows: the samples a multi-turn
    chat was split into share their context, so they are held out together or trained together."""
    n = len(store)
    if not n_eval:
        return []
    lo = max(n - n_eval, 0)
    if lo:
        files, rows = store.sources(0, n)
        while lo > 0 and rows[lo - 1] == rows[lo] and files[lo - 1] == files[lo]:
            lo -= 1
    return list(range(lo, n))
