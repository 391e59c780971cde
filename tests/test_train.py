"""Training from a store: one-process distributed (gloo), two-process DDP equivalence, resume,
export/reload, layer subsets, and every refusal before work starts."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_trained_alike, extract_cfg, finish_groups, params, start_group, tcfg
from extract.run import run as extract_run
from train.config import ConfigError, DrafterConfig

REPO = Path(__file__).resolve().parents[1]


def test_short_run_lowers_loss(store, draft, tmp_path):
    from train.loop import train
    res = train(tcfg(store, draft, tmp_path / "run", max_steps=40, lr=5e-3))
    losses = [h["loss"] for h in res["history"]]
    assert len(losses) == 20
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.5, losses  # clearly, not by noise
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rec = json.loads(lines[-1])
    assert {"loss", "acc", "tau", "tok_s", "peak_mem_gib", "lr"} <= rec.keys() and len(rec["acc"]) == 3


def uneven_seed(store, seq_len: int) -> tuple[int, list[int]]:
    """A seed whose epoch 1 packs into fewer rows than epoch 0 (what crashed the loop), and its
    rows per epoch."""
    from shared.store import Store
    from train.loader import EpochPlan
    s = Store(store)
    for seed in range(100):
        plan = EpochPlan(s, seq_len, seed, 0, 1)
        counts = [len(plan.rows(e)) for e in range(3)]
        if counts[1] < counts[0] and counts[0] % 2 == 1:
            return seed, counts
    raise AssertionError("no such seed")


def test_epochs_of_different_lengths_run_to_the_end(store, draft, tmp_path):
    """Greedy packing of each epoch's shuffle gives another row count; the schedule follows
    every epoch's own count, and its total is known before step 1."""
    from train.loop import train
    seed, counts = uneven_seed(store, 512)
    res = train(tcfg(store, draft, tmp_path / "run", seq_len=512, epochs=3, seed=seed, log_every=1))
    assert res["step"] == sum(counts)
    epochs = [h["epoch"] for h in res["history"]]
    assert [epochs.count(e) for e in range(3)] == counts
    assert res["history"][-1]["lr"] == pytest.approx(0.0, abs=1e-12)  # the cosine ended on the last step


def test_resume_equals_uninterrupted(store, draft, tmp_path):
    """Killed mid-epoch 1 (after the epoch boundary), resumed from the last checkpoint."""
    from train.loop import train
    seed, counts = uneven_seed(store, 512)
    kw = dict(seq_len=512, epochs=2, seed=seed, save_every=4)
    full = train(tcfg(store, draft, tmp_path / "a", **kw))
    stop = counts[0] + 5
    train(tcfg(store, draft, tmp_path / "b", stop_after=stop, **kw))  # "killed" after that step
    # the steps after the last checkpoint are lost with the process; the run resumes from it
    last_ck = stop // 4 * 4
    assert (tmp_path / "b" / "checkpoints" / "latest").read_text() == f"step-{last_ck:08d}.pt"
    resumed = train(tcfg(store, draft, tmp_path / "b", resume=True, **kw))
    assert resumed["step"] == full["step"] == sum(counts[:2])
    pa, pb = params(tmp_path / "a"), params(tmp_path / "b")
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    assert [h["loss"] for h in full["history"]] == [h["loss"] for h in resumed["history"]]
    logged = [json.loads(l)["step"] for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [h["step"] for h in full["history"]]


def test_two_ranks_equal_one_rank_with_accumulation(store, draft, tmp_path):
    """DDP on 2 CPU processes (gloo, torchrun) = 1 process with 2-step accumulation: the loss is
    normalised over the global batch and the ranks' shares interleave. Two whole epochs of
    different, odd row counts: the schedule and the shares agree on every epoch's length."""
    from train.loop import train
    seed, counts = uneven_seed(store, 512)
    one = train(tcfg(store, draft, tmp_path / "one", seq_len=512, epochs=2, seed=seed, grad_accum=2))
    assert one["step"] == counts[0] // 2 + counts[1] // 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "train",
           "--store", str(store), "--out", str(tmp_path / "two"), "--draft", str(draft), "--seq-len", "512",
           "--max-anchors", "16", "--epochs", "2", "--lr", "3e-3", "--seed", str(seed), "--workers", "0",
           "--loss-chunk", "64", "--log-every", "2", "--no-progress"]
    proc = start_group(cmd)
    err = finish_groups([proc])[0]  # ~40 s here; a hang fails with every rank's stack
    assert proc.returncode == 0, err[-3000:]
    assert_trained_alike(tmp_path / "one", tmp_path / "two", one["step"])


