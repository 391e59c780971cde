"""Kernel autotuning that a machine pays once per kernel, not once per batch shape.

FLA's Triton kernels autotune per key, and some keys hold sizes: l2norm's holds the token count
of the forward in blocks (~1,400 tokens for the 27B shape), cumsum's the batch size. A corpus of
mixed lengths meets a dozen keys per kernel, each tuned anew (~12 s per l2norm key on an H200:
most of a first run's two minutes, docs/DESIGN.md "Extraction speed"). These kernels are
memory-bound and their configs (warps, rows per block) do not change results, so one tuned config
serves every size. FLA has the lookup for this: FLA_CACHE_MODE=fuzzy reads configs from
FLA_CONFIG_DIR, matching a key with any other that differs only in numbers (same dtypes and
flags). What FLA lacks is the writing: `Recorder` writes each tuned result there, after the forward
that tuned it, so the next new size of that kernel is looked up instead of tuned.

The folder is per GPU model and per target shape (head counts and dims), so a config is never
reused for another model's kernels; it lives beside Triton's cache (TRITON_CACHE_DIR), whose
on-disk autotune results (TRITON_CACHE_AUTOTUNING=1) serve the kernels FLA does not look up.

The repo ships the folders it has measured (shared/tuned/: the H200 and the H100 80GB with the 27B
shape, whose 6 tunings cost 40-60 s of a first run), as serving engines ship their tuned kernel configs per
GPU: a machine with that GPU and shape starts with them instead of tuning.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path

# the target's fields that decide the shapes of its linear-attention kernels
_SHAPE_FIELDS = ("hidden_size", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim", "num_attention_heads", "head_dim")


SHIPPED = Path(__file__).parent / "tuned"


def config_dir(device_name: str, target_config: dict, base: str | None = None) -> Path:
    base = base or os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")
    shape = {k: target_config.get(k) for k in _SHAPE_FIELDS}
    digest = hashlib.sha1(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
    gpu = re.sub(r"[^0-9A-Za-z]+", "_", device_name).strip("_") or "gpu"
    return Path(base) / "fla-configs" / gpu / digest


def enable(device_name: str, target_config: dict) -> "Recorder | None":
    """Before the first forward on a GPU. Keeps whatever the user set (FLA_CONFIG_DIR,
    FLA_CACHE_MODE=disabled to tune every key as FLA does by default). None without FLA."""
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    ours = "FLA_CONFIG_DIR" not in os.environ
    folder = Path(os.environ.setdefault("FLA_CONFIG_DIR", str(config_dir(device_name, target_config))))
    mode = os.environ.setdefault("FLA_CACHE_MODE", "fuzzy")
    try:
        import fla.ops.utils.cache as fla_cache
    except ImportError:
        return None
    fla_cache.FLA_CACHE_MODE = fla_cache.FlaCacheMode(mode)  # FLA reads the variable once, at import
    if fla_cache.FLA_CACHE_MODE is fla_cache.FlaCacheMode.DISABLED:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    rec = Recorder(folder)
    if ours:  # a folder the user gave is theirs to fill
        rec.seeded = seed(folder, config_dir(device_name, target_config, str(SHIPPED)))
    return rec


def seed(folder: Path, shipped: Path) -> list[str]:
    """Copies the shipped config files of this GPU and shape that folder lacks (never replacing
    one this machine tuned); returns the kernels copied."""
    copied = []
    for src in sorted(shipped.glob("*.json")) if shipped.is_dir() else []:
        dst = folder / src.name
        if not dst.exists():
            tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")  # several workers of a host may seed at once
            tmp.write_bytes(src.read_bytes())
            os.replace(tmp, dst)
            copied.append(src.stem)
    return copied


def autotuner_of(obj):
    """The FLA autotuner inside a kernel object (often under @triton.heuristics), or None."""
    from fla.ops.utils.cache import CachedAutotuner
    for _ in range(4):
        if isinstance(obj, CachedAutotuner):
            return obj
        obj = getattr(obj, "fn", None)
    return None


def fla_autotuners() -> list:
    """Every autotuner of FLA's config lookup among the modules imported so far."""
    found = {}
    for name, mod in list(sys.modules.items()):
        if name.startswith("fla.") and mod is not None:
            for v in list(vars(mod).values()):
                if (t := autotuner_of(v)) is not None:
                    found[id(t)] = t
    return list(found.values())


def _config_dict(cfg) -> dict:
    return {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "num_ctas": getattr(cfg, "num_ctas", 1), "maxnreg": getattr(cfg, "maxnreg", None),
            "ir_override": getattr(cfg, "ir_override", None)}


def write_config_file(folder: Path, tuner) -> Path:
    """tuner's results (its in-memory cache: key -> best config) as FLA's {kernel}.json, written
    whole (several workers of one host may write the same file)."""
    import triton
    from fla.ops.utils.cache import AutotuneKey
    entries = {AutotuneKey.key_hash(list(key)): {"autotune_key": list(key), "config": _config_dict(cfg)}
               for key, cfg in tuner.cache.items()}
    path = folder / f"{tuner.kernel_name}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"kernel_name": tuner.kernel_name, "triton_version": triton.__version__,
                               "autotune_entries": entries}, indent=1))
    os.replace(tmp, path)
    return path


class Recorder:
    """Call after each forward: writes the config file of every FLA kernel that tuned a new key."""

    def __init__(self, folder: Path, tuners: list | None = None):
        self.folder, self._given = folder, tuners
        self.seeded: list[str] = []  # kernels whose shipped configs enable() copied in
        self._tuners, self._modules, self._seen = [], -1, {}

    def __call__(self) -> int:
        if self._given is not None:
            self._tuners = self._given
        elif len(sys.modules) != self._modules:  # kernels are found once their modules are imported
            self._tuners, self._modules = fla_autotuners(), len(sys.modules)
        written = 0
        for t in self._tuners:
            n = len(t.cache)
            if n and n != self._seen.get(id(t)):
                write_config_file(self.folder, t)
                self._seen[id(t)] = n
                written += 1
        return written
