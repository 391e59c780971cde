"""The flex BlockMask's build, eager against compiled, at the 27B drafter's training shape (issue 27).

    python bench/block_mask_bench.py [--seq 8192] [--anchors 512] [--device cpu|cuda]

Prints each layer kind's tiles (partial and full, of 128 x 128) and the build time per call,
eager and compiled (after one compiling call), and the ratio."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from train.mask import block_mask, make_mask_mod  # noqa: E402


def timed(fn, device, n):
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    anchors = torch.randperm(a.seq - 2, generator=g)[:a.anchors].sort().values[None].to(a.device)
    valid = torch.ones(1, a.anchors, dtype=torch.bool, device=a.device)
    doc = torch.zeros(1, a.seq, dtype=torch.long, device=a.device)
    Q, KV = a.anchors * a.block, a.seq + a.anchors * a.block
    print(f"seq {a.seq}, {a.anchors} anchors, block {a.block}: Q {Q} x KV {KV} on {a.device}")
    for name, kw in (("full attention", {}), (f"sliding window {a.window}", {"window": a.window, "causal": True})):
        mod = make_mask_mod(anchors, valid, doc, a.block, **kw)
        eager, te = timed(lambda: block_mask(mod, 1, Q, KV, a.device, compile=False), a.device, a.repeat)
        comp, tc = timed(lambda: block_mask(mod, 1, Q, KV, a.device, compile=True), a.device, a.repeat)
        same = all(torch.equal(getattr(eager, k), getattr(comp, k))
                   for k in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"))
        print(f"{name:22s}: {int(eager.kv_num_blocks.sum())} partial and {int(eager.full_kv_num_blocks.sum())} full "
              f"tiles; eager {te * 1e3:9.1f} ms, compiled {tc * 1e3:8.1f} ms per build ({te / tc:.1f}x); "
              f"blocks {'equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
