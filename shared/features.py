"""The target forward that produces features: selected layer outputs and compact logits.

One batch of right-padded sequences in, the valid (non-pad) tokens' features out, packed in
sample order. Padding is removed on the device before any copy, so pad tails never reach the
host or the store.
"""

from __future__ import annotations

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


def pad_batch(seqs: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    S = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), S), pad_id, dtype=torch.long)
    att = torch.zeros((len(seqs), S), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = s
        att[b, :len(s)] = 1
    return ids, att


def valid_index(lengths: list[int], S: int) -> torch.Tensor:
    """Flat positions of the real tokens of a right-padded (B, S) batch, in sample order."""
    return torch.cat([torch.arange(n) + b * S for b, n in enumerate(lengths)])


@torch.no_grad()
def forward_features(model, ids: torch.Tensor, att: torch.Tensor, lengths: list[int],
                     layer_ids: list[int], topk: int, logit_chunk: int = 2048):
    """Returns packed (T, L, H) hidden states, top-k ids and log-probs (T, K), lse (T,), and a
    per-sample finite flag (B,): all on the model's device, no host sync inside."""
    device = ids.device
    B, S = ids.shape
    idx = valid_index(lengths, S).to(device, non_blocking=True)
    with capture_layers(model, layer_ids) as got:
        out = model.model(input_ids=ids, attention_mask=att, use_cache=False)
    hidden = torch.stack([got[i].reshape(B * S, -1).index_select(0, idx) for i in layer_ids], dim=1)
    last = out.last_hidden_state.reshape(B * S, -1).index_select(0, idx)
    head = model.lm_head.weight
    vals, inds, lses = [], [], []
    for lo in range(0, last.shape[0], logit_chunk):
        logits = (last[lo:lo + logit_chunk] @ head.T).float()  # chunked: the full (T, V) never exists
        lse = torch.logsumexp(logits, dim=-1)
        v, i = logits.topk(topk, dim=-1)
        vals.append(v - lse[:, None])
        inds.append(i)
        lses.append(lse)
    lse = torch.cat(lses)
    # One flag per sample: every hidden value and the lse finite.
    tok_ok = torch.isfinite(hidden).flatten(1).all(dim=1) & torch.isfinite(lse)
    seg = torch.repeat_interleave(torch.arange(B, device=device),
                                  torch.tensor(lengths, device=device))
    bad = torch.zeros(B, device=device).index_add_(0, seg, (~tok_ok).float())
    return hidden, torch.cat(inds), torch.cat(vals), lse, bad == 0
