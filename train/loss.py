"""Slot targets, the decayed loss and the metrics people watch (docs/DESIGN.md, "The training step")."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def slot_targets(batch: dict, block: int, gamma: float, labels: str):
    """For every (row, anchor, slot): the label, the loss weight, the target's own choice there,
    and whether the slot counts for metrics. Slot k of anchor a predicts the token at a + k."""
    anchors, valid = batch["anchors"], batch["anchor_valid"]          # (B, A)
    ids, lm, doc, amax = batch["input_ids"], batch["loss_mask"], batch["doc"], batch["argmax"]  # (B, S)
    B, S = ids.shape
    k = torch.arange(block, device=ids.device)
    t = anchors[..., None] + k                                       # (B, A, Bk)
    tc = t.clamp(max=S - 1)
    prev = (tc - 1).clamp(min=0)
    g = lambda x, i: torch.gather(x, 1, i.reshape(B, -1)).reshape(i.shape)
    a_doc = g(doc, anchors)[..., None]
    live = valid[..., None] & (t < S) & (g(doc, tc) == a_doc) & g(lm, tc).bool() & (k >= 1)
    target_choice = g(amax, prev)       # the target's argmax at a+k-1 = its prediction of token a+k
    label = g(ids, tc) if labels in ("data", "distill") else target_choice
    decay = torch.exp(-(k - 1).clamp(min=0).float() / gamma)
    weight = live.float() * decay
    out = {"label": label, "weight": weight, "live": live, "target_choice": target_choice}
    if labels == "distill":  # the target's stored top-k at a+k-1: its distribution for token a+k
        K = batch["topk_idx"].shape[-1]
        rows = prev.reshape(B, -1, 1).expand(-1, -1, K)
        out["soft_idx"] = torch.gather(batch["topk_idx"], 1, rows).reshape(*prev.shape, K)
        out["soft_logp"] = torch.gather(batch["topk_logp"], 1, rows).reshape(*prev.shape, K)
    return out


def _distill_ce(logits, soft_idx, soft_logp):
    """Distillation from the stored top-k: cross-entropy over the (K+1)-way coarse distribution
    (the K stored tokens and the tail), which is exact for what the store knows. Per row."""
    logq = logits.log_softmax(-1)
    q_top = logq.gather(-1, soft_idx)
    p_top = soft_logp.exp()
    p_tail = (1 - p_top.sum(-1)).clamp(min=0)
    q_tail = torch.log1p(-q_top.exp().sum(-1).clamp(max=1 - 1e-6))
    return -(p_top * q_top).sum(-1) - p_tail * q_tail


def _row_loss(h, head, label, soft_idx, soft_logp):
    logits = (h @ head.T).float()
    pred = logits.argmax(-1)
    if soft_idx is None:
        return F.cross_entropy(logits, label, reduction="none"), pred
    return _distill_ce(logits, soft_idx, soft_logp), pred


def chunked_loss(hidden: torch.Tensor, head: torch.Tensor, tg: dict, chunk: int):
    """Sum of weight * CE over all slots, and the drafter's argmax per slot. The LM head runs in
    row chunks under activation checkpointing: full (rows, vocab) logits never exist at once. The
    plain reference for `fused_loss` (tests, and the benchmark's before)."""
    N = hidden.shape[0] * hidden.shape[1]
    h = hidden.reshape(N, -1)
    label = tg["label"].reshape(N)
    w = tg["weight"].reshape(N)
    soft_idx = tg.get("soft_idx")
    soft_logp = tg.get("soft_logp")
    total = hidden.new_zeros((), dtype=torch.float32)
    preds = []
    for lo in range(0, N, chunk):
        sl = slice(lo, lo + chunk)
        si = None if soft_idx is None else soft_idx.reshape(N, -1)[sl]
        sp = None if soft_logp is None else soft_logp.reshape(N, -1)[sl]
        if torch.is_grad_enabled():
            ce, pred = checkpoint(_row_loss, h[sl], head, label[sl], si, sp, use_reentrant=False)
        else:
            ce, pred = _row_loss(h[sl], head, label[sl], si, sp)
        total = total + (ce * w[sl]).sum()
        preds.append(pred)
    return total, torch.cat(preds).reshape(tg["label"].shape)


def _hard_terms(z, label, w):
    """One chunk of bf16 (or fp32) logits with hard labels: sum of w * CE, the argmax, and
    d(sum)/dz = w * (softmax - onehot) in z's dtype, from z read twice (one fused kernel each
    when compiled)."""
    zf = z.float()
    lse = torch.logsumexp(zf, -1, keepdim=True)
    ce = lse.squeeze(-1) - zf.gather(-1, label[:, None]).squeeze(-1)
    onehot = torch.arange(z.shape[-1], device=z.device) == label[:, None]
    gz = ((zf - lse).exp() - onehot.float()) * w[:, None]
    return (ce * w).sum(), zf.argmax(-1), gz.to(z.dtype)


@functools.cache
def _compiled_hard_terms():
    return torch.compile(_hard_terms, dynamic=False)


def _hard_terms_for(z):
    """The compiled chunk on a GPU (elementwise passes over the logits fused), eager elsewhere."""
    return _compiled_hard_terms() if z.device.type == "cuda" else _hard_terms


def _soft_terms(z, w, soft_idx, soft_logp):
    """One chunk with distillation targets: the same sum, argmax and d(sum)/dz, the gradient taken
    by autograd through the reference formula on this chunk alone."""
    with torch.enable_grad():
        zf = z.float().requires_grad_(True)
        total = (_distill_ce(zf, soft_idx, soft_logp) * w).sum()
        (gz,) = torch.autograd.grad(total, zf)
    return total.detach(), zf.detach().argmax(-1), gz.to(z.dtype)


class _FusedLinearCE(torch.autograd.Function):
    """Sum of w * CE(h @ head.T) with the gradient w.r.t. h computed chunk by chunk in the forward:
    the head is frozen, so d/dh = d/dz @ head is all the backward needs. Each chunk's logits live
    only while it is processed, and the LM-head matmul is not run a second time in the backward
    (as checkpointing does)."""

    @staticmethod
    def forward(ctx, h, head, label, w, soft_idx, soft_logp, chunk):
        need = ctx.needs_input_grad[0]
        N = h.shape[0]
        grad = torch.empty_like(h) if need else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        pred = torch.empty(N, dtype=torch.long, device=h.device)
        for lo in range(0, N, chunk):
            sl = slice(lo, lo + chunk)
            z = h[sl].to(head.dtype) @ head.T         # bf16 under autocast, as the reference's matmul
            if soft_idx is None:
                part, pred[sl], gz = _hard_terms_for(z)(z, label[sl], w[sl])
            else:
                part, pred[sl], gz = _soft_terms(z, w[sl], soft_idx[sl], soft_logp[sl])
            total += part
            if need:
                grad[sl] = (gz @ head).to(h.dtype)
            # freed before the next chunk's logits exist: else three (rows, vocab) buffers would
            # be alive at once (this chunk's logits and d/dz, the last chunk's d/dz)
            del z, gz
        ctx.grad = grad
        ctx.mark_non_differentiable(pred)
        return total, pred

    @staticmethod
    def backward(ctx, g_total, g_pred):
        grad, ctx.grad = ctx.grad, None
        # a 0-dim float32 factor: computed in float32, rounded once to grad's dtype
        return grad * g_total, None, None, None, None, None, None


def fused_loss(hidden: torch.Tensor, head: torch.Tensor, tg: dict, chunk: int):
    """chunked_loss's result (sum of weight * CE, argmax per slot) with one LM-head matmul per
    direction instead of three: see _FusedLinearCE. The head must be frozen."""
    N = hidden.shape[0] * hidden.shape[1]
    si, sp = tg.get("soft_idx"), tg.get("soft_logp")
    total, pred = _FusedLinearCE.apply(
        hidden.reshape(N, -1), head.detach(), tg["label"].reshape(N), tg["weight"].reshape(N).float(),
        None if si is None else si.reshape(N, -1), None if sp is None else sp.reshape(N, -1), chunk)
    return total, pred.reshape(tg["label"].shape)


def slot_stats(pred: torch.Tensor, tg: dict, block: int) -> torch.Tensor:
    """(3, block) counts: live slots, drafter == label, drafter == target's own choice."""
    live = tg["live"].float()
    return torch.stack([
        live.sum(dim=(0, 1)),
        ((pred == tg["label"]).float() * live).sum(dim=(0, 1)),
        ((pred == tg["target_choice"]).float() * live).sum(dim=(0, 1)),
    ])


def accepted_per_block(pred: torch.Tensor, tg: dict) -> torch.Tensor:
    """(B, A) tokens a block would commit at decoding time: 1 + the leading slots 1.. where the
    drafter's argmax equals the target's own choice (and the slot exists)."""
    hit = (pred == tg["target_choice"]) & tg["live"]
    hit = hit[..., 1:].long()
    return 1 + hit.cumprod(dim=-1).sum(dim=-1)


def acceptance_length(acc: list[float]) -> float:
    """Expected acceptance length 1 + sum_k prod_{i<=k} acc_i over slots 1..block-1."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau


def metrics_from_stats(stats: torch.Tensor) -> dict:
    n = stats[0, 1:].clamp(min=1)
    acc = (stats[2, 1:] / n).tolist()
    return {"acc": [round(a, 4) for a in acc], "acc_label": [round(a, 4) for a in (stats[1, 1:] / n).tolist()],
            "tau": round(acceptance_length(acc), 4)}
