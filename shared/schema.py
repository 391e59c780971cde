"""What a feature store holds: its arrays (names, per-token shapes, dtypes), its manifest, and the
conversions of features into the stored dtypes. shared/store.py reads and writes them.

Layout (one Zarr v3 group; token arrays are concatenated over samples, no padding stored):

    STORE/
      zarr.json                       group; attributes["dflash"] = the manifest
      tokens/input_ids   (T,)   int32
      tokens/loss_mask   (T,)   uint8
      features/hidden    (T, L, H) uint16 (bf16 bits) | uint8 (fp8 e4m3 bits)
      features/scale     (T, L) float32   fp8 only: per token and layer, hidden = fp8 * scale
      logits/topk_idx    (T, K) int32     target's top-K tokens, best first (argmax = [:, 0])
      logits/topk_logp   (T, K) float16   their log-probabilities (logit - lse)
      logits/lse         (T,)   float32   log-sum-exp over the full vocabulary (tail mass known)
      index/offset       (N,)   int64     sample -> first token
      index/length       (N,)   int32     sample -> token count
      index/row          (N,)   int64     sample -> source row (within its file)
      index/file         (N,)   int32     sample -> source file (names in the manifest)
      index/ok           (N,)   uint8     0 for samples dropped at extraction (NaN features)
      _progress/unit-XXXXXXX.json         one per finished unit, created whole and only once
      _claims/*.json                      who plans / computes a unit / finalizes, while a run is
                                          going (extract/claims.py); removed when the store is final
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch

from shared.compression import SMALL_ARRAYS_RATIO, expected_ratio

# 2: every chunk carries a crc32c of its compressed bytes, checked by zarr on every read.
FORMAT_VERSION = 2
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class StoreError(RuntimeError):
    """A store that is missing, incomplete, or does not match what is asked of it."""


@dataclass
class Layout:
    n_layers: int
    hidden: int
    topk: int
    precision: str  # "bf16" | "fp8"
    codec: str
    shard_tokens: int
    chunk_tokens: int
    n_units: int
    n_samples: int

    @property
    def capacity(self) -> int:
        return self.n_units * self.shard_tokens

    def arrays(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (per-token shape, numpy dtype) for every token-axis array."""
        L, H, K = self.n_layers, self.hidden, self.topk
        shapes = {"tokens/input_ids": (), "tokens/loss_mask": (), "features/hidden": (L, H),
                  "features/scale": (L,), "logits/topk_idx": (K,), "logits/topk_logp": (K,), "logits/lse": ()}
        return {name: (shapes[name], dtype) for name, dtype in array_dtypes(self.precision).items()}

    def bytes_per_token(self, names=None) -> int:
        """Uncompressed bytes of one token in the named token-axis arrays (all of them if None)."""
        return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                   for name, (shape, dtype) in self.arrays().items() if names is None or name in names)

    def bf16_hidden_bytes_per_token(self) -> int:
        """The hidden states as uncompressed bf16: what compression figures are quoted against."""
        return self.n_layers * self.hidden * np.dtype("uint16").itemsize

    def estimated_disk_bytes_per_token(self) -> float:
        """Bytes on disk per token, by the codec's expected ratio on the hidden states (and their
        fp8 scales) on real features and zstd's on the rest."""
        hidden = self.bytes_per_token(HIDDEN_ARRAYS)
        return hidden / expected_ratio(self.codec, self.precision) + (self.bytes_per_token() - hidden) / SMALL_ARRAYS_RATIO


def array_dtypes(precision: str) -> dict[str, str]:
    """The numpy dtype of every token-axis array of a store of this precision: the one table."""
    return {"tokens/input_ids": "int32", "tokens/loss_mask": "uint8",
            "features/hidden": "uint16" if precision == "bf16" else "uint8",
            "logits/topk_idx": "int32", "logits/topk_logp": "float16", "logits/lse": "float32",
            **({"features/scale": "float32"} if precision == "fp8" else {})}


INDEX_ARRAYS = {"index/offset": "int64", "index/length": "int32", "index/row": "int64",
                "index/file": "int32", "index/ok": "uint8"}
FEATURE_ARRAYS = ("features/hidden", "features/scale", "logits/topk_idx", "logits/topk_logp", "logits/lse")
HIDDEN_ARRAYS = ("features/hidden", "features/scale")


