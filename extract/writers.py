"""The write side of an extraction worker: a fixed pool of unit buffers and the writers that
compress, checksum and write finished units (zarr shards) and give the buffers back, cleared.

A writer is a thread of the worker, which writes either in the worker's own process or through a
writer process of its own. Threads share the worker's interpreter with the thread that queues the
forward; processes do not, and add up (with zarr writing every shard, one process topped out near
0.9 GB/s of raw bf16 features on a 16-core H200 host; the store's shard encoder now compresses a
shard's chunks on threads of its own: bench/host_bench.py, BENCHMARKS.md). They read the unit
straight from the buffer the device copied into: the pool is one shared memory file (memfd:
/dev/shm's size does not limit it), pinned for CUDA's asynchronous copies, so no unit is copied on
the host.
"""

from __future__ import annotations

import errno as errno_mod
import mmap
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.reduction import DupFd

import numpy as np
import torch

from extract.observer import Observer
from shared import schema as sc
from shared import store as st
from shared.progress import log

_STOP = object()
_PAGE = mmap.PAGESIZE


def _specs(layout: sc.Layout) -> list[tuple[str, tuple[int, ...], np.dtype, int]]:
    """(name, shape, numpy dtype, byte offset in a slot) of every feature array of one unit."""
    out, off = [], 0
    for name, (shape, dtype) in layout.arrays().items():
        if name not in sc.FEATURE_ARRAYS:
            continue
        shape, dt = (layout.shard_tokens, *shape), np.dtype(dtype)
        out.append((name, shape, dt, off))
        off += -(-int(np.prod(shape)) * dt.itemsize // _PAGE) * _PAGE
    return out


def _slot_bytes(specs) -> int:
    name, shape, dt, off = specs[-1]
    return off + -(-int(np.prod(shape)) * dt.itemsize // _PAGE) * _PAGE


@dataclass
class UnitBuffer:
    slot: int
    arrays: dict[str, torch.Tensor]   # host tensors, one per feature array, unit-sized
    unit: int = -1
    remaining: int = 0
    samples: int = 0
    tokens: int = 0
    dropped: list = field(default_factory=list)
    started: float = 0.0
    submitted: float = 0.0

    def numpy(self) -> dict[str, np.ndarray]:
        out = {}
        for name, t in self.arrays.items():
            a = t.numpy()
            out[name] = a.view(np.uint16) if a.dtype == np.int16 else a
        return out


class UnitPool:
    """A fixed set of unit buffers (pinned on CUDA, so copies into them are asynchronous). Host
    memory is `size` units, allocated once, whatever the corpus size; taking a buffer blocks while
    every one is being filled or written, which is the back-pressure on the device. shared: the
    buffers live in one memory file that writer processes map too."""

    def __init__(self, layout: sc.Layout, size: int, pin: bool, shared: bool = False):
        self.specs = _specs(layout)
        self.slot_bytes = _slot_bytes(self.specs)
        self.size, self.pinned = size, pin
        self.waited = 0.0  # seconds get() blocked: the device waiting on the writers
        self.fd = self.mm = self._pinned = None
        self.free: queue.Queue = queue.Queue()
        if shared:
            self.fd = os.memfd_create("dflash-unit-buffers", 0)
            total = size * self.slot_bytes
            os.ftruncate(self.fd, total)  # reads as zeros until written
            try:
                # every page allocated now, in one call: faulting them in one by one (at the first
                # copy, or while pinning) ran at 0.9 GB/s on a VM against 4 GB/s this way, and a
                # pool that does not fit fails here, not with SIGBUS in the middle of a run
                os.posix_fallocate(self.fd, 0, total)
            except OSError as e:
                os.close(self.fd)
                # ENOMEM whatever fallocate said: its ENOSPC would read as a full disk
                raise OSError(errno_mod.ENOMEM, f"{size} unit buffers of {self.slot_bytes / 2 ** 30:.2f} GiB do not "
                                                f"fit in memory ({e.strerror}); give fewer --writers") from None
            self.mm = mmap.mmap(self.fd, total)
            whole = torch.frombuffer(self.mm, dtype=torch.uint8)
            if pin:
                self._pin(whole)
        for slot in range(size):
            if shared:
                arrays = {name: whole[slot * self.slot_bytes + off:][:int(np.prod(shape)) * dt.itemsize]
                          .view(sc.torch_dtype(dt)).view(shape) for name, shape, dt, off in self.specs}
            else:
                arrays = {name: torch.zeros(shape, dtype=sc.torch_dtype(dt), pin_memory=pin)
                          for name, shape, dt, _ in self.specs}
            self.free.put(UnitBuffer(slot, arrays))

    def _pin(self, whole: torch.Tensor):
        try:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(whole.data_ptr(), whole.numel(), 0))
        except Exception as e:
            raise RuntimeError(f"pinning {whole.numel() / 2 ** 30:.1f} GiB of shared unit buffers failed ({e}); "
                               f"give --writer-procs off to write from the worker's own process") from e
        self._pinned = whole

    def get(self, unit: int, samples: int, tokens: int) -> UnitBuffer:
        t0 = time.perf_counter()
        buf = self.free.get()
        self.waited += time.perf_counter() - t0
        buf.unit, buf.remaining, buf.samples, buf.tokens = unit, samples, samples, tokens
        buf.dropped, buf.started = [], time.time()
        return buf

    def put(self, buf: UnitBuffer, zero: bool = True):
        if zero:
            for t in buf.arrays.values():
                t.zero_()  # unused tails and dropped samples must read back as zeros
        self.free.put(buf)

    def close(self):
        if self._pinned is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pinned.data_ptr())
            self._pinned = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# --- writer processes -----------------------------------------------------------------------

