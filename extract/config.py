"""The extract stage's settings, typed, with their validation (the CLI is derived from them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.cli import opt, parse_gpus, parse_json_object, refuse_below
from shared.compression import CODECS


@dataclass
class ExtractConfig:
    data: str = opt(help="jsonl/json/parquet file, glob, folder, or datasets.save_to_disk folder")
    target: str = opt(help="local HF checkpoint (qwen3_5 / qwen3_5_text / qwen3)")
    store: str = opt(help="output Zarr store (resumed if it exists)")
    gpus: list[int] = opt(help="e.g. 0,1: one worker per GPU; empty: CPU", parse=parse_gpus, default_factory=list)
    cpu_workers: int = opt(1, "worker processes when no GPU is listed")
    layer_ids: list[int] | None = opt(None, "layer ids to keep, e.g. 1,16,31,46,61 (default: DFlash default for "
                                            "--draft-layers); id i = output of decoder layer i = HF "
                                            "hidden_states[i+1]", flag="--layers")
    draft_layers: int = opt(5, "draft layers the default layer set is made for")
    max_rows: int = opt(0, "read only DATA's first N rows (0: all), e.g. a slice of ShareGPT")
    max_len: int = opt(4096, "longer sequences are truncated or skipped")
    too_long: Literal["truncate", "skip"] = opt("truncate", "what happens to a sequence over --max-len")
    chat_template_kwargs: dict = opt(help="JSON object passed to the chat template, as serving passes it, e.g. "
                                          "'{\"enable_thinking\": false}'; recorded in the manifest",
                                     parse=parse_json_object, default_factory=dict)
    inexact_turns: Literal["split", "context"] = opt("split", "assistant turns that the row's one render does not "
                                                              "show as serving does (templates that drop earlier "
                                                              "turns' reasoning): split = a sample of their own "
                                                              "with their serving context; context = kept without "
                                                              "loss in the row's sample")
    strip_reasoning: bool = opt(False, "drop the reasoning of assistant turns (reasoning_content, inline "
                                       "<think>); without it a row with reasoning is refused as thinking_mismatch "
                                       "when the template options turn thinking off")
    precision: Literal["bf16", "fp8"] = opt("bf16", "bf16 (lossless) or fp8 (e4m3, a float32 scale per token and layer)")
    codec: str = opt("bf16-window", f"compressor of the hidden states: {', '.join(CODECS)}")
    topk: int = opt(16, "top-k of the target's distribution kept per token")
    batch_tokens: int = opt(16384, "padded tokens per forward")
    max_batch: int = opt(64, "sequences per forward")
    buckets_per_octave: int = opt(0, "pad each forward to a ladder of lengths, N per doubling (16, 32, 48, 64, "
                                     "then 2^k * (1 + j/N)); 0: to its longest sample (FLA's autotuning "
                                     "keys hold no length, docs/DESIGN.md 'Extraction speed')")
    pow2_batch: bool = opt(False, "round each forward's sequence count down to a power of two (at most 7 batch "
                                   "sizes for the kernels that autotune and compile per batch size)")
    shard_tokens: int = opt(16384, "tokens per unit (= per shard of every token array)")
    chunk_tokens: int = opt(64, "tokens per compressed chunk of features/hidden")
    writers: int = opt(0, "units compressed and written in parallel per worker; 0: from the worker's CPU cores "
                          "(minus 2; threads: at most 8; processes: one per 2 cores)")
    writer_procs: Literal["auto", "on", "off"] = opt("auto", "write units from processes of their own over shared "
                                                             "buffers (threads share the worker's interpreter with "
                                                             "the thread that queues the forward; processes add "
                                                             "up); auto: on with a GPU, off on the CPU")
    writer_nice: int = opt(10, "niceness of the writer processes, so that when the cores are busy the worker's "
                                "thread that queues the forward is served first (a small batch's forward waits on "
                                "it); 0: the worker's own", cli=False)
    queue_units: int = opt(2, "finished units waiting for a writer (bounds host memory)", cli=False)
    dtype: Literal["auto", "bf16", "fp32"] = opt("auto", "compute dtype: auto = bf16 on GPU, fp32 on CPU")
    logit_chunk: int = opt(2048, "tokens per LM-head chunk when computing top-k and lse", cli=False)
    lease_seconds: float = opt(120.0, "a claim on a unit (or on planning, finalizing) that its process has not renewed "
                                      "for this long is taken over by another (a dead or hung node)")
    ignore_free_space: bool = opt(False, "start although the estimated store is larger than the free disk space")
    overwrite: bool = opt(False, "delete STORE first")
    progress: bool = opt(True, "tqdm progress bars")

    def validate(self):
        refuse_below(self, ("cpu_workers", "draft_layers", "max_len", "topk", "batch_tokens", "max_batch",
                            "shard_tokens", "chunk_tokens"), 1)
        refuse_below(self, ("max_rows", "writers", "buckets_per_octave"), 0)
        if self.max_len < 2:
            raise ValueError(f"--max-len {self.max_len}: a sample needs a context token and a token to predict")
        if self.layer_ids is not None:
            twice = sorted({i for i in self.layer_ids if self.layer_ids.count(i) > 1})
            if twice:
                raise ValueError(f"--layers names layer {', '.join(map(str, twice))} more than once")
            if not self.layer_ids:
                raise ValueError("--layers is empty: name at least one layer id")
        if self.too_long not in ("truncate", "skip"):
            raise ValueError(f"--too-long must be 'truncate' or 'skip', not {self.too_long!r}")
        if self.inexact_turns not in ("split", "context"):
            raise ValueError(f"--inexact-turns must be 'split' or 'context', not {self.inexact_turns!r}")
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
        if self.writer_procs not in ("auto", "on", "off"):
            raise ValueError(f"--writer-procs must be auto, on or off, not {self.writer_procs!r}")
        if self.lease_seconds < 3:
            raise ValueError("--lease-seconds must be at least 3")
        if self.batch_tokens < self.max_len:
            raise ValueError(f"--batch-tokens {self.batch_tokens} must be at least --max-len {self.max_len}")
        return self

    def run_key(self) -> dict:
        """Settings that change the store's contents: a resumed run must match them."""
        return {**({"max_rows": self.max_rows} if self.max_rows else {}),  # absent: stores made before it resume
                **{k: getattr(self, k) for k in ("max_len", "too_long", "precision", "codec", "topk",
                                                 "shard_tokens", "chunk_tokens", "chat_template_kwargs",
                                                 "inexact_turns", "strip_reasoning")}}
