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
from typing import Literal

from shared.cli import opt, parse_gpus, parse_json_object, refuse_below
from shared.dflash import ROPE_KEYS, causal_setting, layer_mask, parse_rope_theta
from shared.schema import Manifest
from shared.target import default_layer_ids

# Qwen3 config fields that carry no meaning for the drafter's math but appear in public configs.
PASSTHROUGH = {"architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
               "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "attention_dropout",
               "max_window_layers", "use_sliding_window", "tie_word_embeddings", "hidden_act",
               "auto_map"}
DFLASH_KEYS = {"target_layer_ids", "mask_token_id", "block_size", "causal", "is_causal"}
# Written by us or read by the engines; never `eagle_aux_hidden_state_layer_ids` (vLLM takes
# it unshifted, as HF hidden_states indices: one layer off from target_layer_ids).
REFUSED = {"eagle_aux_hidden_state_layer_ids": "vLLM reads it as HF hidden_states indices, one off from "
                                               "dflash_config.target_layer_ids; give target_layer_ids only"}


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
    causal: bool | None = None          # dflash_config.causal: None = the engines' per-layer default
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    initializer_range: float = 0.02

    def __post_init__(self):
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "num_hidden_layers", "vocab_size", "num_target_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be a whole number of at least 1, not {v!r}")
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids is empty: the drafter reads at least one target layer")
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for "
                              f"{self.num_hidden_layers} layers")
        bad = [t for t in self.layer_types if t not in ("full_attention", "sliding_attention")]
        if bad:
            raise ConfigError(f"layer_types: unknown {bad}")
        sliding = "sliding_attention" in self.layer_types
        if sliding and not self.sliding_window:
            raise ConfigError("sliding_attention layers need sliding_window")
        if sliding and self.causal is False:
            raise ConfigError("dflash_config.causal = false with sliding_attention layers (a bidirectional block "
                              "under a sliding window) is not implemented: no engine's semantics for it are "
                              "pinned down. Drop `causal`, or use full_attention layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 2:
            raise ConfigError("block_size must be at least 2")

    # -- attention per layer, as the engines resolve it --------------------------------------
    def layer_mask(self, i: int) -> tuple[bool, int | None]:
        """(causal, window) of layer i, resolved as the engines resolve it (shared/dflash.py)."""
        return layer_mask(self, i)

    def mask_kinds(self) -> set[tuple[bool, int | None]]:
        return {self.layer_mask(i) for i in range(self.num_hidden_layers)}

    # -- public config.json ----------------------------------------------------------------
    def to_hf(self) -> dict:
        inner = {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
                 "block_size": self.block_size}
        if self.causal is not None:
            inner["causal"] = self.causal
        d = {k: v for k, v in asdict(self).items()
             if k not in ("target_layer_ids", "mask_token_id", "causal", "rope_theta")}
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_act": "silu",
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "use_sliding_window": "sliding_attention" in self.layer_types,
            **d,
            # both spellings: transformers 5 reads rope_parameters, older loaders rope_theta
            "rope_theta": self.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "dflash_config": inner,
            # loads with AutoModel.from_pretrained(dir, trust_remote_code=True): train/export.py
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        }

    @classmethod
    def from_hf(cls, d: dict, where: str = "config") -> "DrafterConfig":
        d = dict(d)
        dflash = d.pop("dflash_config", {}) or {}
        unknown_inner = set(dflash) - DFLASH_KEYS
        if unknown_inner:
            raise ConfigError(f"{where}: unknown field(s) dflash_config.{sorted(unknown_inner)}")
        for key, why in REFUSED.items():
            if key in d or key in dflash:
                raise ConfigError(f"{where}: field {key!r} is refused: {why}")
        try:
            rope = parse_rope_theta({k: d.pop(k, None) for k in ROPE_KEYS}, where)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        target_hidden = d.pop("target_hidden_size", None)
        if target_hidden is not None and target_hidden != d.get("hidden_size"):
            raise ConfigError(f"{where}: target_hidden_size {target_hidden} != hidden_size {d.get('hidden_size')}: "
                              f"the drafter uses the target's embed_tokens and lm_head, so both must be equal")
        known = {f.name for f in fields(cls)} - {"causal"}
        unknown = set(d) - known - PASSTHROUGH - {"is_causal"}
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
        kw = {k: v for k, v in d.items() if k in known}
        if rope is not None:
            kw["rope_theta"] = rope
        kw["target_layer_ids"] = dflash.get("target_layer_ids", d.get("target_layer_ids"))
        kw["mask_token_id"] = dflash.get("mask_token_id", d.get("mask_token_id"))
        if "block_size" in dflash:
            if "block_size" in d and d["block_size"] != dflash["block_size"]:
                raise ConfigError(f"{where}: block_size {d['block_size']} and dflash_config.block_size "
                                  f"{dflash['block_size']} differ")
            kw["block_size"] = dflash["block_size"]
        causal = causal_setting(d.get("is_causal"), dflash)
        if causal is not None:
            if not isinstance(causal, bool):
                raise ConfigError(f"{where}: causal must be true or false, not {causal!r}")
            kw["causal"] = causal
        if kw.get("head_dim") is None and "hidden_size" in kw and "num_attention_heads" in kw:
            kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
        required = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                    "num_hidden_layers", "vocab_size", "num_target_layers", "target_layer_ids",
                    "mask_token_id")
        missing = [m for m in required if kw.get(m) is None]
        if missing:
            raise ConfigError(f"{where}: missing field(s) {missing}")
        try:
            return cls(**kw)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None

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
    def default_for(cls, manifest: Manifest, num_layers: int = 5, block_size: int = 16,
                    mask_token_id: int | None = None) -> "DrafterConfig":
        """DFlash defaults derived from the store's target: same hidden size, the target's heads,
        head_dim at most 128, its intermediate size, DFlash's default layers for num_layers."""
        t = manifest.target
        tc = t.config
        mask = mask_token_id if mask_token_id is not None else manifest.tokenizer.mask_token_id
        if mask is None:
            raise ConfigError("the target tokenizer has no mask token: give --mask-token-id N (a token id the "
                              "chats never hold, e.g. a spare special token; serving reads it from the export's "
                              "dflash_config.mask_token_id) or a drafter config (DRAFT=...)")
        head_dim = min(int(tc.get("head_dim") or t.hidden_size // tc["num_attention_heads"]), 128)
        return cls(hidden_size=t.hidden_size, num_attention_heads=tc["num_attention_heads"],
                   num_key_value_heads=tc.get("num_key_value_heads", tc["num_attention_heads"]),
                   head_dim=head_dim, intermediate_size=tc["intermediate_size"],
                   num_hidden_layers=num_layers, vocab_size=t.vocab_size,
                   num_target_layers=t.num_hidden_layers,
                   target_layer_ids=default_layer_ids(t.num_hidden_layers, num_layers),
                   mask_token_id=int(mask), block_size=block_size,
                   rms_norm_eps=tc.get("rms_norm_eps", 1e-6),
                   max_position_embeddings=int(tc.get("max_position_embeddings") or 32768))


@dataclass
class TrainConfig:
    store: str = opt(help="the feature store (a path)")
    out: str = opt(help="run folder: checkpoints, metrics.jsonl, tb/, export/, best/")
    target: str | None = opt(None, "where embed_tokens/lm_head are read (default: the manifest's target path)")
    draft: str | None = opt(None, "drafter config.json in the public DFlash format (default: derived from the store)")
    draft_layers: int = opt(5, "draft layers of the derived default drafter")
    mask_token_id: int | None = opt(None, "the derived drafter's mask token (default: the tokenizer's mask token; "
                                          "targets without one, e.g. llama-family, need it)")
    block_size: int = opt(16, "block size of the derived default drafter")
    gpus: list[int] = opt(help="e.g. 0,1,2,3; empty: CPU", parse=parse_gpus, default_factory=list)
    seq_len: int = opt(4096, "packed row length (one static shape)")
    max_anchors: int = opt(512, "anchors per row")
    micro_batch: int = opt(1, "rows per forward")
    grad_accum: int = opt(1, "forwards per optimizer step")
    epochs: int = opt(6, "epochs (each epoch's step count comes from its own packing)")
    max_steps: int | None = opt(None, "total steps, the schedule's length (default: the epochs' steps)")
    stop_after: int | None = opt(None, "stop after this step, schedule unchanged (time limits, resume tests)")
    lr: float = opt(6e-4, "peak learning rate (AdamW)")
    min_lr_ratio: float = opt(0.0, "cosine floor, as a fraction of --lr")
    warmup_ratio: float = opt(0.04, "linear warmup, as a fraction of the steps")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(1.0, "gradient norm clip")
    gamma: float = opt(7.0, "loss decay over block slots: weight exp(-(k-1)/gamma)")
    labels: Literal["data", "argmax", "distill"] = opt(
        "data", "data: dataset tokens; argmax: the target's own choice; distill: its top-k distribution + tail")
    compile: Literal["auto", "blocks", "attention", "full", "none"] = opt(
        "auto", "blocks: torch.compile each decoder layer on its own (LM head and loss eager); "
        "attention: the flex_attention call only; full: the whole drafter (each but none also compiles "
        "the flex BlockMask's build); none; auto = blocks on a "
        "GPU, none on the CPU (small drafters there gain less than the compile costs)")
    attention: Literal["auto", "flex", "sdpa"] = opt("auto", "flex (GPU) or SDPA with the dense mask (CPU)")
    flex_options: dict = opt(help="flex_attention kernel_options as JSON, e.g. the backward's block sizes "
                                  "'{\"bwd_BLOCK_M1\": 64, \"bwd_BLOCK_N1\": 64}': meant for speed alone, but "
                                  "check the loss (ROWS_GUARANTEED_SAFE made it NaN on an H100)",
                             parse=parse_json_object, default_factory=dict)
    dtype: Literal["auto", "bf16", "fp32"] = opt("auto", "autocast dtype: auto = bf16 on GPU, fp32 on CPU")
    weights: Literal["auto", "bf16", "fp32"] = opt(
        "auto", "parameters the step runs on: bf16 with float32 masters in the optimizer, or fp32 under "
        "autocast; auto = bf16 when --dtype is bf16")
    seed: int = opt(0, "seed of the init, the shuffles and the anchors")
    init_from_target: bool = opt(False, "start the draft layers from the target's last attention layers and its "
                                        "final norm (leaves the unigram plateau sooner on a real target; "
                                        "train/init.py)")
    workers: int = opt(4, "DataLoader processes per rank")
    prefetch: int = opt(4, "batches prefetched per loader worker")
    log_every: int = opt(10, "steps per metrics record")
    save_every: int = opt(200, "steps per checkpoint")
    eval_every: int = opt(0, "steps per held-out offline tau estimate")
    eval_samples: int = opt(0, "the store's last N samples (widened to whole source rows), held out "
                                       "for the offline tau")
    loss_chunk: int = opt(2048, "rows per LM-head chunk in the loss (two bf16 (rows, vocab) buffers live at once)")
    online: bool = opt(False, "baseline: run the target in every step instead of reading features")
    skip_nonfinite: bool = opt(False, "skip a step whose gradient is not finite (counted) instead of stopping")
    allow_other_target: bool = opt(False, "train although --target's embed_tokens/lm_head differ from the store's target")
    resume: bool = opt(False, "continue the run in --out exactly")
    progress: bool = opt(True, "tqdm progress bar")

    def validate(self):
        refuse_below(self, ("micro_batch", "grad_accum", "max_anchors", "epochs", "draft_layers", "block_size",
                            "log_every", "save_every", "loss_chunk"), 1, ConfigError)
        refuse_below(self, ("max_steps", "stop_after"), 1, ConfigError, " (leave it out for the default)")
        refuse_below(self, ("workers", "eval_every", "eval_samples", "weight_decay", "min_lr_ratio", "warmup_ratio"),
                     0, ConfigError)
        for name in ("lr", "gamma", "grad_clip"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, not {getattr(self, name)}")
        if self.seq_len < 2 * self.block_size:
            raise ConfigError(f"--seq-len {self.seq_len}: a row must hold a context and a block of "
                              f"{self.block_size} (at least {2 * self.block_size} tokens)")
        for name, allowed in (("labels", ("data", "argmax", "distill")), ("compile", ("auto", "blocks", "attention", "full", "none")),
                              ("attention", ("auto", "flex", "sdpa")), ("dtype", ("auto", "bf16", "fp32")),
                              ("weights", ("auto", "bf16", "fp32"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"--{name} must be one of {', '.join(allowed)}, not {getattr(self, name)!r}")
        return self

    # options a resumed run may change: they decide neither the data order nor the updates
    RESUMABLE = ("resume", "progress", "stop_after", "workers", "prefetch", "log_every", "save_every", "target",
                 "flex_options")

    def resume_differences(self, saved: dict) -> list[str]:
        """The options that differ from the checkpoint's run (those it recorded)."""
        now = asdict(self)
        return [f"--{k.replace('_', '-')} {saved[k]!r} -> {now[k]!r}" for k in now
                if k not in self.RESUMABLE and k in saved and saved[k] != now[k]]