@dataclass
class TargetInfo:
    path: str
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    layer_types: list[str] | None
    weights_fingerprint: str   # safetensors headers, sizes and sampled bytes (shared/target.py)
    tensors_fingerprint: str   # every byte of embed_tokens and lm_head: what training uses
    config: dict               # the target's text config


@dataclass
class TokenizerInfo:
    fingerprint: str           # vocabulary and chat template
    size: int
    pad_token_id: int | None
    eos_token_id: int | None
    mask_token_id: int | None


@dataclass
class DataInfo:
    spec: str                  # DATA as given
    files: list[dict]          # [{"path", "bytes", "sha256"}] in index/file order
    report: dict = field(default_factory=dict)  # rows read, kept, truncated, skipped by reason


@dataclass
class Manifest:
    """What made a store, in its zarr.json attributes under "dflash": read by every stage, written
    by extraction. to_dict/from_dict are the only places its keys are spelled."""
    target: TargetInfo
    tokenizer: TokenizerInfo
    data: DataInfo
    layer_ids: list[int]
    layer_convention: str
    precision: str
    codec: str
    topk: int
    max_len: int
    too_long: str
    chat_template_kwargs: dict  # the chat template options serving must use too
    run_key: dict               # the settings a resumed run must repeat
    dtypes: dict = field(default_factory=dict)
    layout: Layout | None = None
    kind: str = "dflash-target-features"
    created_at: str = ""
    format_version: int = FORMAT_VERSION
    complete: bool = False
    summary: dict | None = None
    completed_at: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "store") -> "Manifest":
        if d.get("format_version") != FORMAT_VERSION:
            raise StoreError(f"{where}: format version {d.get('format_version')}, this code reads "
                             f"{FORMAT_VERSION} (version 2 added per-chunk checksums): re-extract it")
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        try:
            kw["target"], kw["tokenizer"] = TargetInfo(**d["target"]), TokenizerInfo(**d["tokenizer"])
            kw["data"] = DataInfo(**d["data"])
            kw["layout"] = Layout(**d["layout"]) if d.get("layout") else None
            return cls(**kw)
        except (KeyError, TypeError) as e:
            raise StoreError(f"{where}: the manifest is not one this code wrote ({e})") from None


# --- features in the stored dtypes ----------------------------------------------------------

def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype a stored numpy dtype is held in on the device and in unit buffers: bf16
    bits as int16 (torch has no uint16 copy kernels on every version)."""
    return {"uint16": torch.int16, "uint8": torch.uint8, "int32": torch.int32, "float16": torch.float16,
            "float32": torch.float32, "int64": torch.int64}[str(np.dtype(dtype))]


def bits_to_bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def fp8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., H) -> e4m3 bits (uint8) and a float32 scale per row: x ~= fp8 * scale.
    Rows are (token, layer), so each layer of each token gets its own scale."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
    scale = amax / FP8_MAX
    q = (xf / scale).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale.squeeze(-1)


def fp8_decode(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (bits.view(torch.float8_e4m3fn).float() * scale.unsqueeze(-1)).to(torch.bfloat16)


def encode_features(precision: str, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_logp: torch.Tensor,
                    lse: torch.Tensor) -> dict[str, torch.Tensor]:
    """A batch's features in the store's dtypes, keyed by array, still on their device (so the
    conversion runs there and only stored bytes travel): hidden (T, L, H) as bf16 bits or fp8 +
    scale, top-k ids int32, log-probs float16, lse float32."""
    if precision == "bf16":
        out = {"features/hidden": hidden.to(torch.bfloat16).view(torch.int16)}
    else:
        q, scale = fp8_encode(hidden)
        out = {"features/hidden": q, "features/scale": scale}
    out.update({"logits/topk_idx": topk_idx, "logits/topk_logp": topk_logp, "logits/lse": lse})
    dtypes = array_dtypes(precision)
    return {name: t.to(torch_dtype(dtypes[name])) for name, t in out.items()}


def samples_by_unit(offsets: np.ndarray, shard_tokens: int, n_units: int) -> list[np.ndarray]:
    """Each unit's sample ids, ascending, from one stable sort of the index offsets (a scan of
    the whole index per unit costs samples x units)."""
    units = np.asarray(offsets) // shard_tokens
    order = np.argsort(units, kind="stable")
    bounds = np.searchsorted(units[order], np.arange(n_units + 1))
    return [order[bounds[u]:bounds[u + 1]] for u in range(n_units)]
