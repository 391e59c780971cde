"""Rows per second of the training loader's dataset on an existing store, in this process (one
loader worker's rate): `python bench/loader_rows.py STORE [--seq-len 1024] [--rows 20] [--distill]`.

A worker reads each packed row's samples through zarr and assembles the row; small drafters
(hidden 576) train faster than one worker reads, so this rate times --workers bounds a step.
"""

from __future__ import annotations

import argparse
import time

from shared.store import Store
from train.loader import EpochPlan, RowDataset, RowSpec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--distill", action="store_true", help="also read the top-k log-probabilities")
    a = ap.parse_args()
    s = Store(a.store)
    rows = EpochPlan(s, a.seq_len, 0, 0, 1).rows(0)
    ds = RowDataset(a.store, rows, RowSpec(tuple(s.layer_ids), a.seq_len, a.anchors, 0, a.distill), 0)
    n = min(len(ds), a.rows)
    ds[0]  # opens the store and its arrays
    best = float("inf")
    for _ in range(a.repeat):
        t = time.perf_counter()
        for j in range(n):
            ds[j]
        best = min(best, (time.perf_counter() - t) / n)
    print(f"{a.store}: {len(s.layer_ids)} layers x {s.layout.hidden}, rows of {a.seq_len} tokens"
          f"{' with log-probabilities' if a.distill else ''}: {best * 1e3:.1f} ms/row, {a.seq_len / best:,.0f} "
          f"tokens/s per worker (best of {a.repeat} x {n} rows)")


if __name__ == "__main__":
    main()
