"""Anchors and the DFlash attention mask: one definition, two forms (flex BlockMask, dense bool).

Query row q = j * block + k is slot k of block j (anchor a_j). Key/value index kv < S is a
context position of the row; kv >= S is slot (kv - S) % block of block (kv - S) // block.

A query (slot k of block j, anchor a_j) sees:
  - context positions kv < a_j of the same document (the anchor's own hidden state is not
    visible, as at inference). Visibility compares positions with the anchor, never block
    indices, so overlapping blocks cannot leak future context (docs/DESIGN.md, "The mask");
  - slots of its own block: all of them on a bidirectional layer; slots <= k on a causal one;
  - with a sliding window W, only positions >= a_j + k - (W - 1), context and block alike;
  - nothing of any other block.
vLLM, SGLang and SpecForge run sliding-window layers causal with the window, full-attention
layers bidirectional (unless dflash_config.causal says otherwise): DrafterConfig.layer_mask
resolves that per layer. Padded anchors (valid = False) see only their own block, so no row is
empty (SDPA would return NaN for an all-masked row); they carry no loss.
"""

from __future__ import annotations

import functools

import torch


def eligible_positions(loss_mask: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """Positions p with loss at p and p+1 in the same document (docs/DESIGN.md, "The training step")."""
    ok = loss_mask[:-1].bool() & loss_mask[1:].bool() & (doc[:-1] == doc[1:]) & (doc[:-1] >= 0)
    return torch.nonzero(ok).flatten()


def sample_anchors(loss_mask: torch.Tensor, doc: torch.Tensor, max_anchors: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to max_anchors eligible positions, uniformly without replacement, sorted; padded to a
    fixed count (static shapes for the compiled attention) with a keep-mask."""
    cand = eligible_positions(loss_mask, doc)
    if len(cand) > max_anchors:
        cand = cand[torch.randperm(len(cand), generator=generator)[:max_anchors]]
    cand = cand.sort().values
    anchors = torch.zeros(max_anchors, dtype=torch.long)
    valid = torch.zeros(max_anchors, dtype=torch.bool)
    anchors[:len(cand)], valid[:len(cand)] = cand, True
    return anchors, valid


def make_mask_mod(anchors: torch.Tensor, valid: torch.Tensor, doc: torch.Tensor, block: int,
                  window: int | None = None, causal: bool = False):
    """mask_mod(b, h, q, kv) -> bool, written with tensor ops only so that flex_attention can
    trace it and the dense form can evaluate it on broadcast index grids.
    anchors, valid: (B, A); doc: (B, S) document id per context position (-1 = padding)."""
    S = doc.shape[1]

    def mask_mod(b, h, q, kv):
        j, k = q // block, q % block
        a = anchors[b, j]
        kv_ctx = kv.clamp(max=S - 1)
        a_ctx = a.clamp(max=S - 1)
        in_ctx = kv < S
        # block slots: kv_k = the key's slot in query block j's own slots (in [0, block) there).
        # Written without dividing kv (a clamp then // or % of kv broke inductor's CPU build of
        # the compiled block mask), and cheaper per element.
        kv_k = kv - S - j * block
        ctx_ok = (kv_ctx < a) & (doc[b, kv_ctx] == doc[b, a_ctx]) & valid[b, j]
        block_ok = (kv_k >= 0) & (kv_k < block)
        if causal:
            block_ok = block_ok & (kv_k <= k)
        if window is not None:
            lower = a + k - (window - 1)
            ctx_ok = ctx_ok & (kv_ctx >= lower)
            block_ok = block_ok & (a + kv_k >= lower)
        return torch.where(in_ctx, ctx_ok, block_ok)

    return mask_mod


def dense_mask(mask_mod, B: int, Q: int, KV: int, device=None) -> torch.Tensor:
    """(B, 1, Q, KV) bool from the same mask_mod, for SDPA (CPU, where flex has no backward)."""
    b = torch.arange(B, device=device)[:, None, None]
    q = torch.arange(Q, device=device)[None, :, None]
    kv = torch.arange(KV, device=device)[None, None, :]
    zero = torch.zeros((), dtype=torch.long, device=device)
    return mask_mod(b, zero, q, kv)[:, None]


# flex's BlockMask on a GPU comes from a compiled create_block_mask. Eager, it evaluates the
# mask_mod densely, (B, Q, KV) int64 intermediates (1 GiB each at Q 8,192, KV 16,384), for every
# layer kind every step; compiled, they fuse. Measured at the 27B drafter shape on an H100: the
# step 297 -> 277 ms, the drafter's forward 70 -> 48 ms (BENCHMARKS.md, issue 27). The first build
# of a shape compiles for about 2 minutes on a cold inductor cache (seconds once cached on disk).
COMPILE_ON_GPU = True


def block_mask(mask_mod, B: int, Q: int, KV: int, device, compile: bool | None = None):
    """flex_attention's BlockMask from mask_mod; compile: None = on a GPU (COMPILE_ON_GPU)."""
    from torch.nn.attention.flex_attention import create_block_mask
    if compile is None:
        compile = COMPILE_ON_GPU and torch.device(device).type == "cuda"
    fn = _compiled_create_block_mask() if compile else create_block_mask
    with torch.no_grad():  # grad mode is a compile guard: training and held-out share one graph
        return fn(mask_mod, B, None, Q, KV, device=device)


@functools.cache
def _compiled_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask
    return torch.compile(create_block_mask, dynamic=False)
