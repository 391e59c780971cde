"""Greedy decoding of a batch with a static KV cache and, on a GPU, the decode step replayed as one
CUDA graph: the fast path of regeneration for dense targets (docs/DESIGN.md, "Regeneration").

transformers' `generate` spends most of a small target's step on the host (the issue measured
105 ms per step at batch 256 for a 135M model on an H100): a cache that grows, a mask rebuilt,
logits processors and a stop check that synchronizes every step. Here the whole step (embed,
decoder over the static cache, LM head, argmax, writing the token and advancing the position) is
captured once per (batch, cache length, keys read) and replayed; the host looks at the tokens
every `check_every` steps to stop when every row has ended its turn.

Two things keep the step near the memory bound of the keys actually needed (by design: the rate
is not measured on a GPU yet, BENCHMARKS.md "A real target"): the step attends to the first
`live` slots of the cache only (`live` = the fed position rounded up to `bucket`, one captured
graph per value), and a query's heads that share a key/value head attend as one group of
queries (no copy of the keys per head, which transformers' SDPA path makes whenever a mask is
given).

Same tokens as `generate` greedy (tests/test_regenerate_decode.py): the prompts are left-padded
into one cache, each row's positions count from its first real token, and the mask lets a query
see exactly its row's real keys at or before it. Pad queries see only themselves, so their cache
slots hold finite values that no real query looks at.
"""

from __future__ import annotations

import inspect

import torch

from shared.families import family_of


ATTENTION = "dflash_static"


