"""The DFlash mask against a dense boolean mask built by a plain loop; flex against SDPA."""

from __future__ import annotations

import pytest
import torch

from train.mask import dense_mask, eligible_positions, make_mask_mod, sample_anchors


def loop_mask(anchors, valid, doc, block, window=None, causal=False):
    """The rules of docs/DESIGN.md ("The mask"), one (query, key) pair at a time: slot k of the
    block anchored at a sees context positions < a of its document and its own block's slots
    (only slots <= k when causal); with a window W, only positions >= a + k - (W - 1)."""
    B, A = anchors.shape
    S = doc.shape[1]
    Q, KV = A * block, S + A * block
    m = torch.zeros(B, 1, Q, KV, dtype=torch.bool)
    for b in range(B):
        for j in range(A):
            a = int(anchors[b, j])
            for k in range(block):
                q = j * block + k
                for kv in range(KV):
                    if kv < S:
                        pos = kv
                        ok = bool(valid[b, j]) and kv < a and int(doc[b, kv]) == int(doc[b, a])
                    else:
                        jj, kk = divmod(kv - S, block)
                        pos = a + kk
                        ok = jj == j and (kk <= k or not causal)
                    if window is not None and pos < a + k - (window - 1):
                        ok = False
                    m[b, 0, q, kv] = ok
    return m


def case():
    # Two rows: row 0 packs two documents and padding; row 1 one document. Anchors overlap
    # (3 and 5 with block 4), one runs past the end of the row, one anchor slot is padding.
    doc = torch.tensor([[0] * 9 + [1] * 7 + [-1] * 4,
                        [0] * 20])
    anchors = torch.tensor([[3, 5, 10, 0], [2, 6, 18, 17]])
    valid = torch.tensor([[True, True, True, False], [True, True, True, True]])
    return anchors, valid, doc


@pytest.mark.parametrize("window,causal", [(None, False), (3, True), (None, True), (6, True)])
def test_dense_mask_equals_plain_loop(window, causal):
    anchors, valid, doc = case()
    block = 4
    mod = make_mask_mod(anchors, valid, doc, block, window, causal)
    got = dense_mask(mod, 2, anchors.shape[1] * block, doc.shape[1] + anchors.shape[1] * block)
    want = loop_mask(anchors, valid, doc, block, window, causal)
    assert torch.equal(got, want)
    S = doc.shape[1]
    if causal:  # slot 1 of block 0 sees slots 0 and 1 of its block, not 2
        assert got[0, 0, 1, S] and got[0, 0, 1, S + 1] and not got[0, 0, 1, S + 2]
    else:
        assert got[0, 0, 1, S + 3]
    if window == 3:  # anchor 10, slot 3: positions >= 10 + 3 - 2 = 11, i.e. block slots 1.. only
        assert not got[0, 0, 2 * block + 3, 9] and not got[0, 0, 2 * block + 3, S + 2 * block]
        assert got[0, 0, 2 * block + 3, S + 2 * block + 1]
    if window is not None or causal:
        return
    # Spot checks of the rules, so a wrong loop cannot agree with a wrong mask by accident.
    S = doc.shape[1]
    assert not got[0, 0, 0, 3]            # anchor 3 does not see its own position
    assert got[0, 0, 0, 2]                # but sees the one before
    assert not got[0, 0, 1 * block, 5]    # overlapping block (anchor 5) does not see position 5...
    assert got[0, 0, 1 * block, 4]        # ...but sees 4, which is inside block 0's span: by position
    assert not got[0, 0, 2 * block, 8]    # anchor 10 is in document 1: document 0 is invisible
    assert not got[0, 0, 0, S + block]    # block 0 never sees block 1
    assert got[0, 0, 3 * block, S + 3 * block] and not got[0, 0, 3 * block, 0]  # padded anchor: own block only


@pytest.mark.parametrize("window,causal", [(None, False), (2, True)])
def test_every_row_sees_something(window, causal):
    anchors, valid, doc = case()
    got = dense_mask(make_mask_mod(anchors, valid, doc, 4, window, causal), 2, 16, 20 + 16)
    assert got.any(-1).all()


def test_anchor_sampling_only_eligible_and_sorted():
    loss = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 1, 0], dtype=torch.bool)
    doc = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, -1])
    assert eligible_positions(loss, doc).tolist() == [1, 5]  # 2->3 crosses documents
    g = torch.Generator().manual_seed(0)
    a, v = sample_anchors(loss, doc, 4, g)
    assert a[v].tolist() == [1, 5] and v.tolist() == [True, True, False, False]
    big = torch.ones(100, dtype=torch.bool)
    a, v = sample_anchors(big, torch.zeros(100, dtype=torch.long), 10, g)
    assert v.all() and torch.equal(a, a.sort().values) and len(set(a.tolist())) == 10 and a.max() < 99


