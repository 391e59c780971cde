"""Codec figures on real features from a store: bytes/token, ratio vs raw bf16, encode and decode
MB/s on ONE core, and the cores one GPU needs to keep up with a raw feature rate.

    python bench/codec_bench.py STORE [--rate-mbs 460] [--tokens 16384] [--threads N] [--chunk-tokens C]

Measured on the chunks the store uses (chunk_tokens x layers x hidden), with every codec forced to
one thread, over the same feature bytes (made before the clock starts), the best of --reps passes
(a shared machine's noise only ever slows a pass), the codecs taking turns; every codec is checked
lossless on every chunk, outside the clock. fp8 rows include the float32 scales in their size.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numcodecs
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from numcodecs import Blosc  # noqa: E402

from shared.compression import TABLE, numcodecs_chain  # noqa: E402
from shared.schema import bits_to_bf16, fp8_encode  # noqa: E402
from shared.store import Store  # noqa: E402


def one_pass(chain, raw, check: bool, pool=None):
    """(encoded bytes, encode seconds, decode seconds) of one pass over the chunks. Encoded chunks
    are kept, as a shard's are until it is written; decoded ones are dropped as they come, as a
    reader copies each into its batch (kept, every chunk would land on fresh pages). pool: the
    chunks spread over its threads, as extraction's writers and zarr's readers do. check: an
    untimed pass after the timed ones compares every decoded chunk with its raw bytes."""
    def enc_one(b):
        for codec in chain:
            b = codec.encode(b)
        return b

    def dec_one(b):
        for codec in reversed(chain):
            b = codec.decode(b)
        return b

    run = pool.map if pool is not None else map
    t = time.perf_counter()
    enc = list(run(enc_one, raw))
    t_enc = time.perf_counter() - t
    t = time.perf_counter()
    for _ in run(dec_one, enc):
        pass
    t_dec = time.perf_counter() - t
    for b, r in zip(enc, raw) if check else ():
        if not np.array_equal(np.frombuffer(dec_one(b), np.uint8), np.frombuffer(r, np.uint8)):
            raise SystemExit(f"{chain}: decode did not give back the encoded bytes")
    return sum(len(b) if isinstance(b, bytes) else np.asarray(b).nbytes for b in enc), t_enc, t_dec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--rate-mbs", type=float, default=460.0, help="raw bf16 feature rate to sustain (MB/s)")
    ap.add_argument("--reps", type=int, default=3, help="passes per codec, the codecs taking turns within "
                    "each round (in a rotating order); the best pass is reported")
    ap.add_argument("--codecs", default=",".join(TABLE), help="comma-separated codecs of the table")
    ap.add_argument("--chunk-tokens", type=int, default=0, help="tokens per chunk (default: the store's): "
                    "how a codec's fixed cost per chunk weighs, alone and on threads")
    ap.add_argument("--threads", type=int, default=1, help="chunks spread over this many threads (rates are "
                    "then of all threads together): how a codec scales where extraction's writers and zarr's readers run it")
    a = ap.parse_args()
    names = a.codecs.split(",")
    if set(names) - set(TABLE):
        raise SystemExit(f"unknown codecs {sorted(set(names) - set(TABLE))}; the table has {list(TABLE)}")
    Blosc.use_threads = False
    numcodecs.blosc.set_nthreads(1)
    s = Store(a.store, require_complete=False)
    lay = s.layout
    n = min(a.tokens, lay.capacity)
    raw_bits = s.hidden_bits(0, n)
    if lay.precision != "bf16":
        raise SystemExit("codec_bench needs a bf16 store")
    used = raw_bits.reshape(n, -1).any(axis=1)  # skip the unused tail of a unit
    raw_bits = raw_bits[used]
    n = raw_bits.shape[0]
    C = a.chunk_tokens or lay.chunk_tokens
    chunks16 = [raw_bits[i:i + C] for i in range(0, n - C + 1, C)]
    h = bits_to_bf16(raw_bits)
    q, scale = fp8_encode(h)
    chunks8 = [q.numpy()[i:i + C] for i in range(0, n - C + 1, C)]
    scale_bytes = scale.numpy().nbytes
    raw = sum(c.nbytes for c in chunks16)
    tokens = len(chunks16) * C
    print(f"{a.store}: {tokens:,} tokens x {lay.n_layers} layers x {lay.hidden} hidden, chunks of {C} tokens; "
          f"raw bf16 {raw / 2**20:.1f} MiB; rate to sustain {a.rate_mbs:.0f} MB/s raw"
          + (f"; {a.threads} threads, rates of all together" if a.threads > 1 else ""))
    print(f"{'precision/codec':24s}{'B/token':>9s}{'ratio':>8s}{'enc MB/s':>10s}{'dec MB/s':>10s}"
          f"{'cores enc':>10s}{'cores dec':>10s}")
    pool = ThreadPoolExecutor(a.threads) if a.threads > 1 else None
    for prec, chunks, extra in (("bf16", chunks16, 0), ("fp8", chunks8, scale_bytes * tokens // n)):
        raw_bytes = [c.tobytes() for c in chunks]  # made before any clock starts
        chains = {name: numcodecs_chain(name, 2 if prec == "bf16" else 1, lay.n_layers * lay.hidden) for name in names}
        best = {name: [0, float("inf"), float("inf")] for name in names}
        for r in range(a.reps):  # a noisy neighbour slows whichever codec runs then: each gets every slot
            for name in names[r % len(names):] + names[:r % len(names)]:
                size, te, td = one_pass(chains[name], raw_bytes, check=r == 0, pool=pool)
                b = best[name]
                b[0], b[1], b[2] = size, min(b[1], te), min(b[2], td)
        for name in names:
            size, te, td = best[name]
            size += extra
            enc_mbs, dec_mbs = raw / te / 1e6, raw / td / 1e6  # per raw bf16 byte, so rows compare
            print(f"{prec + '/' + name:24s}{size / tokens:9,.0f}{raw / size:8.2f}{enc_mbs:10,.0f}{dec_mbs:10,.0f}"
                  f"{a.rate_mbs / enc_mbs:10.1f}{a.rate_mbs / dec_mbs:10.1f}", flush=True)
        if prec == "bf16" and {"bf16-window", "zstd1"} <= set(names):
            w, z = best["bf16-window"], best["zstd1"]
            print(f"bf16-window against zstd1, best passes of this run: {z[0] / w[0]:.3f}x smaller, encode "
                  f"{z[1] / w[1]:.2f}x, decode {z[2] / w[2]:.2f}x as fast", flush=True)


if __name__ == "__main__":
    main()