def supports_static(model) -> bool:
    """Dense decoders with full attention only: the hybrid family's DeltaNet state is not a
    key/value cache, and the step's mask has no sliding window."""
    cfg = model.config
    fam = family_of(getattr(cfg, "model_type", None))
    sliding = (getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)) or \
        "sliding_attention" in (getattr(cfg, "layer_types", None) or ())
    return fam is not None and not fam.fla and not sliding


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
    """Attention over the mask's width of the cache. One query position (the decode step): the
    query heads of a key/value head are its group of queries, so no key is copied per head."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    n = attention_mask.shape[-1]
    key, value = key[:, :, :n], value[:, :, :n]
    B, H, Q, D = query.shape
    if Q != 1 or H == key.shape[1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kw)
    q = query.reshape(B, key.shape[1], H // key.shape[1], D)
    o = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
    return o.reshape(B, H, 1, D).transpose(1, 2), None


def _register():
    from transformers import AttentionInterface
    AttentionInterface.register(ATTENTION, _attention)


def _bucket(n: int, step: int) -> int:
    return -(-n // step) * step


class StaticGreedy:
    """`run(ids, max_new, eot, pad)` -> per prompt (new tokens before the end of turn, stopped?).

    Cache lengths are rounded up to `bucket` tokens and batches padded to full size so that a
    corpus sorted by prompt length reuses a handful of captured graphs."""

    def __init__(self, model, batch_size: int, bucket: int = 256, check_every: int = 16, graphs: bool | None = None,
                 prefill_chunk: int = 512):
        from transformers import StaticCache
        _register()
        self.StaticCache = StaticCache
        self.model, self.B, self.bucket, self.check_every = model, batch_size, bucket, check_every
        self.prefill_chunk = prefill_chunk
        # transformers renamed the cache argument (past_key_values -> cache, 5.2x)
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.neg = torch.finfo(self.dtype).min  # an additive mask: every attention implementation reads it
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.captured: dict[int, dict] = {}  # cache length -> static buffers, cache, a step per live width

    # --- one batch -------------------------------------------------------------------------

    @torch.no_grad()
    def run(self, ids: list[list[int]], max_new: int, eot: int, pad: int) -> list[tuple[list[int], bool]]:
        assert 0 < len(ids) <= self.B
        eot = -1 if eot is None else eot  # a tokenizer without an end of turn: every row runs to max_new
        before = self.model.config._attn_implementation
        self.model.config._attn_implementation = ATTENTION  # set_attn_implementation looks names up on the hub
        try:
            return self._run(ids, max_new, eot, pad)
        finally:
            self.model.config._attn_implementation = before

    def _run(self, ids, max_new, eot, pad):
        S = _bucket(max(len(x) for x in ids), 16)
        L = _bucket(S + max_new, self.bucket)
        st = self._state(L)
        B, dev = self.B, self.device
        x = torch.full((B, S), pad, dtype=torch.long)
        real = torch.zeros((B, L), dtype=torch.bool)
        for r, p in enumerate(ids):  # left padding: every prompt ends at S - 1
            x[r, S - len(p):] = torch.tensor(p)
            real[r, S - len(p):S] = True
        real[len(ids):, S - 1] = True  # rows that only fill the batch: one real token each
        real = real.to(dev)
        pad_len = (~real[:, :S]).sum(1)
        st["cache"].reset()
        # prefill, in chunks of queries (the mask is chunk x S per row): causal over real keys; a
        # pad query sees only itself (finite values in its slot)
        k = torch.arange(S, device=dev)
        x = x.to(dev)
        for lo in range(0, S, self.prefill_chunk):
            q = torch.arange(lo, min(S, lo + self.prefill_chunk), device=dev)
            see = (k[None, :] <= q[:, None])[None] & real[:, None, :S]
            see |= (k[None, :] == q[:, None])[None]
            mask = torch.zeros(see.shape, dtype=self.dtype, device=dev).masked_fill_(~see, self.neg)
            del see
            pos = (q[None, :] - pad_len[:, None]).clamp(min=0)
            out = self.model(input_ids=x[:, q], attention_mask=mask[:, None], position_ids=pos, cache_position=q,
                             use_cache=True, logits_to_keep=1, **{self.cache_arg: st["cache"]})
        first = out.logits[:, -1].argmax(-1)
        # the decode step's inputs, in the captured graphs' buffers
        st["tok"].copy_(first[:, None])
        st["real"].copy_(real)
        st["pos"].copy_((S - pad_len)[:, None])
        st["at"].fill_(S)
        st["at0"].fill_(S - 1)
        st["out"].fill_(pad)
        st["out"][:, 0] = first
        steps = 1
        while steps < max_new:
            if steps % self.check_every == 0 and bool((st["out"][:len(ids), :steps] == eot).any(1).all()):
                break
            st["steps"][_bucket(S + steps, self.bucket)]()  # feeds slot S + steps - 1
            steps += 1
        gen = st["out"][:len(ids), :steps].tolist()
        return [(g[:g.index(eot)], True) if eot in g else (g, False) for g in gen]

    # --- the decode step -------------------------------------------------------------------

    def _state(self, L: int) -> dict:
        if L in self.captured:
            return self.captured[L]
        if self.graphs:  # one cache length live at a time: a corpus sorted longest first only shrinks
            self.captured.clear()
            torch.cuda.empty_cache()
        B, dev = self.B, self.device
        st = {"cache": self.StaticCache(config=self.model.config, max_cache_len=L),
              "tok": torch.zeros((B, 1), dtype=torch.long, device=dev),
              "real": torch.zeros((B, L), dtype=torch.bool, device=dev),
              "pos": torch.zeros((B, 1), dtype=torch.long, device=dev),
              "at": torch.zeros((1,), dtype=torch.long, device=dev),
              "out": torch.zeros((B, L), dtype=torch.long, device=dev),
              "k": torch.arange(L, device=dev),
              "at0": torch.zeros((1,), dtype=torch.long, device=dev)}  # slot of the prompt's last token

        def step(live: int):
            at = st["at"]
            st["real"].index_fill_(1, at, True)  # the token fed now is a real key from here on
            visible = st["real"][:, :live] & (st["k"][None, :live] <= at)
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=dev).masked_fill_(~visible, self.neg)
            o = self.model(input_ids=st["tok"], attention_mask=mask[:, None, None, :], position_ids=st["pos"],
                           cache_position=at, use_cache=True, **{self.cache_arg: st["cache"]})
            nxt = o.logits[:, -1].argmax(-1)
            st["out"].index_copy_(1, at - st["at0"], nxt[:, None])  # the token after slot `at`
            st["tok"].copy_(nxt[:, None])
            st["pos"].add_(1)
            at.add_(1)

        widths = range(self.bucket, L + 1, self.bucket)
        if not self.graphs:
            st["steps"] = {w: (lambda w=w: step(w)) for w in widths}
        else:
            self._warm(st, L, step)
            # capturing records without running: the buffers are untouched. One memory pool: the
            # graphs run one at a time and keep nothing between replays
            pool, st["steps"] = torch.cuda.graph_pool_handle(), {}
            for w in widths:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    step(w)
                st["steps"][w] = g.replay
                st.setdefault("graphs", []).append(g)
        self.captured[L] = st
        return st

    def _warm(self, st, L, step):
        """Run the step eagerly on a side stream first (lazy cache allocation, cuBLAS handles), as
        capture requires; the run's prefill resets what it wrote."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                st["at"].fill_(L - 2)
                st["at0"].fill_(L - 3)
                step(L)
        torch.cuda.current_stream().wait_stream(s)
