"""The target forward that produces features: selected layer outputs and compact logits.

One batch of right-padded sequences in, the valid (non-pad) tokens' features out, packed in
sample order. Padding is removed on the device before any copy, so pad tails never reach the
host or the store.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

from shared.target import decoder_layers


@contextmanager
def capture_layers(model, layer_ids: list[int]):
    """Collect the outputs of the listed decoder layers (layer id i = decoder layer i's output,
    i.e. HF hidden_states[i+1]) with forward hooks, so no other hidden state is kept."""
    layers = decoder_layers(model)
    got: dict[int, torch.Tensor] = {}

    def hook(i):
        def fn(_mod, _inp, out):
            got[i] = out[0] if isinstance(out, (tuple, list)) else out
        return fn

    handles = [layers[i].register_forward_hook(hook(i)) for i in layer_ids]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def pad_batch(seqs: list[torch.Tensor], pad_id: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, length) ids and attention mask; length defaults to the longest."""
    S = max(len(s) for s in seqs)
    if length is not None:
        if length < S:
            raise ValueError(f"padded length {length} < longest sequence {S}")
        S = length
    ids = torch.full((len(seqs), S), pad_id, dtype=torch.long)
    att = torch.zeros((len(seqs), S), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = s
        att[b, :len(s)] = 1
    return ids, att


def valid_index(lengths: list[int], S: int) -> torch.Tensor:
    """Flat positions of the real tokens of a right-padded (B, S) batch, in sample order."""
    return torch.cat([torch.arange(n) + b * S for b, n in enumerate(lengths)])


def logsumexp_fp32(logits: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(n, V) logits in the model's dtype and their (n,) row maxima -> (n,) float32 log-sum-exp.
    Compiled, this is one fused reduction that reads the logits once in their own dtype; eager it
    materialises a float32 copy."""
    m = m.float()[:, None]
    return (m + (logits.float() - m).exp().sum(dim=-1, keepdim=True).log()).squeeze(-1)


@functools.cache
def compiled_logsumexp():
    """logsumexp_fp32 compiled once per process (dynamic shapes): what the fused LM head uses."""
    return torch.compile(logsumexp_fp32, dynamic=True)


TOPK_BLOCK = 256  # vocabulary block of topk_by_blocks (bench/extract_bench.py times others)


def topk_by_blocks(logits: torch.Tensor, k: int, block: int = TOPK_BLOCK):
    """The k largest values of each row of (n, V) logits, sorted, with their ids, and each row's
    maximum. The k largest of a row lie in the k blocks of `block` ids whose maxima are largest
    (an element outside them has k block maxima, each from another block, at least as large), so
    only those k * block values are ranked: one pass over the logits for the block maxima in
    place of a radix select over the whole vocabulary. The same values as topk over the row;
    among equal values the ids chosen may differ, as they may between any two top-k kernels."""
    n, V = logits.shape
    full = V // block
    if full <= k:  # too few blocks to gain anything
        v, i = logits.topk(k, dim=-1)
        return v, i, logits.amax(dim=-1)
    bmax = logits[:, :full * block].view(n, full, block).amax(dim=-1)
    if full * block < V:  # the last, partial block
        bmax = torch.cat([bmax, logits[:, full * block:].amax(dim=-1, keepdim=True)], dim=1)
    top = bmax.topk(k, dim=-1).indices
    cols = (top[:, :, None] * block + torch.arange(block, device=logits.device)).flatten(1)
    inside = cols < V  # the partial block's ids past the vocabulary
    vals = logits.gather(1, cols.clamp(max=V - 1)).masked_fill_(~inside, float("-inf"))
    v, j = vals.topk(k, dim=-1)
    return v, cols.gather(1, j), bmax.amax(dim=-1)


def logit_features(last: torch.Tensor, head: torch.Tensor, topk: int, chunk: int, fused: bool | None = None,
                   block: int = TOPK_BLOCK):
    """Top-k ids, their log-probs (float32) and the lse (float32) of last @ head.T, chunked so
    the full (T, V) never exists. Top-k runs on the logits in the model's dtype (the cast to
    float32 is exact and monotonic: the same values, half the bytes to select from), by blocks
    (topk_by_blocks), whose row maxima the lse reuses; the lse is the compiled reduction on a GPU
    (fused=None), eager elsewhere (docs/DESIGN.md, "Extraction speed")."""
    fused = last.device.type == "cuda" if fused is None else fused
    lse_fn = compiled_logsumexp() if fused else logsumexp_fp32
    vals, inds, lses = [], [], []
    for lo in range(0, last.shape[0], chunk):
        logits = last[lo:lo + chunk] @ head.T
        v, i, m = topk_by_blocks(logits, topk, block)
        lse = lse_fn(logits, m)
        vals.append(v.float() - lse[:, None])
        inds.append(i)
        lses.append(lse)
    return torch.cat(inds), torch.cat(vals), torch.cat(lses)


# layer types whose mask, for right-padded causal batches, is none at all
_CAUSAL_TYPES = {"full_attention", "linear_attention"}


def causal_masks(model) -> dict[str, None] | None:
    """The per-layer-type masks transformers' decoders accept in place of a 2D mask, all None
    (causal attention, no masking), when every layer is causal; else None, and the model builds
    the masks it needs (sliding windows) itself."""
    cfg = model.config
    types = {*(getattr(cfg, "layer_types", None) or ()),
             *(getattr(getattr(cfg, "text_config", None), "layer_types", None) or ())}
    return {t: None for t in types} if types and types <= _CAUSAL_TYPES else None


@torch.no_grad()
def forward_features(model, ids: torch.Tensor, lengths: list[int], layer_ids: list[int], topk: int,
                     logit_chunk: int = 2048):
    """ids: (B, S), sample b's lengths[b] tokens first, then padding (pad_batch). Returns packed
    (T, L, H) hidden states, top-k ids and log-probs (T, K), lse (T,), and a per-sample finite flag
    (B,): all on the model's device, no host sync inside.

    No padding mask is given to the model: with right padding every real token precedes the
    pads, so causal attention and the causal convolution and recurrence of the linear-attention
    layers never let it see one (exact, and checked against one sample at a time in the tests).
    A padding mask would cost a device wait per forward (the model asks whether it is all ones)
    and, for the full-attention layers, a masked attention kernel instead of the causal one; even
    without one, the model asks its position ids whether the batch is packed (another wait) unless
    it is handed its per-layer-type masks, here "none" for causal layers (causal_masks)."""
    device = ids.device
    B, S = ids.shape
    if len(lengths) != B or max(lengths) > S:
        raise ValueError(f"lengths {lengths} do not fit a batch of shape {tuple(ids.shape)}")
    idx = valid_index(lengths, S).to(device, non_blocking=True)
    with capture_layers(model, layer_ids) as got:
        out = model.model(input_ids=ids, attention_mask=causal_masks(model), use_cache=False)
    hidden = torch.stack([got[i].reshape(B * S, -1).index_select(0, idx) for i in layer_ids], dim=1)
    last = out.last_hidden_state.reshape(B * S, -1).index_select(0, idx)
    inds, vals, lse = logit_features(last, model.lm_head.weight, topk, logit_chunk)
    # One flag per sample: every hidden value and the lse finite.
    tok_ok = torch.isfinite(hidden).flatten(1).all(dim=1) & torch.isfinite(lse)
    # built on the host: repeat_interleave on the device, or torch.tensor(..., device=), waits for the
    # device (a sync per batch that leaves it idle while the host prepares the next one)
    seg = torch.repeat_interleave(torch.arange(B), torch.tensor(lengths)).to(device, non_blocking=True)
    bad = torch.zeros(B, device=device).index_add_(0, seg, (~tok_ok).float())
    return hidden, inds, vals, lse, bad == 0
