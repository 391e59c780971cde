"""shared/tuning.py writes tuned kernel configs in the format FLA's own lookup reads back."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
fla_cache = pytest.importorskip("fla.ops.utils.cache")

from shared import tuning  # noqa: E402


def _tuner():
    @triton.jit
    def norm_kernel(x, T, D, NB, BT: triton.language.constexpr):
        pass

    configs = [triton.Config({"BT": bt}, num_warps=w) for bt in (16, 64) for w in (2, 8)]
    return fla_cache.fla_cache_autotune(configs=configs, key=["D", "NB"])(norm_kernel)


def test_recorded_configs_are_found_by_fla_exact_and_for_other_sizes(tmp_path, monkeypatch):
    t = _tuner()
    rec = tuning.Recorder(tmp_path, tuners=[t])
    assert rec() == 0 and not list(tmp_path.iterdir())  # nothing tuned yet, nothing written
    t.cache[(128, 12, "torch.bfloat16")] = triton.Config({"BT": 64}, num_warps=8)  # what a tuning leaves
    assert rec() == 1 and rec() == 0  # written once, not again until another key is tuned
    monkeypatch.setattr(fla_cache, "FLA_CACHE_MODE", fla_cache.FlaCacheMode.FUZZY)
    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path))
    key = lambda *k: fla_cache.AutotuneKey(autotune_key=k)  # noqa: E731
    exact = fla_cache.load_cached_config("norm_kernel", key(128, 12, "torch.bfloat16"))
    other_size = fla_cache.load_cached_config("norm_kernel", key(128, 3, "torch.bfloat16"))
    assert exact == other_size and exact["kwargs"] == {"BT": 64} and exact["num_warps"] == 8
    # another dtype is not the same kernel: FLA tunes it
    assert fla_cache.load_cached_config("norm_kernel", key(128, 12, "torch.float32")) is None
    # the lookup FLA's autotuner makes before tuning puts the recorded config in its cache
    t2 = _tuner()
    t2.maybe_load_cached_config(key=key(128, 5, "torch.bfloat16"), nargs={}, runtime_kwargs={})
    cfg = t2.cache[(128, 5, "torch.bfloat16")]
    assert cfg.kwargs == {"BT": 64} and cfg.num_warps == 8


def test_autotuners_are_found_under_heuristics():
    t = _tuner()
    wrapped = triton.heuristics({"HAS_X": lambda args: True})(t)  # how FLA decorates cumsum
    assert tuning.autotuner_of(wrapped) is t and tuning.autotuner_of(t) is t
    assert tuning.autotuner_of(object()) is None


def test_config_folder_is_per_gpu_and_target_shape(tmp_path):
    a = tuning.config_dir("NVIDIA H200", {"hidden_size": 5120, "linear_key_head_dim": 128}, str(tmp_path))
    b = tuning.config_dir("NVIDIA H200", {"hidden_size": 4096, "linear_key_head_dim": 128}, str(tmp_path))
    c = tuning.config_dir("NVIDIA H100 80GB HBM3", {"hidden_size": 5120, "linear_key_head_dim": 128}, str(tmp_path))
    assert len({a, b, c}) == 3 and a.parent.name == "NVIDIA_H200"
    # fields that do not shape the kernels do not split the cache
    assert a == tuning.config_dir("NVIDIA H200", {"hidden_size": 5120, "linear_key_head_dim": 128,
                                                  "vocab_size": 1}, str(tmp_path))


def test_enable_keeps_what_the_user_set(tmp_path, monkeypatch):
    monkeypatch.setattr(fla_cache, "FLA_CACHE_MODE", fla_cache.FLA_CACHE_MODE)  # restored afterwards
    for var in ("FLA_CONFIG_DIR", "FLA_CACHE_MODE", "TRITON_CACHE_AUTOTUNING"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    rec = tuning.enable("NVIDIA H200", {"hidden_size": 64})
    assert rec is not None and rec.folder.is_dir() and str(rec.folder).startswith(str(tmp_path))
    assert fla_cache.FLA_CACHE_MODE is fla_cache.FlaCacheMode.FUZZY
    monkeypatch.setenv("FLA_CACHE_MODE", "disabled")
    assert tuning.enable("NVIDIA H200", {"hidden_size": 64}) is None
    assert fla_cache.FLA_CACHE_MODE is fla_cache.FlaCacheMode.DISABLED


def test_shipped_tunings_seed_a_fresh_machine_and_never_replace_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(fla_cache, "FLA_CACHE_MODE", fla_cache.FLA_CACHE_MODE)  # restored afterwards
    for var in ("FLA_CONFIG_DIR", "FLA_CACHE_MODE", "TRITON_CACHE_AUTOTUNING"):
        monkeypatch.delenv(var, raising=False)
    shipped = tmp_path / "shipped"
    cfg = {"hidden_size": 64}
    src = tuning.config_dir("NVIDIA H200", cfg, str(shipped))
    src.mkdir(parents=True)
    for name in ("a_kernel", "b_kernel"):
        (src / f"{name}.json").write_text(f'{{"kernel_name": "{name}", "autotune_entries": {{}}}}')
    monkeypatch.setattr(tuning, "SHIPPED", shipped)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "machine"))
    mine = tuning.config_dir("NVIDIA H200", cfg)
    mine.mkdir(parents=True)
    (mine / "b_kernel.json").write_text("tuned here")
    rec = tuning.enable("NVIDIA H200", cfg)
    assert rec.folder == mine and rec.seeded == ["a_kernel"]
    assert (mine / "a_kernel.json").read_text() == (src / "a_kernel.json").read_text()
    assert (mine / "b_kernel.json").read_text() == "tuned here"
    # another GPU gets nothing shipped for this one
    monkeypatch.delenv("FLA_CONFIG_DIR")
    other = tuning.enable("NVIDIA H100 80GB HBM3", cfg).folder
    assert other != mine and not list(other.iterdir())
    # a folder the user chose is left as it is
    user = tmp_path / "user"
    monkeypatch.setenv("FLA_CONFIG_DIR", str(user))
    assert tuning.enable("NVIDIA H200", cfg).folder == user and not list(user.iterdir())


@pytest.mark.parametrize("gpu", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_shipped_tunings_are_fla_config_files_for_the_27b_shape(gpu):
    from transformers import Qwen3_5TextConfig
    shape = dict(hidden_size=5120, num_attention_heads=24, head_dim=256, linear_num_key_heads=16,
                 linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                 linear_conv_kernel_dim=4)
    folder = tuning.config_dir(gpu, Qwen3_5TextConfig(**shape).to_dict(), str(tuning.SHIPPED))
    files = sorted(folder.glob("*.json"))
    assert [f.stem for f in files] == sorted(["chunk_fwd_kernel_o", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
                                             "chunk_gated_delta_rule_fwd_kkt_solve_kernel",
                                             "chunk_local_cumsum_scalar_kernel", "l2norm_fwd_kernel",
                                             "recompute_w_u_fwd_kernel"])
    for f in files:
        parsed = fla_cache.KernelConfigFile.from_file(f)
        assert parsed is not None and parsed.kernel_name == f.stem and parsed.autotune_entries
        for entry in parsed.autotune_entries.values():
            assert "num_warps" in entry["config"] and entry["autotune_key"]
