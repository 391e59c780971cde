"""Drafter and training settings.

DrafterConfig reads and writes the public DFlash checkpoint's config.json format: a Qwen3
config plus `block_size`, `num_target_layers` and `dflash_config: {target_layer_ids,
mask_token_id}`. Unknown fields are refused by name, so a typo never silently trains the
default.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from shared.target import default_layer_ids

# Qwen3 config fields that carry no meaning for the drafter's math but appear in public configs.
PASSTHROUGH = {"architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
               "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "attention_dropout",
               "max_window_layers", "use_sliding_window", "tie_word_embeddings", "hidden_act",
               "auto_map", "rope_scaling", "rope_parameters", "max_position_embeddings"}


class ConfigError(ValueError):
    pass


@dataclass
class DrafterConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_hidden_layers: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    attention_bias: bool = False
    initializer_range: float = 0.02

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for "
                              f"{self.num_hidden_layers} layers")
        bad = [t for t in self.layer_types if t not in ("full_attention", "sliding_attention")]
        if bad:
            raise ConfigError(f"layer_types: unknown {bad}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ConfigError("sliding_attention layers need sliding_window")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 2:
            raise ConfigError("block_size must be at least 2")

    # -- public config.json ----------------------------------------------------------------
    def to_hf(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("target_layer_ids", "mask_token_id")}
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_act": "silu",
            "tie_word_embeddings": False, "max_position_embeddings": 32768, "torch_dtype": "bfloat16",
            "use_sliding_window": "sliding_attention" in self.layer_types,
            **d,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids),
                              "mask_token_id": self.mask_token_id, "block_size": self.block_size},
        }

    @classmethod
    def from_hf(cls, d: dict, where: str = "config") -> "DrafterConfig":
        d = dict(d)
        dflash = d.pop("dflash_config", {}) or {}
        unknown_inner = set(dflash) - {"target_layer_ids", "mask_token_id", "block_size"}
        if unknown_inner:
            raise ConfigError(f"{where}: unknown field(s) dflash_config.{sorted(unknown_inner)}")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known - PASSTHROUGH
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
        kw = {k: v for k, v in d.items() if k in known}
        if "rope_theta" not in kw and isinstance(d.get("rope_parameters"), dict):
            kw["rope_theta"] = d["rope_parameters"].get("rope_theta", 1e6)
        kw["target_layer_ids"] = dflash.get("target_layer_ids", d.get("target_layer_ids"))
        kw["mask_token_id"] = dflash.get("mask_token_id", d.get("mask_token_id"))
        if "block_size" in dflash:
            kw["block_size"] = dflash["block_size"]
        if kw.get("head_dim") is None and "hidden_size" in kw and "num_attention_heads" in kw:
            kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
        required = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                    "num_hidden_layers", "vocab_size", "num_target_layers", "target_layer_ids",
                    "mask_token_id")
        missing = [m for m in required if kw.get(m) is None]
        if missing:
            raise ConfigError(f"{where}: missing field(s) {missing}")
        return cls(**kw)

    @classmethod
    def load(cls, path: str | Path) -> "DrafterConfig":
        p = Path(path)
        p = p / "config.json" if p.is_dir() else p
        if not p.exists():
            raise ConfigError(f"drafter config {p}: no such file")
        try:
            return cls.from_hf(json.loads(p.read_text()), where=str(p))
        except json.JSONDecodeError as e:
            raise ConfigError(f"drafter config {p}: invalid JSON ({e})") from None

    @classmethod
    def default_for(cls, manifest: dict, num_layers: int = 5, block_size: int = 16) -> "DrafterConfig":
        """DFlash defaults derived from the store's target: same hidden size, the target's heads,
        head_dim at most 128, its intermediate size, DFlash's default layers for num_layers."""
        t = manifest["target"]
        tc = t["config"]
        mask = manifest["tokenizer"].get("mask_token_id")
        if mask is None:
            raise ConfigError("the target tokenizer has no mask token: give a drafter config with "
                              "dflash_config.mask_token_id (DRAFT=...)")
        head_dim = min(int(tc.get("head_dim") or t["hidden_size"] // tc["num_attention_heads"]), 128)
        return cls(hidden_size=t["hidden_size"], num_attention_heads=tc["num_attention_heads"],
                   num_key_value_heads=tc.get("num_key_value_heads", tc["num_attention_heads"]),
                   head_dim=head_dim, intermediate_size=tc["intermediate_size"],
                   num_hidden_layers=num_layers, vocab_size=t["vocab_size"],
                   num_target_layers=t["num_hidden_layers"],
                   target_layer_ids=default_layer_ids(t["num_hidden_layers"], num_layers),
                   mask_token_id=int(mask), block_size=block_size,
                   rms_norm_eps=tc.get("rms_norm_eps", 1e-6))


@dataclass
class TrainConfig:
    store: str
    out: str
    target: str | None = None          # where embed_tokens/lm_head come from (default: manifest path)
    draft: str | None = None           # drafter config.json (default: derived from the store)
    draft_layers: int = 5
    block_size: int = 16
    gpus: list[int] = field(default_factory=list)
    seq_len: int = 4096                # packed row length (one static shape)
    max_anchors: int = 512
    micro_batch: int = 1
    grad_accum: int = 1
    epochs: int = 6
    max_steps: int | None = None       # total steps (the schedule's length); default: epochs
    stop_after: int | None = None      # stop after this step, schedule unchanged (resume tests, time limits)
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float = 7.0
    labels: str = "data"               # "data" | "argmax" | "distill"
    compile: str = "attention"         # "attention" | "full" | "none"
    attention: str = "auto"            # "auto" | "flex" | "sdpa"
    dtype: str = "auto"                # autocast: bf16 on GPU, fp32 on CPU
    seed: int = 0
    workers: int = 4                   # DataLoader processes per rank
    prefetch: int = 4
    log_every: int = 10
    save_every: int = 200
    eval_every: int = 0
    eval_samples: int = 0              # held out from training for the offline tau estimate
    loss_chunk: int = 4096             # rows per LM-head chunk in the loss
    online: bool = False               # baseline: run the target in the step instead of reading features
    resume: bool = False
    progress: bool = True

    def validate(self):
        if self.labels not in ("data", "argmax", "distill"):
            raise ConfigError(f"--labels must be data, argmax or distill, not {self.labels!r}")
        if self.compile not in ("attention", "full", "none"):
            raise ConfigError(f"--compile must be attention, full or none, not {self.compile!r}")
        if self.attention not in ("auto", "flex", "sdpa"):
            raise ConfigError("--attention must be auto, flex or sdpa")
        if self.micro_batch < 1 or self.grad_accum < 1 or self.max_anchors < 1:
            raise ConfigError("--micro-batch, --grad-accum and --max-anchors must be positive")
        return self
