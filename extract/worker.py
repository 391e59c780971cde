"""One extraction worker: owns one device and computes the units it claims (extract/claims.py).

The device never waits on compression or disk:
  - each batch's features are copied device-to-host on a side stream, straight into the pinned
    host buffer of their unit (no staging copy), while the next batch's forward runs;
  - a collector thread waits for each copy, drops samples with NaN/inf features, and hands a
    finished unit to the writers;
  - the writers (extract/writers.py: threads, or processes over shared buffers) compress and
    write whole units (zarr shards) and return the buffer, cleared, to a fixed pool. The pool is
    the back-pressure: host memory is a fixed number of unit buffers, whatever the corpus size.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import threading

import numpy as np
import torch
from torch.profiler import record_function

from extract.claims import Claims, claimed_units
from extract.config import ExtractConfig
from extract.observer import Observer
from extract.writers import UnitBuffer, UnitWriters
from shared import schema as sc
from shared import store as st
from shared import tuning
from shared.features import forward_features, pad_batch
from shared.location import as_location
from shared.progress import log
from shared.target import compute_dtype, load_target

def bucket_length(n: int, per_octave: int, cap: int) -> int:
    """The padded length for a batch whose longest sample has n tokens: the smallest value of
    the ladder 16, 32, 48, 64, then 2^k * (1 + j / per_octave) in steps of at least 16, that is >= n,
    never above cap (itself one fixed length). per_octave = 0: n itself. At most
    1 / per_octave of a batch is padding added by the ladder. Off by default: the kernels'
    autotuning keys hold token counts and batch sizes, not lengths (docs/DESIGN.md, "Extraction
    speed"), so the ladder bounds the set of lengths but not the tunings."""
    if per_octave <= 0 or n > cap:
        return n
    # in (2^k, 2^(k+1)] the step is 2^k / per_octave, never under 16 (so 16 up to 64)
    step = 16 if n <= 64 else max(16, (1 << ((n - 1).bit_length() - 1)) // per_octave)
    return min(-(-n // step) * step, cap)


def plan_batches(items: list[tuple[int, int, int]], batch_tokens: int, max_batch: int, per_octave: int = 0,
                 pow2: bool = False):
    """items: (sample, offset, length). Longest first, so each batch pads little; deterministic,
    so a resumed unit is computed exactly as an uninterrupted one. Yields (batch, padded length):
    the length from bucket_length, as many samples as fit in batch_tokens (at most max_batch;
    with pow2, rounded down to a power of two, for kernels that autotune per batch size)."""
    items = sorted(items, key=lambda x: (-x[2], x[0]))
    i = 0
    while i < len(items):
        S = bucket_length(items[i][2], per_octave, batch_tokens)
        n = max(1, min(max_batch, batch_tokens // S, len(items) - i))
        if pow2:
            n = 1 << (n.bit_length() - 1)
        yield items[i:i + n], S
        i += n


_STOP = object()


class _OnThread(threading.Thread):
    """fn() on a thread of its own, started at once, with the caller's device current there
    (cudaHostRegister pins memory for the calling thread's current device). result() waits and
    returns fn's value or raises its error."""

    def __init__(self, fn, device: torch.device):
        super().__init__(daemon=True)
        self.fn, self.value, self.exc = fn, None, None
        self.index = None
        if device.type == "cuda":
            self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.start()

    def run(self):
        try:
            if self.index is not None:
                torch.cuda.set_device(self.index)
            self.value = self.fn()
        except BaseException as e:
            self.exc = e

    def result(self):
        self.join()
        if self.exc is not None:
            raise self.exc
        return self.value


def writer_cores(cores: int) -> int:
    """The cores a worker's writers have: all but two, left for the forward's host work and the
    collector (at least 2)."""
    return max(2, cores - 2)


def writer_count(cfg: ExtractConfig, cores: int, procs: bool) -> int:
    """--writers, or from the cores this worker has, two left for the forward's host work and the
    collector. Threads: at most 8 (on a 16-core H200 host 4, 8 and 16 threads wrote at the same
    rate, the process's zarr machinery being the limit: bench/host_bench.py). Processes: one per
    two cores (4 and 8 wrote at the same rate on 16 cores, each keeping about one busy). Each writer
    holds one unit buffer (pinned memory on a GPU)."""
    if cfg.writers > 0:
        return cfg.writers
    free = writer_cores(cores)
    return max(1, free // 2) if procs else min(8, free)


def encode_threads(cores: int, writers: int, procs: bool) -> int:
    """The threads each writer process compresses a unit's chunks on: its share of the cores the
    writers have (writer_cores), 1 to 8. Each process had 8 before: on 16 cores 7
    processes then ran 56 threads, and a numpy codec's threads in one process queue for its
    interpreter lock (BENCHMARKS.md, "Ninth session"). Writer threads share one pool: 0, min(8, cores)."""
    return max(1, min(8, writer_cores(cores) // max(1, writers))) if procs else 0


def writer_procs(cfg: ExtractConfig, device: torch.device) -> bool:
    """--writer-procs: auto = processes on a GPU (where the forward outruns one process's writes),
    threads on the CPU (where each process would cost a start and the forward is the limit)."""
    return cfg.writer_procs == "on" or (cfg.writer_procs == "auto" and device.type == "cuda")


class Worker:
    def __init__(self, cfg: ExtractConfig, rank: int, world: int, device: torch.device, progress_q=None,
                 model=None, cores: int | None = None, claims: Claims | None = None,
                 observer: Observer | None = None):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.claims = claims  # None: the units given to run() are this worker's alone (benchmarks)
        self.procs = writer_procs(cfg, device)
        cores = cores or os.cpu_count() or 1
        self.writers = writer_count(cfg, cores, self.procs)
        self.encode_threads = encode_threads(cores, self.writers, self.procs)
        self.progress_q = progress_q
        self.model = model  # benchmarks pass a model built in memory; otherwise loaded from cfg.target
        self.reader = st.Store(cfg.store, require_complete=False)
        man = self.reader.manifest
        self.layout = man.layout
        self.layer_ids = man.layer_ids
        self.pad_id = man.tokenizer.pad_token_id or 0
        self.collect_q: queue.Queue = queue.Queue()
        self.out: UnitWriters | None = None  # made in run(): processes start there, not on construction
        self.observer = observer or Observer()

    @property
    def error(self) -> BaseException | None:
        return self.out.error if self.out is not None else None

    # -- the collector thread --------------------------------------------------------------

    def _collector(self):
        while (item := self.collect_q.get()) is not _STOP:
            event, ok, keep_alive, placements = item
            if event is not None:
                event.synchronize()
            del keep_alive  # device tensors the copies read from, held until the copies are done
            for buf, b, sample, lo, n, src in placements:
                if not ok[b]:
                    for t in buf.arrays.values():
                        t[lo:lo + n] = 0
                    buf.dropped.append({"sample": sample, **src})
                buf.remaining -= 1
                if buf.remaining == 0:
                    self.out.submit(buf)
            self.observer.features_on_host()

    # -- main loop -------------------------------------------------------------------------
    def run(self, units):
        """units: an iterable of unit ids (claimed_units, or a list when nothing else writes)."""
        cfg, dev = self.cfg, self.device
        index = self.reader.index()
        offsets, lengths, rows, files = index["offset"], index["length"], index["row"], index["file"]
        S = self.layout.shard_tokens
        by_unit = sc.samples_by_unit(offsets, S, self.layout.n_units)
        dtype = compute_dtype(cfg.dtype, dev)
        cuda = dev.type == "cuda"
        # The unit buffers (GiBs allocated and pinned: seconds) and the writer processes are made on
        # a thread while the model loads and runs a warm-up forward, the process's one-time
        # initialisation (CUDA modules, kernels loaded or compiled: seconds too).
        setup = _OnThread(lambda: UnitWriters(cfg.store, self.layout, self.writers, self.procs,
                                              extra=cfg.queue_units + 1, pin=cuda, claims=self.claims,
                                              rank=self.rank, progress_q=self.progress_q,
                                              nice=cfg.writer_nice, observer=self.observer,
                                              encode_threads=self.encode_threads), dev)
        collector = None
        try:
            model = self.model if self.model is not None else load_target(cfg.target, dev, dtype)
            # one tuning per FLA kernel, not one per batch shape (shared/tuning.py)
            record = tuning.enable(torch.cuda.get_device_name(dev),
                                   getattr(model.config, "text_config", model.config).to_dict()) if cuda else None
            if record is not None and record.seeded:
                log(f"worker {self.rank}: shipped kernel tunings for this GPU and target shape: "
                    f"{len(record.seeded)} kernels not tuned here ({record.folder})")
            with record_function("extract.warm_up"):
                self._warm_up(model)
            if record is not None:
                record()
            self.out = setup.result()
            collector = threading.Thread(target=self.out.guard(self._collector), daemon=True)
            collector.start()
            copy_stream = torch.cuda.Stream(dev) if cuda else None
            log(f"worker {self.rank} on {dev}: {self.out.describe()}")
            for u in units:
                members = by_unit[u]
                with record_function("extract.wait_buffer"):
                    buf = self.out.pool.get(u, len(members), int(lengths[members].sum()))
                if self.error:
                    raise self.error
                if len(members) == 0:
                    self.out.submit(buf)
                    continue
                with record_function("extract.unit_tokens"):
                    unit_ids = self.reader.unit_tokens(u)
                items = [(int(i), int(offsets[i]) - u * S, int(lengths[i])) for i in members]
                for batch, padded in plan_batches(items, cfg.batch_tokens, cfg.max_batch, cfg.buckets_per_octave,
                                                   cfg.pow2_batch):
                    if self.error:
                        raise self.error
                    self._batch(model, buf, batch, padded, unit_ids, files, rows, copy_stream)
                    if record is not None:
                        record()
        finally:
            setup.join()
            if self.out is None:  # made, though the run failed before taking them: closed all the same
                self.out = setup.value
            if collector is not None:
                self.collect_q.put(_STOP)
                collector.join()
            if self.out is not None:
                self.out.close()
        if self.error:
            raise self.error

    def _warm_up(self, model):
        """One forward of a few tokens, whose results are dropped: what a process pays once (the
        device's libraries and kernels loaded, the compiled log-sum-exp built) is paid here,
        beside the writers' setup, not in the first batch."""
        ids = torch.full((1, 16), self.pad_id, dtype=torch.long, device=self.device)
        forward_features(model, ids, [16], self.layer_ids, self.layout.topk, self.cfg.logit_chunk)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _batch(self, model, buf: UnitBuffer, batch, padded: int, unit_ids, files, rows, copy_stream):
        dev = self.device
        with record_function("extract.prepare_batch"):
            seqs = [torch.from_numpy(unit_ids[lo:lo + n].astype(np.int64)) for _, lo, n in batch]
            ids, _ = pad_batch(seqs, self.pad_id, padded)
            if dev.type == "cuda":  # an asynchronous copy needs pinned memory: from pageable the driver may wait
                ids = ids.pin_memory()
        ns = [n for _, _, n in batch]
        with self.observer.forward(len(batch), padded), record_function("extract.forward_features"):
            hidden, idx, logp, lse, ok = forward_features(
                model, ids.to(dev, non_blocking=True), ns, self.layer_ids, self.layout.topk, self.cfg.logit_chunk)
            feats = sc.encode_features(self.layout.precision, hidden, idx, logp, lse)
        event, ok_host = None, ok
        for name, t in feats.items():  # copy_ would broadcast a wrong layer count silently
            if t.shape[1:] != buf.arrays[name].shape[1:]:
                raise RuntimeError(f"{name} of shape {tuple(t.shape[1:])} for a store of "
                                   f"{tuple(buf.arrays[name].shape[1:])}")
        ctx = torch.cuda.stream(copy_stream) if copy_stream is not None else contextlib.nullcontext()
        if copy_stream is not None:
            copy_stream.wait_stream(torch.cuda.current_stream(dev))
        with ctx, record_function("extract.copies_to_host"):
            pos = 0
            for _, lo, n in batch:  # each sample straight into its place in the unit's pinned buffer
                for name, t in feats.items():
                    buf.arrays[name][lo:lo + n].copy_(t[pos:pos + n], non_blocking=True)
                pos += n
            if copy_stream is not None:
                ok_host = torch.empty(ok.shape, dtype=torch.bool, pin_memory=True)
                ok_host.copy_(ok, non_blocking=True)
                # blocking: the collector sleeps while it waits instead of spinning a core (CUDA's
                # default), which on a host of hyperthreads may be the forward's thread's sibling
                event = torch.cuda.Event(blocking=True)
                event.record(copy_stream)
        placements = [(buf, b, s, lo, n, {"file": int(files[s]), "row": int(rows[s])})
                      for b, (s, lo, n) in enumerate(batch)]
        self.collect_q.put((event, ok_host, (feats, ok), placements))
        if self.progress_q is not None:
            self.progress_q.put(("batch", 0, len(batch), sum(ns)))


def worker_main(cfg: ExtractConfig, rank: int, world: int, device: str, threads: int, spawned: bool,
                progress_q):
    """Entry point of a worker (spawned, or in the run's own process): claims and computes units
    until every unit of the store is done. rank/world: where in the units it starts claiming."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    else:
        torch.set_num_threads(max(1, threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        with Claims(as_location(cfg.store), cfg.lease_seconds) as claims:
            n_units = st.read_manifest(cfg.store).layout.n_units
            Worker(cfg, rank, world, torch.device(device), progress_q, cores=threads, claims=claims).run(
                claimed_units(claims, n_units, rank, world))
    except OSError as e:
        if e.errno == errno.ENOSPC and spawned:  # the parent turns this exit code into its message
            raise SystemExit(errno.ENOSPC) from None
        raise
