"""Attention backends for the drafter, all fed from train.mask's one mask definition.

- flex: flex_attention with a BlockMask (GPU default). With `--compile attention` only this call
  is compiled (the fused kernel; eager flex materialises the score matrix, docs/DESIGN.md, "Selective compilation").
- sdpa: scaled_dot_product_attention with the dense boolean mask (CPU, where flex_attention has
  no backward; also the reference the flex path is tested against).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from train.mask import block_mask, dense_mask, make_mask_mod


@functools.cache
def compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def attend(q, k, v, mask, backend: str, kernel_options: dict | None = None):
    """q: (B, nh, Q, D); k, v: (B, nkv, KV, D); mask: BlockMask (flex) or (B, 1, Q, KV) bool.
    kernel_options: flex_attention's (`--flex-options`), e.g. the backward's block sizes."""
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    fn = compiled_flex() if backend == "flex_compiled" else flex_attention
    return fn(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1], kernel_options=kernel_options or None)


def build_masks(batch: dict, block: int, kinds: set[tuple[bool, int | None]], backend: str, device,
                compile_mask: bool | None = None) -> dict:
    """{(causal, window): mask} for every layer kind the drafter has, for one batch. compile_mask:
    build flex's BlockMasks compiled (None: on a GPU, train.mask.COMPILE_ON_GPU)."""
    anchors, valid, doc = batch["anchors"], batch["anchor_valid"], batch["doc"]
    B, A = anchors.shape
    Q, KV = A * block, doc.shape[1] + A * block

    def mask(causal, window):
        mod = make_mask_mod(anchors, valid, doc, block, window, causal)
        return dense_mask(mod, B, Q, KV, device) if backend == "sdpa" else block_mask(mod, B, Q, KV, device, compile_mask)

    return {kind: mask(*kind) for kind in sorted(kinds, key=str)}
