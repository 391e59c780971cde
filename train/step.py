"""One drafter forward + loss on a batch of packed rows (docs/DESIGN.md, "The training step")."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shared.schema import fp8_decode
from train.attention import build_masks
from train.loss import chunked_loss, fused_loss, slot_stats, slot_targets
from train.config import DrafterConfig
from train.model import unwrap
from train.precision import MasterWeights


def block_inputs(batch: dict, block: int, mask_token_id: int):
    """Block token ids (slot 0 = the real token at the anchor, the rest the mask token) and
    position ids (0..S-1 for the context, a + (0..block-1) for each block)."""
    anchors, ids = batch["anchors"], batch["input_ids"]
    B, A = anchors.shape
    S = ids.shape[1]
    tok = torch.full((B, A, block), mask_token_id, dtype=torch.long, device=ids.device)
    tok[..., 0] = torch.gather(ids, 1, anchors)
    block_pos = (anchors[..., None] + torch.arange(block, device=ids.device)).reshape(B, A * block)
    ctx_pos = torch.arange(S, device=ids.device).expand(B, S)
    return tok.reshape(B, A * block), ctx_pos, block_pos


@dataclass(frozen=True)
class StepConfig:
    """What a step needs besides tensors: the drafter's config (block size, mask token, layer
    masks), the attention form, the labels and the loss settings. Built once per run, so no
    step unwraps the model to find them."""
    drafter: DrafterConfig
    mask_form: str = "sdpa"            # "sdpa": dense bool masks; "flex": BlockMasks
    labels: str = "data"
    gamma: float = 7.0
    loss_chunk: int = 2048
    grad_clip: float = 1.0
    loss: str = "fused"                # "fused" (train.loss.fused_loss) or "checkpointed", its reference
    compile_mask: bool | None = None   # flex BlockMasks compiled; None: on a GPU (train.mask.COMPILE_ON_GPU)

    @property
    def block(self) -> int:
        return self.drafter.block_size

    @classmethod
    def of(cls, model, **kw) -> "StepConfig":
        """For a DFlashDrafter (or a DDP/compiled wrapper of one): its config and backend."""
        inner = unwrap(model)
        return cls(inner.cfg, "sdpa" if inner.backend == "sdpa" else "flex", **kw)


def draft(model, embed: torch.Tensor, batch: dict, sc: StepConfig | None = None) -> torch.Tensor:
    """The drafter's normed output (B, A*block, H) for every block of a batch: what the target's
    LM head turns into draft logits. `model` may be a DDP or compiled wrapper of a DFlashDrafter."""
    sc = sc or StepConfig.of(model)
    cfg = sc.drafter
    tok, ctx_pos, block_pos = block_inputs(batch, cfg.block_size, cfg.mask_token_id)
    masks = build_masks(batch, cfg.block_size, cfg.mask_kinds(), sc.mask_form, batch["input_ids"].device,
                        sc.compile_mask)
    noise = F.embedding(tok, embed)
    return model(context_features(batch).to(noise.dtype), noise, ctx_pos, block_pos, masks)


def context_features(batch: dict) -> torch.Tensor:
    """(B, S, n*H) target features; fp8 batches (e4m3 bits + per token-layer scales) are decoded
    here, on the device."""
    h = batch["hidden"]
    if "hidden_scale" not in batch:
        return h
    B, S, L = batch["hidden_scale"].shape
    return fp8_decode(h.reshape(B, S, L, -1), batch["hidden_scale"]).reshape(B, S, -1)


def forward_loss(model, embed: torch.Tensor, head: torch.Tensor, batch: dict, sc: StepConfig,
                 targets: dict | None = None):
    """Returns (sum of weight * CE, per-slot stats (3, block), targets)."""
    out = draft(model, embed, batch, sc)
    tg = targets if targets is not None else slot_targets(batch, sc.block, sc.gamma, sc.labels)
    loss_fn = fused_loss if sc.loss == "fused" else chunked_loss
    loss_sum, pred = loss_fn(out, head, tg, sc.loss_chunk)
    return loss_sum, slot_stats(pred, tg, sc.block), tg


def train_step(model, opt, sched, embed, head, mbs: list[dict], sc: StepConfig, autocast,
               master: MasterWeights | None = None) -> dict:
    """One optimizer step over micro-batches `mbs` (gradient accumulation). The loss is normalised
    by the summed slot weights of the whole global batch: every micro-batch of every rank
    (docs/DESIGN.md, "The training step"). The optimizer step is skipped when the gradient is not
    finite (`finite` False in the result); the caller decides whether to stop. With `master`
    (bf16 weights), the optimizer holds its float32 masters: each micro-batch's gradient is added
    into them in float32 (so each is all-reduced on its own: no_sync would sum in bf16)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    tgs = [slot_targets(mb, sc.block, sc.gamma, sc.labels) for mb in mbs]
    W = torch.stack([t["weight"].sum() for t in tgs]).sum().double().reshape(1)
    if dist.is_initialized():
        dist.all_reduce(W)
    loss_total = torch.zeros((), dtype=torch.float64, device=W.device)
    stats_total = torch.zeros(3, sc.block, device=W.device)
    tokens = torch.zeros((), dtype=torch.long, device=W.device)
    no_sync = getattr(model, "no_sync", contextlib.nullcontext) if master is None else contextlib.nullcontext
    for i, (mb, tg) in enumerate(zip(mbs, tgs)):
        with (contextlib.nullcontext() if i == len(mbs) - 1 else no_sync()), autocast:
            loss_sum, stats, _ = forward_loss(model, embed, head, mb, sc, targets=tg)
        (loss_sum * world / W.float().clamp(min=1e-9)).backward()  # DDP averages over ranks
        if master is not None:
            master.take_grads()
        loss_total += loss_sum.detach().double()
        stats_total += stats.detach().float()
        tokens += (mb["doc"] >= 0).sum()
    gnorm, finite = clip_and_step(opt, sc.grad_clip, master)
    if sched is not None:
        sched.step()
    opt.zero_grad(set_to_none=True)
    return {"loss_sum": loss_total, "weight": W.squeeze(0), "stats": stats_total, "tokens": tokens,
            "grad_norm": gnorm, "finite": finite}


def clip_and_step(opt, grad_clip: float, master: MasterWeights | None = None) -> tuple[torch.Tensor, bool]:
    """Clips the gradients' global norm to grad_clip and steps the optimizer (then the bf16
    weights from their masters) unless the norm is not finite: a non-finite gradient (NaN
    features, an overflow) must never reach the weights. The norm is global after DDP's
    all-reduce, so every rank agrees. Returns (norm, finite)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    gnorm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    finite = bool(torch.isfinite(gnorm))  # the step's one host sync
    if finite:
        opt.step()
        if master is not None:
            master.push()
    return gnorm, finite
