"""The target forward that makes features, against plain references."""

from __future__ import annotations

import sys

import torch

from shared.features import forward_features, logit_features, pad_batch, topk_by_blocks
from shared.target import load_target


def _model(tiny):
    return load_target(tiny["target"], torch.device("cpu"), torch.float32)


def test_cpu_path_never_routes_into_fla(tiny):
    """With fla and triton installed (the test environment has both), an unguarded CPU forward
    fails inside fla's Triton kernels ("0 active drivers"). Through load_target it runs."""
    from importlib.metadata import version
    assert version("flash-linear-attention") and version("triton")  # the case being tested
    model = _model(tiny)
    out = model(torch.randint(0, 500, (2, 70)))  # > 64 tokens: the chunked DeltaNet path
    assert torch.isfinite(out.logits).all()
    # and fla was hidden only while transformers bound its kernels: the process keeps it
    assert sys.modules.get("fla", "not imported") is not None
    import importlib.util
    assert importlib.util.find_spec("fla") is not None


def test_layer_ids_follow_hf_hidden_states_plus_one(tiny):
    model = _model(tiny)
    torch.manual_seed(0)
    ids = torch.randint(0, 500, (1, 37))
    ref = model(ids, output_hidden_states=True).hidden_states
    hidden, *_ = forward_features(model, ids, [37], [0, 1, 2], topk=4)
    for j, layer in enumerate([0, 1, 2]):  # the last layer's HF entry is post-norm: not compared
        torch.testing.assert_close(hidden[:, j], ref[layer + 1][0], rtol=1e-5, atol=1e-5)


def test_topk_and_lse_against_full_logits(tiny):
    model = _model(tiny)
    ids = torch.randint(0, 500, (1, 50))
    logits = model(ids).logits[0].float()
    _, idx, logp, lse, ok = forward_features(model, ids, [50], [1], topk=5, logit_chunk=16)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), rtol=1e-5, atol=1e-5)
    ref_v, ref_i = (logits.log_softmax(-1)).topk(5, dim=-1)
    assert torch.equal(idx, ref_i)
    torch.testing.assert_close(logp, ref_v, rtol=1e-5, atol=1e-5)
    assert torch.equal(idx[:, 0], logits.argmax(-1)) and ok.all()


def test_batched_with_padding_equals_one_at_a_time(tiny):
    """The trainer-killing bug of docs/DESIGN.md, "Extraction": padding must not leak into features."""
    model = _model(tiny)
    torch.manual_seed(1)
    seqs = [torch.randint(0, 500, (n,)) for n in (41, 7, 64, 23)]
    ids, _ = pad_batch(seqs, pad_id=0, length=80)  # a bucketed length: 16 more pad columns
    layers = [0, 1, 3]
    hb, ib, lb, eb, _ = forward_features(model, ids, [len(s) for s in seqs], layers, topk=4)
    pos = 0
    for s in seqs:
        n = len(s)
        hs, is_, ls, es, _ = forward_features(model, s[None], [n], layers, topk=4)
        # fp32 compute: batched matmuls sum in another order, so errors scale with the layer's
        # magnitude (not each value's); far below one bf16 ulp, so stored bf16 values agree too.
        scale = hs.abs().amax()
        torch.testing.assert_close(hb[pos:pos + n], hs, rtol=1e-4, atol=1e-5 * scale)
        torch.testing.assert_close(eb[pos:pos + n], es, rtol=1e-5, atol=1e-5)
        assert torch.equal(ib[pos:pos + n, 0], is_[:, 0])
        b16 = (hb[pos:pos + n].bfloat16().float() - hs.bfloat16().float()).abs()
        ulp = hs.abs().bfloat16().float() * 2 ** -7
        assert (b16 <= ulp + 1e-5 * scale).all()
        pos += n
    assert pos == hb.shape[0]


def test_nan_features_flag_the_sample(tiny):
    model = _model(tiny)
    seqs = [torch.randint(0, 500, (n,)) for n in (10, 12)]
    ids, _ = pad_batch(seqs, 0)
    layer = model.model.layers[1]

    def poison(_m, _i, out):  # in place, returning None so the output object is kept
        (out[0] if isinstance(out, tuple) else out)[1, 3, 0] = float("nan")

    h = layer.register_forward_hook(poison)
    try:
        *_, ok = forward_features(model, ids, [10, 12], [1], topk=2)
    finally:
        h.remove()
    assert ok.tolist() == [True, False]


