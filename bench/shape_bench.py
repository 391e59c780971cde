"""What a batch shape the process has not seen yet costs the extraction forward.

    python bench/shape_bench.py --shape 27b --layers 16 --shapes 8     # H200
    python bench/shape_bench.py --shape tiny --shapes 4                # CPU

A real corpus gives the worker batches of many (batch size, padded length) shapes; each first
call of a shape may pay one-time host work (kernel compilation or loading, library plan
building) while the device idles. For --shapes new shapes, forward_features runs twice each, and
the table gives the first call, the second, and their difference. One more new shape's first
call runs under torch.profiler, and the host operators that took the most time are listed.
Triton's cache folder (TRITON_CACHE_DIR) is counted by kernel name before and after, so a kernel
compiled per shape shows by name.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from pathlib import Path

import torch

from shapes import random_target, target_27b_config  # noqa: E402  (adds the repo to sys.path)

from shared import tuning
from shared.features import forward_features
from shared.target import default_layer_ids
from shared.tiny import tiny_config


def triton_kernels() -> Counter:
    """Compiled kernels in Triton's cache, by name (one folder per compiled variant)."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return Counter(p.stem for p in root.glob("*/*.json") if not p.name.startswith("__grp__")
                   and not p.name.endswith(".autotune.json"))


def new_shapes(n: int, batch_tokens: int, seed: int) -> list[tuple[int, int]]:
    """n (B, S) pairs as the worker plans them for chat batches: S between 256 and 4096, not a
    multiple of 16 (as unbucketed lengths mostly are), B = batch_tokens // S."""
    g = torch.Generator().manual_seed(seed)
    out, seen = [], set()
    while len(out) < n:
        S = int(torch.randint(256, 4096, (1,), generator=g))
        S += S % 16 == 0
        B = max(1, batch_tokens // S)
        if (B, S) not in seen:
            seen.add((B, S))
            out.append((B, S))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("27b", "tiny"), default="tiny")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shapes", type=int, default=8)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tcfg = target_27b_config(a.layers) if a.shape == "27b" else tiny_config(2048)
    model = random_target(tcfg, device, dtype)
    if device.type == "cuda":  # as the worker: one tuning per FLA kernel (shared/tuning.py)
        tuning.enable(torch.cuda.get_device_name(device), tcfg.to_dict())
    layer_ids = default_layer_ids(tcfg.num_hidden_layers, 5)

    def call(B, S):
        ids = torch.randint(0, tcfg.vocab_size, (B, S), device=device)
        lengths = [S] + [max(1, S - 7 * b) for b in range(1, B)]
        t = time.perf_counter()
        forward_features(model, ids, lengths, layer_ids, 16)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    shapes = new_shapes(a.shapes + 2, a.batch_tokens, seed=0)
    warm = shapes.pop()
    for _ in range(2):  # the process's one-time costs (the first compilation of everything) are not a shape's
        call(*warm)
    before = triton_kernels()
    print(f"{a.shape} shape, {tcfg.num_hidden_layers} layers on {device}; cudnn.benchmark "
          f"{torch.backends.cudnn.benchmark}; first warm-up shape {warm}")
    print(f"{'B':>4s}{'S':>6s}{'first ms':>10s}{'second ms':>11s}{'extra ms':>10s}")
    rows = []
    profiled = shapes.pop()
    for B, S in shapes:
        t1, t2 = call(B, S), call(B, S)
        rows.append({"B": B, "S": S, "first_ms": t1 * 1e3, "second_ms": t2 * 1e3})
        print(f"{B:4d}{S:6d}{t1 * 1e3:10.1f}{t2 * 1e3:11.1f}{(t1 - t2) * 1e3:10.1f}", flush=True)
    extra = [r["first_ms"] - r["second_ms"] for r in rows]
    second = [r["second_ms"] for r in rows]
    print(f"a new shape's first call costs {sum(extra) / len(extra):.1f} ms more than its second "
          f"({sum(extra) / sum(second):.0%} of a second call)")
    grown = triton_kernels() - before
    print(f"Triton kernels compiled for the {len(rows)} new shapes: "
          f"{', '.join(f'{k} x{n}' for k, n in grown.most_common()) or 'none'}")

    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t1 = call(*profiled)
    t2 = call(*profiled)
    print(f"\nprofiled first call of {profiled}: {t1 * 1e3:.1f} ms (second, unprofiled, {t2 * 1e3:.1f} ms); "
          f"host operators by their own time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"shape": a.shape, "layers": tcfg.num_hidden_layers, "rows": rows,
                                            "triton_grown": dict(grown)}, indent=2))


if __name__ == "__main__":
    main()