def test_the_ddp_model_is_freed_before_the_process_group(store, draft, tmp_path, monkeypatch):
    """DDP's reducer holds the process group; freed after destroy_process_group it frees gloo's
    group with the GIL held while gloo's worker thread may need the GIL: a 2-rank run hung at its
    exit that way. So when the group is destroyed, the DDP model must be gone already (on success
    and when the run fails)."""
    import gc
    import weakref

    import train.loop as tl
    seen, real_build, real_destroy = {}, tl.build_run, tl.dist.destroy_process_group

    def build_run(*args):
        run = real_build(*args)
        seen["model"] = weakref.ref(run.model)
        return run

    def destroy(*args, **kw):
        seen["alive at destroy"] = seen["model"]() is not None
        return real_destroy(*args, **kw)

    monkeypatch.setattr(tl, "build_run", build_run)
    monkeypatch.setattr(tl.dist, "destroy_process_group", destroy)
    tl.train(tcfg(store, draft, tmp_path / "ok", max_steps=2))
    assert seen.pop("alive at destroy") is False
    monkeypatch.setattr(tl, "loop", lambda run: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        tl.train(tcfg(store, draft, tmp_path / "failed", max_steps=2))
    gc.collect()
    assert seen.pop("alive at destroy") is False


def test_export_reload_gives_identical_logits(store, draft, tmp_path):
    from shared.store import Store
    from train.export import load_drafter
    from train.loader import EpochPlan, RowDataset, RowSpec
    from train.loop import train
    from train.model import DFlashDrafter
    from train.step import StepConfig, forward_loss
    from shared.target import load_embed_and_head
    train(tcfg(store, draft, tmp_path / "run", max_steps=2))
    out = tmp_path / "run" / "export"
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["block_size"] == 4
    assert conf["dflash_config"]["target_layer_ids"] == [0, 3] and "mask_token_id" in conf["dflash_config"]
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.1.self_attn.k_norm.weight", "layers.1.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= names
    # The trained weights, rounded to bf16 as exported, give exactly the reloaded model's outputs.
    ck = params(tmp_path / "run")
    ref = DFlashDrafter(DrafterConfig.load(out))
    ref.load_state_dict({k: v.bfloat16().float() for k, v in ck.items()})
    got = load_drafter(out)
    for k, v in ref.state_dict().items():
        assert torch.equal(v, got.state_dict()[k]), k
    s = Store(store)
    rows = EpochPlan(s, 256, 0, 0, 1).rows(0)
    batch = {k: v[None] for k, v in RowDataset(str(store), rows, RowSpec((0, 3), 256, 16, 0), 0)[0].items()}
    embed, head = load_embed_and_head(s.manifest.target.path)
    with torch.no_grad():
        a = forward_loss(ref, embed, head, batch, StepConfig.of(ref, loss_chunk=64))
        b = forward_loss(got, embed, head, batch, StepConfig.of(got, loss_chunk=64))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_loader_reads_the_layer_subset(store, tmp_path):
    from shared.store import Store
    from train.loader import EpochPlan, RowDataset, RowSpec
    s = Store(store)
    rows = EpochPlan(s, 256, 0, 0, 1).rows(0)
    item = RowDataset(str(store), rows, RowSpec((0, 3), 256, 16, 0), 0)[0]
    first = rows[0][1][0]
    x = s.read(first)
    n = len(x.input_ids)
    H = s.layout.hidden
    assert torch.equal(item["hidden"][:n, :H], x.hidden[:, 0]) and torch.equal(item["hidden"][:n, H:], x.hidden[:, 2])
    assert (item["doc"][:n] == 0).all() and item["anchor_valid"].any()
    # disjoint shares across ranks, covering every sample at most once
    r0, r1 = EpochPlan(s, 256, 0, 0, 2).rows(3), EpochPlan(s, 256, 0, 1, 2).rows(3)
    a, b = {i for _, r in r0 for i in r}, {i for _, r in r1 for i in r}
    assert not a & b and len(r0) == len(r1)


def test_refusals_before_any_work(store, draft, tiny, tmp_path):
    from train.loop import train
    with pytest.raises(ConfigError, match="not a feature store"):
        train(tcfg(tmp_path / "nope", draft, tmp_path / "o1"))
    # incomplete store
    inc = tmp_path / "inc"
    shutil.copytree(store, inc)
    import zarr
    g = zarr.open_group(str(inc), mode="r+")
    g.attrs["dflash"] = {**g.attrs["dflash"], "complete": False}
    with pytest.raises(ConfigError, match="extraction is not complete"):
        train(tcfg(inc, draft, tmp_path / "o2"))
    # drafter layers outside the store
    bad = json.loads(Path(draft).read_text())
    bad["dflash_config"]["target_layer_ids"] = [0, 2]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=r"\[0, 2\] are not a subset of the store's layers \[0, 1, 3\]"):
        train(tcfg(store, tmp_path / "bad.json", tmp_path / "o3"))
    # unknown field
    unk = json.loads(Path(draft).read_text())
    unk["num_hiden_layers"] = 3
    (tmp_path / "unk.json").write_text(json.dumps(unk))
    with pytest.raises(ConfigError, match="unknown field.*num_hiden_layers"):
        train(tcfg(store, tmp_path / "unk.json", tmp_path / "o4"))
    # embed/lm_head from another target
    from shared.tiny import build_target
    other = build_target(tiny["tokenizer"], tmp_path / "other", hidden_size=32, intermediate_size=64,
                         num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                         linear_value_head_dim=8)
    with pytest.raises(ConfigError, match="a store made by another target"):
        train(tcfg(store, draft, tmp_path / "o5", target=str(other)))
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 6))


