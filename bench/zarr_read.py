"""Read and write speed of one sharded feature array through zarr, per codec and chunk size.

    python bench/zarr_read.py [--hidden 5120] [--tokens 8192]

This is the path the loader and the writers take (zarr's codec pipeline, its threads), unlike
bench/codec_bench.py, which calls the codecs directly on one thread.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec, BloscShuffle, ZstdCodec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    S, L, H = a.tokens, a.layers, a.hidden
    data = (torch.randn(S, L, H, generator=torch.Generator().manual_seed(0)) * 2).bfloat16()
    data = data.view(torch.int16).numpy().view(np.uint16)
    tmp = tempfile.mkdtemp(prefix="zarr-read-")
    print(f"{S} x {L} x {H} bf16 ({data.nbytes / 1e6:.0f} MB), best of {a.repeat}")
    print(f"{'codec':14s}{'chunk':>7s}{'write MB/s':>12s}{'read MB/s':>11s}{'ratio':>7s}")
    for chunk in (64, 256):
        for name, comp in (("blosc-zstd1", BloscCodec(cname="zstd", clevel=1, shuffle=BloscShuffle.shuffle, typesize=2)),
                           ("zstd1", ZstdCodec(level=1))):
            g = zarr.open_group(f"{tmp}/{name}-{chunk}", mode="w")
            arr = g.create_array("h", shape=(S, L, H), dtype="uint16", chunks=(chunk, L, H), shards=(S, L, H),
                                 compressors=(comp,), fill_value=0)
            tw, tr = [], []
            for _ in range(a.repeat):
                t = time.perf_counter()
                arr[:] = data
                tw.append(time.perf_counter() - t)
                t = time.perf_counter()
                arr[:]
                tr.append(time.perf_counter() - t)
            size = sum(f.stat().st_size for f in __import__("pathlib").Path(f"{tmp}/{name}-{chunk}").rglob("*") if f.is_file())
            print(f"{name:14s}{chunk:7d}{data.nbytes / min(tw) / 1e6:12,.0f}{data.nbytes / min(tr) / 1e6:11,.0f}"
                  f"{data.nbytes / size:7.2f}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
