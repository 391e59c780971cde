"""Training agrees with serving and never trains or exports garbage: the engines' per-layer mask
rule and config keys, the AutoModel route of an export, corrupt and non-finite data, the
store's own target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from train.checkpoint import TrainingError
from train.config import ConfigError, DrafterConfig, TrainConfig


def drafter_cfg(tiny, **kw) -> DrafterConfig:
    base = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                intermediate_size=128, num_hidden_layers=3, vocab_size=512, num_target_layers=4,
                target_layer_ids=[0, 3], mask_token_id=tiny["tokenizer"].mask_token_id, block_size=4,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=8)
    base.update(kw)
    return DrafterConfig(**base)


@pytest.fixture(scope="module")
def draft(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("draft") / "config.json"
    path.write_text(json.dumps(drafter_cfg(tiny).to_hf()))
    return path


def tcfg(store, draft, out, **kw):
    base = dict(store=str(store), out=str(out), draft=str(draft), seq_len=256, max_anchors=16, epochs=1,
                lr=3e-3, log_every=2, save_every=1000, workers=0, progress=False, loss_chunk=64, max_steps=6)
    base.update(kw)
    return TrainConfig(**base)


# --- the engines' mask rule and config keys ----------------------------------------------------

def test_layer_masks_follow_the_engines_rule(tiny):
    cfg = drafter_cfg(tiny)
    # vLLM _dflash_layer_causal: sliding layers causal with their window, full layers bidirectional
    assert [cfg.layer_mask(i) for i in range(3)] == [(True, 8), (True, 8), (False, None)]
    forced = drafter_cfg(tiny, causal=True)
    assert forced.layer_mask(2) == (True, None)
    with pytest.raises(ConfigError, match="causal = false with sliding_attention"):
        drafter_cfg(tiny, causal=False)
    assert drafter_cfg(tiny, layer_types=["full_attention"] * 3, causal=False).layer_mask(0) == (False, None)


def test_config_json_has_the_keys_the_engines_read_and_round_trips(tiny):
    cfg = drafter_cfg(tiny, causal=True, max_position_embeddings=8192, rope_theta=1e7)
    d = cfg.to_hf()
    assert d["block_size"] == d["dflash_config"]["block_size"] == 4
    assert d["num_target_layers"] == 4 and d["dflash_config"]["target_layer_ids"] == [0, 3]
    assert d["dflash_config"]["mask_token_id"] == cfg.mask_token_id and d["dflash_config"]["causal"] is True
    assert d["layer_types"] == cfg.layer_types and d["sliding_window"] == 8 and d["use_sliding_window"]
    assert d["max_position_embeddings"] == 8192 and d["rope_parameters"]["rope_theta"] == 1e7
    assert d["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert "eagle_aux_hidden_state_layer_ids" not in json.dumps(d)
    assert DrafterConfig.from_hf(d) == cfg
    assert "causal" not in drafter_cfg(tiny).to_hf()["dflash_config"]  # the engines' default


@pytest.mark.parametrize("change,match", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not implemented"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 4]}, "unshifted|one off"),
    ({"target_hidden_size": 128}, "target_hidden_size 128 != hidden_size 64"),
    ({"dflash_config": {"target_layer_ids": [0, 3], "mask_token_id": 3, "causal": "yes"}}, "true or false"),
])
def test_config_refuses_what_is_not_implemented(tiny, change, match):
    d = {**drafter_cfg(tiny).to_hf(), **change}
    d.pop("rope_parameters") if "rope_scaling" in change else None
    with pytest.raises(ConfigError, match=match):
        DrafterConfig.from_hf(d)


def test_is_causal_precedence_as_vllm(tiny):
    d = drafter_cfg(tiny, layer_types=["full_attention"] * 3).to_hf()
    d["is_causal"] = True
    d["dflash_config"]["causal"] = False
    assert DrafterConfig.from_hf(d).causal is True


# --- the export loads through AutoModel and gives the trainer's outputs -------------------------

@pytest.mark.parametrize("causal", [None, True])
def test_automodel_route_gives_the_trainers_outputs(tiny, tmp_path, causal):
    from transformers import AutoModel

    from train.export import export
    from train.model import DFlashDrafter
    from train.step import draft
    torch.manual_seed(0)
    cfg = drafter_cfg(tiny, causal=causal, sliding_window=3)  # a window shorter than the block
    ours = DFlashDrafter(cfg).eval()
    for p in ours.parameters():  # exactly representable in bf16, so the export loses nothing
        p.data = p.data.bfloat16().float()
    out = export(ours, tmp_path / "export")
    assert (out / "dflash.py").read_text() == (Path(__file__).parents[1] / "shared" / "dflash.py").read_text()
    hf, info = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32,
                                         output_loading_info=True)
    assert type(hf).__name__ == "DFlashDraftModel"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # decoding's case: context positions 0..a-1, one block anchored at a
    a, H = 11, cfg.hidden_size
    g = torch.Generator().manual_seed(1)
    ctx = torch.randn(1, a, 2 * H, generator=g)
    embed = torch.randn(512, H, generator=g)
    ids = torch.randint(0, 500, (1, a + 1), generator=g)
    batch = {"hidden": torch.cat([ctx, torch.zeros(1, 1, 2 * H)], 1), "input_ids": ids,
             "anchors": torch.tensor([[a]]), "anchor_valid": torch.ones(1, 1, dtype=torch.bool),
             "doc": torch.zeros(1, a + 1, dtype=torch.long)}
    with torch.no_grad():
        want = draft(ours, embed, batch)
        noise = embed[torch.tensor([[int(ids[0, a])] + [cfg.mask_token_id] * 3])]
        got = hf(target_hidden=ctx, noise_embedding=noise,
                 position_ids=torch.arange(a + 4)[None])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- corrupt and non-finite data ---------------------------------------------------------------

def _shard(store: Path, array: str, unit: int) -> Path:
    """The shard file of one unit (zarr v3 default keys: ARRAY/c/<unit>/0/0)."""
    return next(p for p in (store / array / "c" / str(unit)).rglob("*") if p.is_file())


def damage_shard(store: Path, tmp_path: Path, damage: str) -> Path:
    bad = tmp_path / "bad"
    shutil.copytree(store, bad)
    shard = _shard(bad, "features/hidden", 0)
    data = bytearray(shard.read_bytes())
    if damage == "flip":  # five bytes inside the compressed chunks: zstd still decodes them
        for i in range(5):
            data[100 + 37 * i] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    shard.write_bytes(bytes(data))
    return bad


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_shard_stops_training_naming_store_unit_sample(store, draft, tmp_path, damage):
    from train.loop import train
    bad = damage_shard(store, tmp_path, damage)
    with pytest.raises(TrainingError) as e:
        train(tcfg(bad, draft, tmp_path / "run", max_steps=60))
    msg = str(e.value)
    assert str(bad) in msg and "unit 0, sample " in msg and "chat.jsonl row" in msg, msg
    assert "Traceback" not in msg
    assert not (tmp_path / "run" / "export").exists()


def test_non_finite_step_stops_and_names_the_samples(store, draft, tmp_path):
    from shared.store import Store
    from train.loop import train
    bad = tmp_path / "nan"
    shutil.copytree(store, bad)
    s = Store(bad)
    lo, hi = s.span(3)
    import zarr
    zarr.open_group(str(bad), mode="r+")["features/hidden"][lo:lo + 2] = 0x7FC0  # bf16 NaN bits
    with pytest.raises(TrainingError) as e:
        train(tcfg(bad, draft, tmp_path / "run", max_steps=60, save_every=1))
    msg = str(e.value)
    assert "non-finite loss or gradient" in msg and "sample 3 (" in msg and "no weights were updated" in msg
    step = int(msg.split("step ")[1].split(":")[0])
    ck = sorted((tmp_path / "run" / "checkpoints").glob("step-*.pt"))
    assert ck and ck[-1].name == f"step-{step - 1:08d}.pt"  # nothing saved at or after the bad step
    assert not (tmp_path / "run" / "export").exists()
    # --skip-nonfinite: the step is skipped, counted, and the run ends with finite weights
    res = train(tcfg(bad, draft, tmp_path / "skip", max_steps=60, skip_nonfinite=True, log_every=60))
    assert res["history"][-1]["skipped_nonfinite"] >= 1
    from train.export import load_drafter
    assert all(torch.isfinite(p).all() for p in load_drafter(tmp_path / "skip" / "export").parameters())


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_cli_in_loader_workers_exits_non_zero_naming_the_sample(store, draft, tmp_path, damage):
    """What a user runs: loader worker processes, the error crossing back from a worker."""
    import os
    import subprocess
    import sys
    repo = Path(__file__).resolve().parents[1]
    bad = damage_shard(store, tmp_path, damage)
    res = subprocess.run([sys.executable, "-m", "train", "--store", str(bad), "--out", str(tmp_path / "o"),
                          "--draft", str(draft), "--seq-len", "256", "--max-anchors", "16", "--workers", "2",
                          "--no-progress", "--max-steps", "60"], cwd=repo, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}, timeout=600)
    err = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1, res.stderr[-2000:]
    assert err.startswith("error: ") and f"{bad}: unit 0, sample " in err and "row" in err, err
    assert not (tmp_path / "o" / "export").exists()


def test_export_and_checkpoint_refuse_non_finite_weights(tiny, tmp_path):
    from train.checkpoint import Checkpointer
    from train.export import export
    from train.model import DFlashDrafter
    m = DFlashDrafter(drafter_cfg(tiny))
    m.norm.weight.data[0] = float("inf")
    with pytest.raises(TrainingError, match="non-finite values in \\['norm.weight'\\]"):
        export(m, tmp_path / "e")
    with pytest.raises(TrainingError, match="non-finite"):
        Checkpointer(tmp_path).save({"step": 1, "model": m.state_dict()})
    assert not (tmp_path / "e").exists() and not list(tmp_path.rglob("*.pt"))


# --- the store's target is the target ------------------------------------------------------------

def test_another_checkpoint_with_the_same_shapes_is_refused(store, draft, tiny, tmp_path):
    from shared.tiny import build_target
    from train.loop import train
    other = tmp_path / "retrained"
    shutil.copytree(tiny["target"], other)
    build_target(tiny["tokenizer"], other, seed=7, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
                 linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                 initializer_range=0.2)
    with pytest.raises(ConfigError) as e:
        train(tcfg(store, draft, tmp_path / "o", target=str(other)))
    msg = str(e.value)
    from shared.store import Store
    want = Store(store).manifest.target.tensors_fingerprint
    assert "embed_tokens/lm_head fingerprint sha256:" in msg and want in msg and "--allow-other-target" in msg
    res = train(tcfg(store, draft, tmp_path / "o2", target=str(other), allow_other_target=True, max_steps=2))
    assert res["step"] == 2
