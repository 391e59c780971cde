"""One drafter forward + loss on a batch of packed rows (DESIGN.md section 4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from train.attention import build_masks
from train.loss import chunked_loss, slot_stats, slot_targets
from train.model import DFlashDrafter, unwrap


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


def forward_loss(model: DFlashDrafter, embed: torch.Tensor, head: torch.Tensor, batch: dict, *,
                 labels: str, gamma: float, loss_chunk: int, targets: dict | None = None):
    """Returns (sum of weight * CE, per-slot stats (3, block), targets). `model` may be a DDP or
    compiled wrapper of a DFlashDrafter; its config and backend come from the inner module."""
    inner = unwrap(model)
    cfg = inner.cfg
    block = cfg.block_size
    tok, ctx_pos, block_pos = block_inputs(batch, block, cfg.mask_token_id)
    need_sliding = "sliding_attention" in cfg.layer_types
    masks = build_masks(batch, block, cfg.sliding_window, need_sliding,
                        "sdpa" if inner.backend == "sdpa" else "flex", batch["input_ids"].device)
    noise = F.embedding(tok, embed)
    hidden = batch["hidden"].to(noise.dtype)
    out = model(hidden, noise, ctx_pos, block_pos, masks)
    tg = targets if targets is not None else slot_targets(batch, block, gamma, labels)
    loss_sum, pred = chunked_loss(out, head, tg, loss_chunk)
    return loss_sum, slot_stats(pred, tg, block), tg
