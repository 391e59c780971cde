"""Rows per second of the training loader's dataset on an existing store, in this process (one
loader worker's rate): `python bench/loader_rows.py STORE [--seq-len 1024] [--rows 20] [--distill]`.

A worker reads each packed row's samples straight from the shards (shared/shards.py) and
assembles the row; small drafters (hidden 576) train faster than one worker reads, so this rate
times --workers bounds a step. The same rows read through zarr (the reader switched off), runs
alternated, are the baseline printed beside it.
"""

from __future__ import annotations

import argparse
import os
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
    spec = RowSpec(tuple(s.layer_ids), a.seq_len, a.anchors, 0, a.distill)
    direct = RowDataset(a.store, rows, spec, 0)
    direct[0]  # opens the store, its arrays and its shard readers
    os.environ["DFLASH_SHARD_READER"] = "0"  # the baseline: zarr reads it all (readers are made on first read)
    via_zarr = RowDataset(a.store, rows, spec, 0)
    via_zarr[0]
    del os.environ["DFLASH_SHARD_READER"]
    n = min(len(direct), a.rows)
    best = {"shards": float("inf"), "zarr": float("inf")}
    for _ in range(a.repeat):  # alternated, so that a busy neighbour slows both
        for name, ds in (("shards", direct), ("zarr", via_zarr)):
            t = time.perf_counter()
            for j in range(n):
                ds[j]
            best[name] = min(best[name], (time.perf_counter() - t) / n)
    for name, b in best.items():
        print(f"{a.store} ({'straight from the shards' if name == 'shards' else 'through zarr'}): "
              f"{len(s.layer_ids)} layers x {s.layout.hidden}, rows of {a.seq_len} tokens"
              f"{' with log-probabilities' if a.distill else ''}: {b * 1e3:.1f} ms/row, {a.seq_len / b:,.0f} "
              f"tokens/s per worker (best of {a.repeat} x {n} rows)")
    print(f"straight from the shards: {best['zarr'] / best['shards']:.2f}x the rows per second through zarr")


if __name__ == "__main__":
    main()