def _proc_main(store: str, fd: DupFd, specs, slot_bytes: int, size: int, conn, nice: int, encode_threads: int):
    """A writer process: maps the pool, then writes the units it is sent until told to stop.
    Asks its parent before each shard whether the unit's claim is still held (the claims live
    there), clears the buffer after writing, and reports (marked, CPU seconds) or the error."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is its parent's to answer (shared/launch.py)
    if nice:
        os.nice(nice)  # its threads and the codecs' threads it starts inherit it
    # mapped whole at the start (while the worker loads its model), not page by page at each first read
    mm = mmap.mmap(fd.detach(), size * slot_bytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    views = [{name: np.ndarray(shape, dt, buffer=mm, offset=slot * slot_bytes + off)
              for name, shape, dt, off in specs} for slot in range(size)]
    w = st.StoreWriter(store, encode_threads=encode_threads)
    conn.send(("ready",))

    def held():
        conn.send(("held",))
        return conn.recv()

    while (msg := conn.recv()) is not None:
        slot, unit, info, ask, clear = msg
        c0 = time.process_time()
        try:
            ok = st.write_unit(w, unit, views[slot], info, held if ask else None)
            if clear:  # unused tails and dropped samples must read back as zeros
                for a in views[slot].values():
                    a.fill(0)
            conn.send(("done", ok, time.process_time() - c0))
        except BaseException as e:
            conn.send(("error", getattr(e, "errno", None), f"{type(e).__name__}: {e}", traceback.format_exc()))
    # Every unit sent was written and answered for. The interpreter's teardown (modules, zarr's
    # event-loop thread: most of a second) would only lengthen the run's final drain.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class WriterProc:
    """One writer process, driven by one writer thread of the worker."""

    def __init__(self, store: str, pool: UnitPool, nice: int = 0, encode_threads: int = 0):
        ctx = mp.get_context("spawn")  # the worker has CUDA and threads: no fork
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_proc_main, args=(store, DupFd(pool.fd), pool.specs, pool.slot_bytes,
                                                         pool.size, child, nice, encode_threads), daemon=True)
        self.proc.start()
        child.close()
        self.cpu = 0.0  # CPU seconds its writes took
        self.ready = self.stopped = False

    def _recv(self, unit: int | None):
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(timeout=5)
            what = "starting" if unit is None else f"writing unit {unit}"
            raise RuntimeError(f"writer process {self.proc.pid} died (exit code {self.proc.exitcode}) "
                               f"{what}") from None

    def wait_ready(self):
        """Until the process has imported its modules and opened the store (a few seconds)."""
        if not self.ready:
            self._recv(None)
            self.ready = True

    def write(self, buf: UnitBuffer, info: dict, held, clear: bool = True) -> bool:
        self.wait_ready()
        self.conn.send((buf.slot, buf.unit, info, held is not None, clear))
        while True:
            msg = self._recv(buf.unit)
            if msg[0] == "held":
                self.conn.send(held())
            elif msg[0] == "done":
                self.cpu += msg[2]
                return msg[1]
            else:
                _, code, what, tb = msg
                if code == errno_mod.ENOSPC:
                    raise OSError(code, what)
                raise RuntimeError(f"writer process {self.proc.pid}, unit {buf.unit}: {what}\n{tb}")

    def stop(self):
        """Tells the process to exit once its current unit is written (close() waits for it)."""
        if self.stopped:
            return
        self.stopped = True
        try:
            self.conn.send(None)
        except OSError:
            pass

    def close(self):
        self.stop()
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()


# --- the writers ----------------------------------------------------------------------------

class UnitWriters:
    """n writer threads over a pool of n + extra buffers; procs: each thread writes through a
    process of its own, at niceness `nice`. encode_threads: each writer process's threads (or the
    writer threads' one shared pool of threads) that compress a unit's chunks; 0: min(8, cores). submit() hands a filled buffer over; the first error
    is kept in .error (and unblocks whoever waits on the pool) for the worker's main loop to raise."""

    def __init__(self, store: str, layout: sc.Layout, n: int, procs: bool, extra: int, pin: bool,
                 claims=None, rank: int = 0, progress_q=None, clear: bool = True, nice: int = 0,
                 observer: Observer | None = None, encode_threads: int = 0):
        self.store, self.claims, self.rank, self.progress_q = store, claims, rank, progress_q
        self.n, self.procs, self.clear = n, procs, clear
        self.pool = UnitPool(layout, n + extra, pin, shared=procs)
        self.writer = st.StoreWriter(store, encode_threads=encode_threads)
        self.q: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.observer = observer or Observer()
        self.close_s: dict[str, float] = {}
        self._procs = [WriterProc(store, self.pool, nice, encode_threads) for _ in range(n)] if procs else []
        self._threads = [threading.Thread(target=self.guard(self._loop), args=(i,), daemon=True)
                         for i in range(n)]
        for t in self._threads:
            t.start()

    def describe(self) -> str:
        gib = self.pool.size * self.pool.slot_bytes / 2 ** 30
        how = f"{self.n} writer {'processes' if self.procs else 'threads'}"
        how += f" ({self.writer.encode_threads} compressing threads {'each' if self.procs else 'shared'})"
        return f"{how}, {self.pool.size} unit buffers ({gib:,.1f} GiB{' pinned' if self.pool.pinned else ''})"

    def fail(self, e: BaseException):
        self.error = self.error or e
        for _ in range(self.pool.size + 2):  # unblock whoever waits on the pool
            self.pool.free.put(UnitBuffer(-1, {}))

    def guard(self, fn):
        """fn, with its exception kept as .error (and the pool unblocked), not lost with its thread."""
        def run(*args):
            try:
                fn(*args)
            except BaseException as e:
                self.fail(e)
        return run

    def submit(self, buf: UnitBuffer):
        buf.submitted = time.perf_counter()
        self.q.put(buf)

    def wait_ready(self):
        for p in self._procs:
            p.wait_ready()

    def cpu_seconds(self) -> float:
        """CPU time the writer processes spent writing (0 without processes: it is the worker's)."""
        return sum(p.cpu for p in self._procs)

    def _loop(self, i: int):
        proc = self._procs[i] if self.procs else None
        while (buf := self.q.get()) is not _STOP:
            info = {"samples": buf.samples, "tokens": buf.tokens, "dropped": buf.dropped, "rank": self.rank,
                    "seconds": round(time.time() - buf.started, 3),
                    "by": None if self.claims is None else self.claims.owner}
            name = st.unit_name(buf.unit)
            held = None if self.claims is None else (lambda: self.claims.holds(name))
            t0 = time.perf_counter()
            if proc is not None:
                ok = proc.write(buf, info, held, self.clear)
            else:
                ok = st.write_unit(self.writer, buf.unit, buf.numpy(), info, held)
            self.observer.unit_written(t0 - buf.submitted, time.perf_counter() - t0)
            if ok:
                if self.progress_q is not None:
                    self.progress_q.put(("unit", buf.unit, buf.samples - len(buf.dropped), buf.tokens))
            else:
                log(f"unit {buf.unit}: not marked here (its claim was lost, or it was finished elsewhere)")
            if self.claims is not None:
                self.claims.release(name)
            self.pool.put(buf, zero=proc is None and self.clear)  # a writer process clears its own

    def close(self):
        """Write what was submitted, then stop the threads and processes. close_s: the seconds of
        each step (the last writes, the processes' exit, the buffers unpinned and freed)."""
        t0 = time.perf_counter()
        for _ in self._threads:
            self.q.put(_STOP)
        for t in self._threads:
            t.join()
        t1 = time.perf_counter()
        for p in self._procs:  # all told first: they exit at once, not one after the other
            p.stop()
        for p in self._procs:
            p.close()
        t2 = time.perf_counter()
        self.pool.close()
        self.close_s = {"writes": t1 - t0, "processes": t2 - t1, "buffers": time.perf_counter() - t2}
