"""Typed settings for both stages, with their validation."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.store import CODECS


def parse_gpus(spec: str | None) -> list[int]:
    """"0,1" -> [0, 1]; "" -> [] (CPU). Checked against the GPUs that exist."""
    if spec is None or str(spec).strip() == "":
        return []
    try:
        ids = [int(x) for x in str(spec).split(",") if x.strip() != ""]
    except ValueError:
        raise ValueError(f"GPUS={spec!r}: expected a comma-separated list of GPU numbers, e.g. 0,1") from None
    if len(set(ids)) != len(ids):
        raise ValueError(f"GPUS={spec!r}: a GPU is listed twice")
    import torch
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    bad = [i for i in ids if i < 0 or i >= n]
    if bad:
        raise ValueError(f"GPUS={spec!r}: GPU {bad} does not exist (this machine has {n} GPU"
                         f"{'s' if n != 1 else ''}{': 0..' + str(n - 1) if n else ''})")
    return ids


@dataclass
class ExtractConfig:
    data: str
    target: str
    store: str
    gpus: list[int] = field(default_factory=list)
    cpu_workers: int = 1               # worker processes when no GPU is listed (tests use 2)
    layer_ids: list[int] | None = None  # None: DFlash default for `draft_layers`
    draft_layers: int = 5
    max_len: int = 4096
    too_long: str = "truncate"          # "truncate" | "skip"
    precision: str = "bf16"             # "bf16" (lossless) | "fp8" (e4m3, per-token-layer scale)
    codec: str = "zstd1"                # fastest through zarr at the best ratio seen on features (BENCHMARKS.md)
    topk: int = 16
    batch_tokens: int = 16384           # padded tokens per forward
    max_batch: int = 64
    shard_tokens: int = 16384           # tokens per unit (= per shard of every token array)
    chunk_tokens: int = 64              # tokens per compressed chunk of features/hidden
    writers: int = 3                    # units compressed and written in parallel per worker
    queue_units: int = 2                # finished units waiting for a writer (bounds host memory)
    dtype: str = "auto"                 # compute dtype: auto = bf16 on GPU, fp32 on CPU
    logit_chunk: int = 2048             # tokens per LM-head chunk when computing top-k and lse
    overwrite: bool = False
    progress: bool = True

    def validate(self):
        if self.too_long not in ("truncate", "skip"):
            raise ValueError(f"--too-long must be 'truncate' or 'skip', not {self.too_long!r}")
        if self.precision not in ("bf16", "fp8"):
            raise ValueError(f"--precision must be 'bf16' or 'fp8', not {self.precision!r}")
        if self.codec not in CODECS:
            raise ValueError(f"--codec {self.codec!r} unknown; choose one of {', '.join(CODECS)}")
        if self.max_len > self.shard_tokens:
            raise ValueError(f"--max-len {self.max_len} exceeds --shard-tokens {self.shard_tokens}: "
                             f"a sample must fit in one unit")
        if self.shard_tokens % self.chunk_tokens:
            raise ValueError(f"--shard-tokens {self.shard_tokens} must be a multiple of "
                             f"--chunk-tokens {self.chunk_tokens}")
        if self.topk < 1:
            raise ValueError("--topk must be at least 1")
        if self.batch_tokens < self.max_len:
            raise ValueError(f"--batch-tokens {self.batch_tokens} must be at least --max-len {self.max_len}")
        return self

    def run_key(self) -> dict:
        """Settings that change the store's contents: a resumed run must match them."""
        return {k: getattr(self, k) for k in ("max_len", "too_long", "precision", "codec", "topk",
                                              "shard_tokens", "chunk_tokens")}
