"""The extraction host side on its own: how many raw bf16 feature bytes per second the writers
compress, checksum and write as whole units, and how many CPU cores that takes.

    python bench/host_bench.py --writers t1,t4,t8,p2,p4,p6,p8 --units 24      # H200 host (16 cores)
    python bench/host_bench.py --writers t1,t2,p1,p2 --units 4 --layers 2 --hidden 1024   # CPU smoke run
    python bench/host_bench.py --writers t1,p1,p2 --zarr-shards t1,p1,p2 --units 6       # encoder vs zarr

Each row writes (then reads back whole) the same units (synthetic features with the magnitude
structure of hidden states: a few outlier channels, the rest near N(0, 1)) through the worker's own
writers (extract/writers.py): tN = N writer threads in this process, pN = N writer processes over
the shared unit buffers, each compressing on its share of the cores as an extraction worker
gives it (pNxE: on E threads); zKIND = the same with zarr writing each shard (shared/compression.py's
ShardEncoder off), the baseline of the encoder. The buffers are filled once and not cleared
between units (clearing is the only step left out). Goal (issue 11): >= 2 GB/s of raw bf16
features per GPU with the cores one GPU has on an 8-GPU host. "cores busy" = CPU time of this
process and the writer processes / wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import queue
import resource
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from shapes import synthetic_manifest  # noqa: E402  (adds the repo to sys.path)

from extract.config import ExtractConfig
from extract.observer import Observer
from extract.plan import write_plan
from extract.worker import encode_threads
from extract.writers import UnitWriters
from shared import schema as sc
from shared import store as st
from shared.compression import ShardEncoder
from shared.data import Encoded
from shared.location import as_location

# The 'z' baseline: zarr writes every shard. Set in this process and, through the environment, in
# the writer processes started from it (spawn imports this module there before anything runs).
ZARR_SHARDS = "HOST_BENCH_ZARR_SHARDS"
ENCODER_FOR_ARRAY = ShardEncoder.__dict__["for_array"]


def zarr_writes_shards():
    ShardEncoder.for_array = classmethod(lambda cls, arr: None)


if os.environ.get(ZARR_SHARDS) == "1":
    zarr_writes_shards()


class Watch(Observer):
    def __init__(self):
        self.writing = []  # seconds per unit write

    def unit_written(self, queued_s: float, writing_s: float):
        self.writing.append(writing_s)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def unit_arrays(layout: sc.Layout, seed: int) -> dict[str, np.ndarray]:
    """One unit of every feature array, in the layout's shapes and dtypes."""
    rng = np.random.default_rng(seed)
    S, H = layout.shard_tokens, layout.hidden
    scale = np.ones(H, dtype=np.float32)
    scale[rng.choice(H, max(1, H // 256), replace=False)] = 40.0  # outlier channels
    out = {}
    for name, (shape, dtype) in layout.arrays().items():
        if name not in sc.FEATURE_ARRAYS:
            continue
        if shape[-1:] == (H,):  # the hidden states: bf16 bits (truncated from float32)
            h = rng.standard_normal((S, *shape), dtype=np.float32) * scale
            out[name] = (h.view(np.uint32) >> 16).astype(np.uint16)
        elif np.dtype(dtype).kind == "i":
            out[name] = rng.integers(0, 248_320, (S, *shape), dtype=dtype)
        else:
            out[name] = -np.abs(rng.standard_normal((S, *shape))).astype(dtype)
    return out


def on_threads(W: int, n_units: int, fn) -> tuple[float, float]:
    """fn(u) for every unit on W threads: (wall seconds, process CPU seconds). The first error
    stops the threads and is raised (a failed write must not read as a fast one)."""
    q: queue.Queue = queue.Queue()
    for u in range(n_units):
        q.put(u)
    errors = []

    def loop():
        while not errors:
            try:
                u = q.get_nowait()
            except queue.Empty:
                return
            try:
                fn(u)
            except BaseException as e:
                errors.append(e)

    threads = [threading.Thread(target=loop) for _ in range(W)]
    c0, t0 = cpu_seconds(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0, cpu_seconds() - c0


@contextlib.contextmanager
def registered_memory(n: int):
    """n bytes of a shared memory file, registered with CUDA as the writer processes' pool is
    (extract/writers.py), as a uint8 tensor; unregistered on exit: a later mapping at the same
    address would fail to register ("resource already mapped")."""
    import torch
    fd = os.memfd_create("host-bench")
    os.ftruncate(fd, n)
    shared = torch.frombuffer(mmap.mmap(fd, n), dtype=torch.uint8)
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(shared.data_ptr(), n, 0))
    try:
        yield shared
    finally:
        torch.cuda.cudart().cudaHostUnregister(shared.data_ptr())
        os.close(fd)


def read_rates(gib: float = 1.0):
    """The CPU reading (copying out of) pinned and plain host memory: writers read their units from
    pinned buffers, which a virtual machine may map differently from plain memory."""
    import torch
    n = int(gib * 2 ** 30)
    dst = np.empty(n, dtype=np.uint8)
    with registered_memory(n) as shared:
        shared.fill_(1)
        for name, src in (("plain", torch.ones(n, dtype=torch.uint8)),
                          ("pinned (cudaHostAlloc)", torch.ones(n, dtype=torch.uint8, pin_memory=True)),
                          ("shared memfd, registered (the writer processes' pool)", shared)):
            a = src.numpy()
            np.copyto(dst, a)
            t0 = time.perf_counter()
            for _ in range(3):
                np.copyto(dst, a)
            print(f"one core copying out of {name} memory: {3 * n / (time.perf_counter() - t0) / 1e9:.2f} GB/s",
                  flush=True)


def copy_rates(gib: float = 1.0):
    """The device copying into pageable, pinned and registered shared host memory with
    non_blocking=True, as the worker copies features: how long the call holds the host (a copy the
    driver cannot do asynchronously returns only when done) and the rate to completion."""
    import torch
    n = int(gib * 2 ** 30)
    src = torch.ones(n, dtype=torch.uint8, device="cuda")
    with registered_memory(n) as shared:
        for name, dst in (("pageable", torch.empty(n, dtype=torch.uint8)),
                          ("pinned (cudaHostAlloc)", torch.empty(n, dtype=torch.uint8, pin_memory=True)),
                          ("shared memfd, registered (the pool)", shared)):
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for k in range(4):  # slices, as the worker copies sample by sample
                dst[k * n // 4:(k + 1) * n // 4].copy_(src[k * n // 4:(k + 1) * n // 4], non_blocking=True)
            held = time.perf_counter() - t0
            torch.cuda.synchronize()
            done = time.perf_counter() - t0
            print(f"device -> {name} memory (is_pinned {dst.is_pinned()}): {n / done / 1e9:.1f} GB/s, the host held "
                  f"{held / done:.0%} of that time", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--writers", default="t1,t4,p2,p4", help="tN: N threads, pN: N processes; a suffix xE: E "
                    "threads compress each process's chunks (default: an extraction worker's share of the cores)")
    ap.add_argument("--threads", default=None, help="(old spelling) 1,2,4: the same as --writers t1,t2,t4")
    ap.add_argument("--units", type=int, default=12, help="units written per row")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--shard-tokens", type=int, default=16384)
    ap.add_argument("--codec", default="zstd1")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--goal-gbs", type=float, default=2.0)
    ap.add_argument("--zarr-crc", action="store_true", help="baseline: zarr's own crc32c codec (inline on its event loop)")
    ap.add_argument("--zarr-shards", default="", help="writer kinds (e.g. t1,p2) also run with zarr writing every "
                    "shard (the store's ShardEncoder replaced by zarr's own writes, here and in the writer processes): "
                    "baseline rows marked 'z'")
    ap.add_argument("--pin", action="store_true", help="pinned unit buffers, as a worker on a GPU has them "
                    "(and first: the CPU's read rate from pinned and from plain memory)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--s3", action="store_true", help="write to (and read from) a local S3 server (SeaweedFS, "
                    "shared/s3local.py) instead of the disk")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.zarr_crc:
        import zarr
        zarr.config.set({"codecs.crc32c": "zarr.codecs.crc32c_.Crc32cCodec"})
    tmp = Path(a.dir or tempfile.mkdtemp(prefix="hbench-"))
    server = None
    if a.s3:
        from shared.s3local import S3Server
        server = S3Server(tmp / "s3").start()
        os.environ.update(server.env)
    S = a.shard_tokens
    cfg = ExtractConfig(data="synthetic", target="in-memory", store="", max_len=S, precision=a.precision,
                        codec=a.codec, topk=16, batch_tokens=S, shard_tokens=S, progress=False)
    n_units = a.units
    enc = [Encoded(np.zeros(S, dtype=np.int32), np.ones(S, dtype=np.uint8), 0, i) for i in range(n_units)]
    template = None
    rows = []
    print(f"units of {S} tokens x {a.layers} layers x {a.hidden} ({a.precision}/{a.codec}, crc32c "
          f"{'zarr inline' if a.zarr_crc else 'threaded'}) on {'S3 at ' + server.endpoint if server else tmp}; "
          f"{os.cpu_count()} CPUs visible; {n_units} units per row")
    kinds = [f"t{x}" for x in a.threads.split(",")] if a.threads else a.writers.split(",")
    kinds += [f"z{k}" for k in a.zarr_shards.split(",") if k]
    if a.pin:
        read_rates()
        copy_rates()
    print(f"{'writers':>8s}{'raw GB/s':>10s}{'cores busy':>12s}{'GB/s per core':>15s}{'disk GB/s':>11s}"
          f"{'read GB/s':>11s}{'read cores':>12s}{'s/unit write':>14s}")
    for kind in kinds:
        zarr_shards = kind[0] == "z"
        os.environ.pop(ZARR_SHARDS, None)
        if zarr_shards:  # read by this module in this process and in writer processes started from here
            os.environ[ZARR_SHARDS] = "1"
            zarr_writes_shards()
        else:
            ShardEncoder.for_array = ENCODER_FOR_ARRAY
        writers, _, e = kind.removeprefix("z").partition("x")
        procs, W = writers[0] == "p", int(writers[1:])
        E = int(e) if e else encode_threads(os.cpu_count() or 1, W, procs)  # as an extraction worker has it
        store = server.url(f"hbench/store-{kind}") if server else str(tmp / f"store-{kind}")
        as_location(store).delete_all()
        cfg.store = store
        man = synthetic_manifest(cfg, a.hidden, a.layers, 248_320, list(range(a.layers)), n_units)
        write_plan(cfg, man, enc, a.layers, a.hidden)
        layout = st.read_manifest(store).layout
        if template is None:
            template = [unit_arrays(layout, s) for s in range(min(4, n_units))]
        w = st.StoreWriter(store)
        if layout.precision == "fp8":
            raise SystemExit("fp8: give --precision bf16 (the goal is stated for raw bf16 features)")
        t0 = time.perf_counter()
        watch = Watch()
        out = UnitWriters(store, layout, W, procs, extra=0, pin=a.pin, clear=False, observer=watch, encode_threads=E)
        made = time.perf_counter() - t0
        bufs = [out.pool.get(-1, 1, S) for _ in range(out.pool.size)]
        t0 = time.perf_counter()
        for i, b in enumerate(bufs):  # each buffer filled once, with one of the template units
            for name, arr in b.numpy().items():
                arr[:] = template[i % len(template)][name]
            out.pool.put(b, zero=False)
        gib = out.pool.size * out.pool.slot_bytes / 2 ** 30
        print(f"{kind}: {out.describe()} made in {made:.2f} s ({gib / made:.1f} GiB/s), first filled in "
              f"{time.perf_counter() - t0:.2f} s", flush=True)
        out.wait_ready()  # the writer processes' start is not part of the rate

        def read(u):
            for name in template[0]:
                w.feature_array(name)[u * S:(u + 1) * S]

        c0, t0 = cpu_seconds(), time.perf_counter()
        for u in range(n_units):
            out.submit(out.pool.get(u, 1, S))
        out.close()
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0 + out.cpu_seconds()
        if out.error:
            raise out.error
        raw = n_units * S * a.layers * a.hidden * 2
        disk = st.disk_bytes(store)
        # read back: every unit's arrays, whole, with the same thread count (checksums verified)
        rwall, rcpu = on_threads(W, n_units, read)
        r = {"writers": kind, "raw_gbs": raw / wall / 1e9, "cores_busy": cpu / wall,
             "gbs_per_core": raw / cpu / 1e9, "disk_gbs": disk / wall / 1e9, "ratio": raw / disk,
             "read_raw_gbs": raw / rwall / 1e9, "read_cores_busy": rcpu / rwall,
             "unit_write_s": float(np.mean(watch.writing))}
        rows.append(r)
        print(f"{kind:>8s}{r['raw_gbs']:10.2f}{r['cores_busy']:12.1f}{r['gbs_per_core']:15.3f}{r['disk_gbs']:11.2f}"
              f"{r['read_raw_gbs']:11.2f}{r['read_cores_busy']:12.1f}{r['unit_write_s']:14.2f}", flush=True)
        as_location(store).delete_all()
    if server is not None:
        server.stop()
    os.environ.pop(ZARR_SHARDS, None)
    for r in rows:  # the store's shard encoder against zarr writing the shards, same writers
        base = next((b for b in rows if b["writers"] == "z" + r["writers"]), None)
        if base is not None:
            print(f"{r['writers']}: {r['raw_gbs'] / base['raw_gbs']:.2f}x the raw GB/s of zarr's shard writes, "
                  f"{r['gbs_per_core'] / base['gbs_per_core']:.2f}x per busy core")
    rows_z, rows = [r for r in rows if r["writers"][0] == "z"], [r for r in rows if r["writers"][0] != "z"]
    best = max(rows, key=lambda r: r["raw_gbs"])
    per_core = np.median([r["gbs_per_core"] for r in rows])
    print(f"best {best['raw_gbs']:.2f} GB/s with {best['writers']} ({best['cores_busy']:.1f} cores busy); "
          f"at {per_core:.3f} GB/s per busy core, {a.goal_gbs} GB/s needs about {a.goal_gbs / per_core:.1f} cores; "
          f"compression {rows[0]['ratio']:.3f}x")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "zarr_shard_rows": rows_z,
                                            "cores_for_goal": a.goal_gbs / per_core}, indent=2))
    if a.dir is None:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