def test_cli_refuses_missing_gpus(store, draft, tmp_path, capsys, monkeypatch):
    from train.__main__ import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a one-GPU host, whatever this one has
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["--store", str(store), "--out", str(tmp_path / "o"), "--gpus", "0,1"]) == 2
    assert "GPU [1] does not exist (this machine has 1 GPU: 0..0)" in capsys.readouterr().err


def test_fp8_store_decodes_on_the_device_to_the_readers_bf16(tiny, draft, tmp_path):
    """fp8 rows travel as e4m3 bits + scales; the step's decode equals Store.read's bf16."""
    from shared.store import Store
    from train.loader import EpochPlan, RowDataset, RowSpec
    from train.loop import train
    from train.step import context_features
    path = tmp_path / "fp8"
    extract_run(extract_cfg(tiny, path, precision="fp8"))
    s = Store(path)
    rows = EpochPlan(s, 256, 0, 0, 1).rows(0)
    item = RowDataset(str(path), rows, RowSpec((0, 3), 256, 16, 0), 0)[0]
    assert item["hidden"].dtype == torch.uint8 and item["hidden_scale"].shape == (256, 2)
    feats = context_features({k: v[None] for k, v in item.items()})[0]
    x = s.read(rows[0][1][0], [0, 3])
    n = len(x.input_ids)
    assert torch.equal(feats[:n], x.hidden.reshape(n, -1))
    res = train(tcfg(path, draft, tmp_path / "run", max_steps=2))
    assert res["step"] == 2 and all(h["loss"] == h["loss"] for h in res["history"])  # finite, no NaN


def test_offline_training_matches_online(store, draft, tmp_path, capsys):
    """Same seed, same data order: a drafter trained from the store and one trained with the
    target forward in the loop follow the same loss curve (features differ only by the fp32
    summation order of batched vs per-document extraction, below bf16 rounding)."""
    from train.loop import train
    off = train(tcfg(store, draft, tmp_path / "off", max_steps=10, log_every=1))
    on = train(tcfg(store, draft, tmp_path / "on", max_steps=10, log_every=1, online=True))
    a, b = [h["loss"] for h in off["history"]], [h["loss"] for h in on["history"]]
    with capsys.disabled():
        print("\noffline loss:", [round(x, 4) for x in a], "\nonline loss: ", [round(x, 4) for x in b])
    assert len(a) == len(b) == 10
    assert max(abs(x - y) for x, y in zip(a, b)) < 2e-3 * max(a)
    assert a[-1] < a[0]  # a curve, not a constant


def test_compiled_blocks_train_like_eager_without_recompiling(store, draft, tmp_path):
    """--compile blocks (each decoder layer compiled on its own, the GPU default) against the
    eager drafter on the same rows: the same losses and weights to float tolerance, and no graph
    compiled after the first step (static shapes)."""
    from train.loop import train
    kw = dict(max_steps=4, log_every=1, seed=3)
    eager = train(tcfg(store, draft, tmp_path / "eager", compile="none", **kw))
    blocks = train(tcfg(store, draft, tmp_path / "blocks", compile="blocks", **kw))
    assert eager["compiled_graphs"] == 0
    assert blocks["compiled_graphs"] >= 1 and blocks["recompiles"] == 0
    le, lb = [h["loss"] for h in eager["history"]], [h["loss"] for h in blocks["history"]]
    assert lb == pytest.approx(le, rel=1e-4)
    pa, pb = params(tmp_path / "eager"), params(tmp_path / "blocks")
    assert pa.keys() == pb.keys()  # in-place compilation leaves the parameter names alone
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=1e-4, atol=3e-5, msg=k)
