"""bf16 weights with float32 masters (`--weights bf16`) against float32 weights under autocast:
the same update to bf16 tolerance, float32 accumulation over micro-batches, exact resume, and
float32 masters in the checkpoint."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import params, tcfg
from train.config import DrafterConfig
from train.loss import slot_targets
from train.mask import sample_anchors
from train.model import DFlashDrafter
from train.precision import MasterWeights
from train.step import StepConfig, train_step


def tiny_batch(S, A, n_layers, H, V, seed):
    g = torch.Generator().manual_seed(seed)
    lm = torch.ones(S, dtype=torch.bool)
    lm[:4] = False
    doc = torch.zeros(S, dtype=torch.long)
    anchors, valid = sample_anchors(lm, doc, A, g)
    return {"hidden": torch.randn(1, S, n_layers * H, generator=g).bfloat16(), "input_ids": torch.randint(0, V, (1, S), generator=g),
            "loss_mask": lm[None], "doc": doc[None], "argmax": torch.randint(0, V, (1, S), generator=g),
            "anchors": anchors[None], "anchor_valid": valid[None]}


def test_master_step_equals_autocast_step():
    """Two micro-batches, SGD (so the update is the clipped gradient itself, not Adam's sign):
    the bf16-weight step moves the float32 masters as the float32-weight step moves its weights."""
    H, V = 32, 64
    dcfg = DrafterConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                         num_hidden_layers=2, vocab_size=V, num_target_layers=4, target_layer_ids=[0, 2],
                         mask_token_id=V - 1, block_size=4)
    torch.manual_seed(0)
    ref = DFlashDrafter(dcfg)
    got = copy.deepcopy(ref)
    master = MasterWeights(got)
    assert all(p.dtype == torch.bfloat16 for p in got.parameters())
    embed, head = (torch.randn(V, H) * 0.5).bfloat16(), (torch.randn(V, H) * 0.5).bfloat16()
    mbs = [tiny_batch(48, 6, 2, H, V, s) for s in (1, 2)]
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    sc = StepConfig.of(ref, loss_chunk=16, grad_clip=1e9)
    ra = train_step(ref, torch.optim.SGD(ref.parameters(), lr=1.0), None, embed, head, mbs, sc, autocast)
    rb = train_step(got, torch.optim.SGD(master.masters, lr=1.0), None, embed, head, mbs, sc, autocast, master)
    assert abs(float(ra["loss_sum"]) - float(rb["loss_sum"])) < 1e-2 * abs(float(ra["loss_sum"]))
    state = master.state_dict()
    for n, p in ref.named_parameters():
        assert state[n].dtype == torch.float32
        du, dv = p.detach() - before[n], state[n] - before[n]
        assert float(du.abs().max()) > 0, n
        torch.testing.assert_close(dv, du, rtol=0.05, atol=0.05 * float(du.abs().max()))
        # the model's bf16 weights are the masters rounded
        assert torch.equal(dict(got.named_parameters())[n].detach(), state[n].bfloat16()), n
    assert all(p.grad is None for p in got.parameters())


def test_bf16_weights_resume_exactly_with_float32_masters(store, draft, tmp_path):
    from train.loop import train
    kw = dict(seq_len=256, max_steps=10, save_every=4, dtype="bf16", weights="bf16")
    full = train(tcfg(store, draft, tmp_path / "a", **kw))
    train(tcfg(store, draft, tmp_path / "b", stop_after=6, **kw))
    resumed = train(tcfg(store, draft, tmp_path / "b", resume=True, **kw))
    pa, pb = params(tmp_path / "a"), params(tmp_path / "b")
    assert all(v.dtype == torch.float32 for v in pa.values())
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    assert [h["loss"] for h in full["history"]] == [h["loss"] for h in resumed["history"]]


def test_bf16_weights_need_bf16_compute(store, draft, tmp_path):
    from train.config import ConfigError
    from train.loop import train
    with pytest.raises(ConfigError, match="--weights bf16 needs --dtype bf16"):
        train(tcfg(store, draft, tmp_path / "c", max_steps=2, dtype="fp32", weights="bf16"))


def test_two_ranks_with_bf16_weights_equal_one_rank_with_accumulation(store, draft, tmp_path):
    """bf16 weights under DDP (2 CPU processes, gloo): each micro-batch's bf16 gradient is
    all-reduced, then added into the float32 masters. Against one process accumulating two
    micro-batches: the same loss and global gradient norm to bf16 rounding of the all-reduced
    sum, and masters within a fraction of one step (lr). A missing or double reduction moves the
    norm by about 2x, far outside these bounds."""
    import sys

    from conftest import finish_groups, history, start_group
    from train.loop import train
    kw = dict(seq_len=512, max_steps=4, log_every=1, dtype="bf16", weights="bf16")
    train(tcfg(store, draft, tmp_path / "one", grad_accum=2, **kw))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "train",
           "--store", str(store), "--out", str(tmp_path / "two"), "--draft", str(draft), "--seq-len", "512",
           "--max-anchors", "16", "--max-steps", "4", "--lr", "3e-3", "--workers", "0", "--loss-chunk", "64",
           "--log-every", "1", "--dtype", "bf16", "--weights", "bf16", "--no-progress"]
    proc = start_group(cmd)
    err = finish_groups([proc])[0]
    assert proc.returncode == 0, err[-3000:]
    h1, h2 = history(tmp_path / "one"), history(tmp_path / "two")
    assert [h["step"] for h in h1] == [h["step"] for h in h2] == [1, 2, 3, 4]
    for a, b in zip(h1, h2):
        assert abs(a["loss"] - b["loss"]) <= 2e-3 * a["loss"], (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 2e-2 * a["grad_norm"], (a["grad_norm"], b["grad_norm"])
    p1, p2 = params(tmp_path / "one"), params(tmp_path / "two")
    for k in p1:
        assert p1[k].dtype == p2[k].dtype == torch.float32
        off = ((p1[k] - p2[k]).abs() > 1.5e-3).float().mean()  # half of one Adam step of lr 3e-3
        assert off < 0.02, (k, float(off))
