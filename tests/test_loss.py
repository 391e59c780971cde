"""Loss and metrics against a naive per-slot loop; tau against hand-worked cases."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import pytest

from train.loss import (acceptance_length, chunked_loss, fused_loss, metrics_from_stats, slot_stats,
                        slot_targets)


def batch(B=2, S=24, A=5, K=3, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    doc = torch.zeros(B, S, dtype=torch.long)
    doc[0, 14:] = 1
    doc[0, 20:] = -1
    return {
        "input_ids": torch.randint(0, V, (B, S), generator=g),
        "loss_mask": torch.rand(B, S, generator=g) > 0.2,
        "doc": doc,
        "argmax": torch.randint(0, V, (B, S), generator=g),
        "anchors": torch.tensor([[1, 3, 12, 16, 0], [0, 5, 9, 20, 22]]),
        "anchor_valid": torch.tensor([[True, True, True, True, False], [True] * 5]),
        "topk_idx": torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * S)]).reshape(B, S, K),
        "topk_logp": torch.log_softmax(torch.randn(B, S, K + 2, generator=g), -1)[..., :K],
    }


def naive(b, logits, block, gamma, labels):
    """Per (row, anchor, slot) with plain Python conditions."""
    B, A = b["anchors"].shape
    S = b["input_ids"].shape[1]
    total, wsum = 0.0, 0.0
    live = torch.zeros(block)
    hit = torch.zeros(block)
    hit_label = torch.zeros(block)
    for r in range(B):
        for j in range(A):
            a = int(b["anchors"][r, j])
            for k in range(1, block):
                t = a + k
                if not b["anchor_valid"][r, j] or t >= S or b["doc"][r, t] != b["doc"][r, a] or not b["loss_mask"][r, t]:
                    continue
                w = math.exp(-(k - 1) / gamma)
                lg = logits[r, j * block + k]
                choice = int(b["argmax"][r, t - 1])
                y = int(b["input_ids"][r, t]) if labels in ("data", "distill") else choice
                hit_label[k] += float(int(lg.argmax()) == y)
                if labels == "distill":
                    p = b["topk_logp"][r, t - 1].exp()
                    logq = lg.log_softmax(-1)
                    q_top = logq[b["topk_idx"][r, t - 1]]
                    ce = -(p * q_top).sum() - (1 - p.sum()) * torch.log(1 - q_top.exp().sum())
                else:
                    ce = F.cross_entropy(lg[None], torch.tensor([y]))
                total += w * float(ce)
                wsum += w
                live[k] += 1
                hit[k] += float(int(lg.argmax()) == choice)
    return total, wsum, live, hit, hit_label


@pytest.mark.parametrize("loss_fn", [chunked_loss, fused_loss])
def test_loss_and_stats_match_naive_loop(loss_fn):
    block, gamma, H, V = 4, 7.0, 6, 11
    b = batch(V=V)
    B, A = b["anchors"].shape
    torch.manual_seed(0)
    hidden = torch.randn(B, A * block, H)
    head = torch.randn(V, H)
    logits = hidden @ head.T
    for labels in ("data", "argmax", "distill"):
        tg = slot_targets(b, block, gamma, labels)
        total, pred = loss_fn(hidden, head, tg, chunk=7)  # chunk not dividing the rows
        want_total, want_w, live, hit, hit_label = naive(b, logits, block, gamma, labels)
        assert abs(float(total) - want_total) < 1e-4 * max(1.0, want_total), labels
        assert abs(float(tg["weight"].sum()) - want_w) < 1e-5
        st = slot_stats(pred, tg, block)
        assert torch.equal(st[0], live) and torch.equal(st[2], hit), labels
        assert torch.equal(st[1], hit_label), labels  # against the labels, not the target's choice
        if labels == "data":
            assert not torch.equal(hit_label, hit)  # the two rows differ here, so a swap is caught


def test_chunked_loss_gradient_equals_unchunked():
    block, V, H = 4, 11, 6
    b = batch(V=V)
    tg = slot_targets(b, block, 7.0, "data")
    h1 = torch.randn(2, 5 * block, H, requires_grad=True)
    h2 = h1.detach().clone().requires_grad_(True)
    head = torch.randn(V, H)
    chunked_loss(h1, head, tg, chunk=3)[0].backward()
    chunked_loss(h2, head, tg, chunk=10_000)[0].backward()
    torch.testing.assert_close(h1.grad, h2.grad)


@pytest.mark.parametrize("labels", ["data", "argmax", "distill"])
def test_fused_loss_gradient_equals_checkpointed(labels):
    """The fused LM head + loss (gradient taken in the forward) against the checkpointed reference:
    the same sum, argmax and gradient w.r.t. the drafter's output, in fp32 and under bf16 autocast,
    for chunks that do and do not divide the rows; the backward scales by the incoming gradient."""
    block, V, H = 4, 11, 6
    b = batch(V=V)
    tg = slot_targets(b, block, 7.0, labels)
    torch.manual_seed(1)
    head = torch.randn(V, H)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = torch.randn(2, 5 * block, H)
        grads, outs = [], []
        for fn, chunk in ((chunked_loss, 10_000), (fused_loss, 3), (fused_loss, 10_000)):
            h = x.clone().requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                total, pred = fn(h, head.to(dtype), tg, chunk)
            (total * 2.5).backward()
            grads.append(h.grad)
            outs.append((float(total.detach()), pred))
        for (t, p), g in zip(outs[1:], grads[1:]):
            assert abs(t - outs[0][0]) <= tol * max(1.0, abs(outs[0][0])), (labels, dtype)
            assert torch.equal(p, outs[0][1]), (labels, dtype)
            torch.testing.assert_close(g, grads[0], rtol=tol, atol=tol * float(grads[0].abs().max()))


def test_fused_loss_without_grad_has_no_gradient_work():
    b = batch(V=11)
    tg = slot_targets(b, 4, 7.0, "data")
    h = torch.randn(2, 20, 6)
    with torch.no_grad():
        total, pred = fused_loss(h, torch.randn(11, 6), tg, 7)
    assert not total.requires_grad and pred.shape == tg["label"].shape


def test_acceptance_length_hand_worked():
    assert acceptance_length([1.0] * 15) == 16.0
    assert acceptance_length([0.0] * 15) == 1.0
    # 1 + 0.5 + 0.5*0.5 + 0.5*0.5*0 = 1.75
    assert abs(acceptance_length([0.5, 0.5, 0.0, 1.0]) - 1.75) < 1e-12
    st = torch.tensor([[0, 4, 4, 2], [0, 1, 3, 2], [0, 2, 2, 2]], dtype=torch.float32)
    m = metrics_from_stats(st)
    assert m["acc"] == [0.5, 0.5, 1.0] and abs(m["tau"] - (1 + 0.5 + 0.25 + 0.25)) < 1e-6
    assert m["acc_label"] == [0.25, 0.75, 1.0]