def test_flex_forward_equals_sdpa_with_dense_mask():
    """flex_attention has no backward on CPU; its forward is checked here, both directions on GPU
    (bench/train_bench.py --sections check)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    import torch.nn.functional as F
    torch.manual_seed(0)
    anchors, valid, doc = case()
    block, B = 4, 2
    Q, KV = anchors.shape[1] * block, doc.shape[1] + anchors.shape[1] * block
    q = torch.randn(B, 4, Q, 16)
    k = torch.randn(B, 2, KV, 16)
    v = torch.randn(B, 2, KV, 16)
    for window, causal in ((None, False), (3, True), (None, True)):
        mod = make_mask_mod(anchors, valid, doc, block, window, causal)
        bm = create_block_mask(mod, B, None, Q, KV, device="cpu")
        got = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(mod, B, Q, KV), enable_gqa=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flex_kernel_options_reach_flex_attention(monkeypatch):
    """--flex-options: the drafter hands the parsed JSON to every flex_attention call (and
    nothing when none are given)."""
    import train.attention as att
    from train.config import DrafterConfig, TrainConfig
    from train.model import DFlashDrafter
    from shared.cli import from_args, parser_for
    seen = []

    def recording_flex(q, k, v, block_mask=None, enable_gqa=False, kernel_options=None):
        seen.append(kernel_options)
        return torch.zeros_like(q)

    monkeypatch.setattr(att, "flex_attention", recording_flex)
    argv = ["--store", "s", "--out", "o", "--flex-options", '{"bwd_BLOCK_M1": 32}']
    tc = from_args(TrainConfig, parser_for(TrainConfig, "train", None).parse_args(argv))
    assert tc.flex_options == {"bwd_BLOCK_M1": 32}
    cfg = DrafterConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                        intermediate_size=64, num_hidden_layers=2, vocab_size=64, num_target_layers=2,
                        target_layer_ids=[0, 1], mask_token_id=1, block_size=4)
    q, k = torch.randn(1, 2, 8, 16), torch.randn(1, 1, 12, 16)
    for opts, want in ((tc.flex_options, {"bwd_BLOCK_M1": 32}), ({}, None)):
        seen.clear()
        DFlashDrafter(cfg, backend="flex", kernel_options=opts)._attend(q, k, k, None)
        assert seen == [want]


def test_compiled_block_mask_equals_eager_and_compiles_once():
    """block_mask(compile=True) (the GPU default, train.mask.COMPILE_ON_GPU): the same blocks as
    the eager build, its listed blocks where the dense mask has a pair, and a second batch of the
    same shapes (other anchors and documents), also under no_grad, reuses the compiled graph."""
    import torch._dynamo

    from train.mask import block_mask
    g = torch.Generator().manual_seed(0)
    block, A, S, B = 4, 80, 300, 2
    Q, KV = A * block, S + A * block
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for second in (False, True):
        doc = torch.cat([torch.zeros(B, 170, dtype=torch.long), torch.ones(B, S - 170, dtype=torch.long)], 1)
        doc[1, 120 + 40 * second:] = -1  # padding at the end of row 1
        anchors = torch.stack([sample_anchors((doc[b] >= 0).long(), doc[b], A, g)[0] for b in range(B)])
        valid = torch.ones(B, A, dtype=torch.bool)
        valid[1, -5:] = False
        mod = make_mask_mod(anchors, valid, doc, block, window=64, causal=True)
        with torch._dynamo.config.patch(error_on_recompile=second):
            got = block_mask(mod, B, Q, KV, "cpu", compile=True)
        want = block_mask(mod, B, Q, KV, "cpu", compile=False)
        assert torch.equal(got.to_dense(), want.to_dense())
        for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        # a block is listed where the dense mask has any pair (full blocks: equal to eager's, above)
        dense = dense_mask(mod, B, Q, KV)[:, 0].float()
        pad = (-KV) % 128
        tiles = torch.nn.functional.pad(dense, (0, pad, 0, (-Q) % 128)).unflatten(1, (-1, 128)).unflatten(3, (-1, 128))
        any_ = tiles.amax((2, 4)) > 0
        assert torch.equal(got.to_dense()[:, 0].bool(), any_)
    # the held-out evaluation builds its masks under no_grad: the same graph
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        block_mask(mod, B, Q, KV, "cpu", compile=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # compiled, and once