def test_fused_topk_and_lse_against_full_logits():
    """The GPU path (top-k on the model-dtype logits, compiled lse) run on the CPU, where
    inductor compiles the same reduction: against log_softmax of the full float32 logits, for
    bf16 and fp32, a chunk that does not divide the tokens, and top-k over the whole row (few
    blocks) and by blocks."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        last = torch.randn(70, 48, generator=g).to(dtype)
        head = (torch.randn(1000, 48, generator=g) * 0.5).to(dtype)
        full = (last @ head.T).float()  # the model-dtype logits, cast exactly
        ref_lse = torch.logsumexp(full, -1)
        for fused, block in ((False, 256), (True, 256), (False, 16), (True, 16)):  # 16: by blocks
            idx, logp, lse = logit_features(last, head, 8, chunk=32, fused=fused, block=block)
            torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-5)
            assert lse.dtype == logp.dtype == torch.float32
            # the same values; ties (common in bf16) may order differently: compare the values
            # and check every chosen id's own log-prob
            ref_v = (full - ref_lse[:, None]).topk(8, dim=-1).values
            torch.testing.assert_close(logp, ref_v, rtol=1e-6, atol=1e-5)
            got = (full - ref_lse[:, None]).gather(1, idx)
            torch.testing.assert_close(got, logp, rtol=1e-6, atol=1e-5)
            assert len({tuple(r) for r in idx.sort(dim=1).values.tolist()}) > 1


def test_topk_by_blocks_against_topk_over_the_row():
    """Values equal to topk's over the whole row, sorted; each id distinct and holding its value;
    the row maxima right. Rows of many ties (values on a coarse grid), a vocabulary the block
    does not divide (the partial block holding a row's top values), and rows whose top values
    crowd into one block."""
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        for V, block, k in ((1000, 16, 8), (1003, 32, 16), (4096, 64, 4), (300, 16, 16)):
            x = (torch.randn(40, V, generator=g) * 3).round().to(dtype)  # few distinct values: ties
            x[0, -3:] = 100  # the partial block (or the last one) holds the top values
            x[1, 64:64 + 2 * k] = torch.arange(2 * k, dtype=dtype) + 50  # top 2k in one or two blocks
            v, i, m = topk_by_blocks(x, k, block)
            ref = x.topk(k, dim=-1).values
            assert torch.equal(v, ref), (V, block, k, dtype)
            assert torch.equal(x.gather(1, i), v)
            assert all(len(set(r)) == k for r in i.tolist()) and int(i.max()) < V
            assert torch.equal(m, x.amax(dim=-1))
            assert set(i[0, :3].tolist()) == {V - 3, V - 2, V - 1}


def test_bucketed_batches_cover_every_sample_with_few_shapes():
    """A long-tailed length mix: each sample in exactly one batch, the padded length on the
    ladder and >= its longest sample, the budget kept, and far fewer shapes than lengths."""
    import random
    from extract.worker import bucket_length, plan_batches
    rnd = random.Random(0)
    lengths = [max(5, min(8192, int(rnd.lognormvariate(5.5, 1.2)))) for _ in range(3000)]
    items = [(i, 0, n) for i, n in enumerate(lengths)]
    ladder = {bucket_length(n, 8, 16384) for n in range(1, 16385)}
    assert len(ladder) <= 8 * 8 + 2 and all(v % 16 == 0 for v in ladder)
    for n in (1, 63, 64, 65, 1000, 8192, 16384):
        b = bucket_length(n, 8, 16384)
        assert n <= b <= max(64, n * 9 / 8 + 16) and b in ladder
    for pow2 in (False, True):
        seen, shapes = [], set()
        for batch, S in plan_batches(items, 16384, 64, 8, pow2):
            assert S == bucket_length(max(n for *_, n in batch), 8, 16384)
            assert len(batch) * S <= 16384 or len(batch) == 1
            assert not pow2 or len(batch) & (len(batch) - 1) == 0
            seen += [i for i, *_ in batch]
            shapes.add((len(batch), S))
        assert sorted(seen) == list(range(len(items)))
        assert len(shapes) < len(set(lengths)) / 5, (len(shapes), len(set(lengths)))
    exact = {S for _, S in plan_batches(items, 16384, 64, 0)}
    assert exact <= set(lengths)  # 0 buckets: each batch padded to its own longest sample


def test_models_get_no_masks_only_when_every_layer_is_causal(tiny):
    from types import SimpleNamespace

    from shared.features import causal_masks
    model = _model(tiny)
    assert causal_masks(model) == {"linear_attention": None, "full_attention": None}
    sliding = SimpleNamespace(config=SimpleNamespace(layer_types=["sliding_attention", "full_attention"]))
    assert causal_masks(sliding) is None  # the model builds its window masks itself
    assert causal_masks(SimpleNamespace(config=SimpleNamespace())) is None


def test_unmasked_batch_equals_the_model_with_its_own_padding_mask(tiny):
    """The reference: transformers' forward of the same padded batch with the 2D padding mask."""
    model = _model(tiny)
    torch.manual_seed(2)
    seqs = [torch.randint(0, 500, (n,)) for n in (30, 9, 48)]
    ids, att = pad_batch(seqs, pad_id=0, length=64)
    layers = [0, 2, 3]  # 3: the full-attention layer
    hidden, *_ = forward_features(model, ids, [len(s) for s in seqs], layers, topk=4)
    with torch.no_grad():
        ref = model.model(input_ids=ids, attention_mask=att, output_hidden_states=True).hidden_states
        hidden[:, 2] = model.model.norm(hidden[:, 2])  # the last of hidden_states is after the final norm
    pos = 0
    for b, s in enumerate(seqs):
        n = len(s)
        want = torch.stack([ref[i + 1][b, :n] for i in layers], dim=1)
        torch.testing.assert_close(hidden[pos:pos + n], want, rtol=1e-4, atol=1e-5 * want.abs().amax())
        pos += n
