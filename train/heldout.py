"""The offline acceptance estimate on held-out rows during training: the drafter's block
predictions against the target's stored argmax (docs/DESIGN.md, "Acceptance length")."""

from __future__ import annotations

import torch
import torch.distributed as dist

from train.loss import metrics_from_stats
from train.step import StepConfig, forward_loss


@torch.no_grad()
def evaluate_held_out(model, embed, head, loader, sc: StepConfig, device, autocast) -> dict:
    model.eval()
    stats = torch.zeros(3, sc.block, dtype=torch.float32, device=device)
    loss, weight = 0.0, 0.0
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with autocast:
            ls, st, tg = forward_loss(model, embed, head, batch, sc)
        stats += st.float()
        loss += float(ls)
        weight += float(tg["weight"].sum())
    model.train()
    dist.all_reduce(stats)
    lw = torch.tensor([loss, weight], dtype=torch.float64, device=device)
    dist.all_reduce(lw)
    m = metrics_from_stats(stats.cpu())
    return {"eval_loss": float(lw[0] / max(lw[1], 1e-9)), "eval_tau": m["tau"], "eval_acc": m["acc"]}
