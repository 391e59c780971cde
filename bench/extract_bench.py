"""Extraction throughput against the bare target forward over the same batches, in one process.

    python bench/extract_bench.py --shape 27b --seq-len 8192 --seqs 16             # H200, fixed lengths
    python bench/extract_bench.py --shape 27b --layers 16 --lengths chat --tokens 600000 \
        --runs 0:cold,0:warm,8:cold                                                # H200, a chat length mix
    python bench/extract_bench.py --shape tiny --seq-len 1024 --seqs 64            # CPU
    python bench/extract_bench.py --plan-only --tokens 3000000                     # padding, planner only

Rows (all over the batches the worker itself plans: bucketed lengths, same sizes):
  body forward          model.model(ids, attention_mask) only (no LM head)
  body, no mask         the same with the per-layer-type "none" masks forward_features gives (exact for
                        right padding)
  target forward        the body plus the LM head's logits for every real token (what a causal LM's
                        forward computes; chunked), no top-k: the baseline the ratios use
  forward+features      the worker's forward_features: hooks, pad removal, LM head, top-k, lse
  pipeline, GPU side    the real worker (planner's store, its batching, D2H, compression, zarr
                        writes, markers) until the last batch's features reached the host
  pipeline, store written   the same until every unit is written (includes the final drain)

--lengths chat draws lengths from a long-tailed chat distribution (log-normal, median 600 tokens,
16 .. --seq-len) and runs each of --runs in its own process: "B:cold" = --buckets-per-octave B with
an empty Triton cache (the first run on a machine: every kernel compiled and autotuned while the
pipeline runs, and counted), "B:warm" = the same with the cache the cold run left. In each process
the pipeline runs first, so a cold run pays its compilation inside the pipeline's time; the
baselines run after it, warm.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from shapes import random_target, synthetic_manifest, target_27b_config  # noqa: E402  (adds the repo to sys.path)

from extract.config import ExtractConfig
from extract.observer import Observer
from extract.plan import assign_units, by_length, write_plan
from extract.worker import Worker, plan_batches
from shared import schema as sc
from shared import store as st
from shared.data import Encoded
from shared.features import compiled_logsumexp, causal_masks, forward_features, logit_features, pad_batch, valid_index
from shared.progress import log
from shared.target import default_layer_ids
from shared.tiny import tiny_config



class Watch(Observer):
    """What this benchmark measures of the worker, through the hooks the worker calls."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.first_forward_at = 0.0  # when the first batch started: setup (buffers, processes) is before it
        self.gpu_done_at = 0.0       # when the last batch's features reached the host
        self.timeline = []           # per batch: (B, S, host s queueing it, device start and end events)
        self.units = []              # per unit: (s queued for a writer, s writing)

    @contextlib.contextmanager
    def forward(self, sequences: int, padded: int):
        self.first_forward_at = self.first_forward_at or time.time()
        if not self.cuda:
            yield
            return
        t0, start = time.perf_counter(), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.timeline.append((sequences, padded, time.perf_counter() - t0, start, end))

    def features_on_host(self):
        self.gpu_done_at = time.time()

    def unit_written(self, queued_s: float, writing_s: float):
        self.units.append((queued_s, writing_s))

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def chat_lengths(tokens: int, max_len: int, seed: int = 0) -> list[int]:
    """Log-normal lengths (median 600, sigma 1.1: tens of tokens to the 8k cap), until `tokens`."""
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < tokens:
        n = int(np.clip(rng.lognormal(np.log(600), 1.1), 16, max_len))
        out.append(n)
        total += n
    return out


def plan_only(a):
    """Padding and shapes of the worker's batches for a chat length mix, units packed in sample
    order and longest first, per padding setting: the planner alone, no model."""
    lengths = chat_lengths(a.tokens, a.seq_len)
    S, bt = max(a.shard_tokens, a.seq_len), max(a.batch_tokens, a.seq_len)
    print(f"{len(lengths):,} samples, {sum(lengths):,} tokens; units of {S}, batches of <= {bt} tokens")
    print(f"{'units':>14s}{'buckets':>9s}{'pow2':>6s}{'padding':>9s}{'shapes':>8s}{'batches':>9s}")
    for name, order in (("sample order", None), ("longest first", by_length(lengths))):
        offsets, n_units = assign_units(lengths, S, order)
        for buckets, pow2 in ((0, False), (8, False), (16, False), (8, True)):
            padded, shapes, n = 0, set(), 0
            for u, members in enumerate(sc.samples_by_unit(offsets, S, n_units)):
                items = [(int(i), int(offsets[i]) - u * S, lengths[i]) for i in members]
                for batch, L in plan_batches(items, bt, 64, buckets, pow2):
                    padded, n = padded + len(batch) * L, n + 1
                    shapes.add((len(batch), L))
            print(f"{name:>14s}{buckets:9d}{'yes' if pow2 else 'no':>6s}{padded / sum(lengths) - 1:9.1%}"
                  f"{len(shapes):8d}{n:9d}")


class Pruner(threading.Thread):
    """--prune: deletes each marked unit's feature shards, counting their bytes first, so a run of
    millions of tokens (~37 GiB of store per million at the 27B shape's hidden size) fits the
    device's disk. Every write still happens; only what is on disk at the end differs."""

    def __init__(self, store: Path):
        super().__init__(daemon=True)
        self.store, self.swept, self.bytes = store, set(), 0
        self.stopped = threading.Event()

    def run(self):
        while not self.stopped.wait(0.5):
            self.sweep()

    def sweep(self):
        for u in sorted(st.done_unit_ids(self.store) - self.swept):
            for name in sc.FEATURE_ARRAYS:
                p = self.store / name / "c" / str(u)  # zarr's default keys: c/<shard>[/0/0]
                files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
                self.bytes += sum(f.stat().st_size for f in files)
                if p.is_file():
                    p.unlink()
                elif p.is_dir():
                    shutil.rmtree(p)
            self.swept.add(u)

    def finish(self) -> int:
        self.stopped.set()
        self.join()
        self.sweep()
        return self.bytes


def sync_check(w: Worker, model, planned: st.Store, index) -> dict[str, int]:
    """One real batch through the worker's own batch step (forward, features, copies into a pinned
    shared unit buffer) with CUDA's sync debug mode on: where the host waited for the device, as
    {file:line: count}. A wait leaves the device idle while the host prepares what comes next."""
    from extract.writers import UnitPool
    S = planned.layout.shard_tokens
    members = sc.samples_by_unit(index["offset"], S, planned.layout.n_units)[0]
    items = [(int(i), int(index["offset"][i]), int(index["length"][i])) for i in members]
    batch, padded = next(plan_batches(items, w.cfg.batch_tokens, w.cfg.max_batch, w.cfg.buckets_per_octave,
                                      w.cfg.pow2_batch))
    pool = UnitPool(planned.layout, 1, pin=True, shared=True)
    buf = pool.get(0, len(batch), 0)
    stream = torch.cuda.Stream()
    args = (model, buf, batch, padded, planned.unit_tokens(0), index["file"], index["row"], stream)
    w._batch(*args)  # warm: a first call may compile
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            w._batch(*args)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    pool.close()
    lines, first = inspect.getsourcelines(torch.cuda.set_sync_debug_mode)
    own = range(first, first + len(lines))  # switching the mode off reports itself: not the worker's
    found = Counter(f"{Path(c.filename).parent.name}/{Path(c.filename).name}:{c.lineno}" for c in caught
                    if "synchroniz" in str(c.message) and not (c.filename == torch.cuda.__file__ and c.lineno in own))
    while not w.collect_q.empty():
        w.collect_q.get()
    return dict(found)


def measure(a) -> dict:
    """One process: build the target, plan the store, run the worker, then the baselines."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tcfg = target_27b_config(a.layers) if a.shape == "27b" else tiny_config(2048)
    t0 = time.time()
    model = random_target(tcfg, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"target {a.shape}: {n_params / 1e9:.2f}B params, built in {time.time() - t0:.0f}s on {device}")
    L = tcfg.num_hidden_layers
    layer_ids = default_layer_ids(L, 5)
    lengths = chat_lengths(a.tokens, a.seq_len) if a.lengths == "chat" else [a.seq_len] * a.seqs
    g = torch.Generator().manual_seed(0)
    enc = [Encoded(torch.randint(0, tcfg.vocab_size, (n,), generator=g).numpy().astype(np.int32),
                   np.ones(n, dtype=np.uint8), 0, i) for i, n in enumerate(lengths)]
    tmp = Path(a.dir or tempfile.mkdtemp(prefix="xbench-"))
    store = tmp / "store"
    shutil.rmtree(store, ignore_errors=True)
    cfg = ExtractConfig(data="synthetic", target="in-memory", store=str(store), layer_ids=layer_ids,
                        max_len=a.seq_len, precision=a.precision, codec=a.codec, topk=16,
                        batch_tokens=max(a.batch_tokens, a.seq_len), shard_tokens=max(a.shard_tokens, a.seq_len),
                        writers=a.writers, writer_procs=a.writer_procs, buckets_per_octave=a.buckets,
                        pow2_batch=a.pow2, writer_nice=a.writer_nice, progress=False)
    manifest = synthetic_manifest(cfg, tcfg.hidden_size, L, tcfg.vocab_size, layer_ids, len(enc))
    write_plan(cfg, manifest, enc, len(layer_ids), tcfg.hidden_size)
    tokens = sum(lengths)
    cores = len(os.sched_getaffinity(0))

    # 1. the real worker first: a cold run compiles and autotunes inside this timing
    watch = Watch(device)
    w = Worker(cfg, 0, 1, device, model=model, cores=cores, observer=watch)
    planned = st.Store(store, require_complete=False)
    layout, index = planned.layout, planned.index()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    pruner = Pruner(store) if a.prune else None
    if pruner is not None:
        pruner.start()
    t_start, c_start = time.time(), time.process_time()
    if a.profile:  # where the worker's own process spends the pipeline (the writer processes are apart)
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            t_pipe = timed(lambda: w.run(list(range(layout.n_units))), device)
        ka = prof.key_averages()
        print(ka.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        for e in sorted((e for e in ka if e.key.startswith("extract.")), key=lambda e: -e.cpu_time_total):
            print(f"  {e.key:28s} {e.cpu_time_total / 1e6:8.2f} s on the worker's thread, {e.count} calls")
        if device.type == "cuda":
            print(ka.table(sort_by="self_device_time_total", row_limit=15), flush=True)
            busy = sum(e.self_device_time_total for e in ka) / 1e6
            print(f"profiled pipeline: {t_pipe:.1f} s wall, device kernels {busy:.1f} s "
                  f"(the device idle ~{max(0.0, 1 - busy / t_pipe):.0%} of the time)", flush=True)
    else:
        t_pipe = timed(lambda: w.run(list(range(layout.n_units))), device)
    t_gpu = watch.gpu_done_at - t_start
    t_setup = watch.first_forward_at - t_start  # buffers pinned and writer processes started, beside the warm-up
    cpu_worker, cpu_writers = time.process_time() - c_start, w.out.cpu_seconds()
    queued = [q for q, _ in watch.units]
    writing = [x for _, x in watch.units]
    pruned = pruner.finish() if pruner is not None else 0  # first: it deletes what it counts
    disk = st.disk_bytes(store) + pruned
    log(f"pipeline: {t_pipe:.1f} s, GPU side {t_gpu:.1f} s, {tokens / t_pipe:,.0f} tok/s")
    timeline = None
    if watch.timeline:
        tl = watch.timeline
        mem = torch.cuda.memory_stats(device)
        timeline = {"shapes": [[b, n] for b, n, *_ in tl], "host_ms": [h * 1e3 for _, _, h, _, _ in tl],
                    "device_ms": [s.elapsed_time(e) for *_, s, e in tl],
                    "gap_ms": [tl[k][4].elapsed_time(tl[k + 1][3]) for k in range(len(tl) - 1)],
                    "device_mallocs": mem.get("num_device_alloc"), "alloc_retries": mem.get("num_alloc_retries")}
    syncs = sync_check(w, model, planned, index) if device.type == "cuda" else None

    # 2. the baselines over the same batches the worker planned, warm
    S = layout.shard_tokens
    planned_batches = [(batch, padded) for u, members in enumerate(sc.samples_by_unit(index["offset"], S, layout.n_units))
                       for batch, padded in plan_batches([(int(i), int(index["offset"][i]) - u * S, int(index["length"][i]))
                                                          for i in members], cfg.batch_tokens, cfg.max_batch,
                                                         cfg.buckets_per_octave, cfg.pow2_batch)]
    shapes = {(len(b), n) for b, n in planned_batches}
    padded_all = sum(len(b) * n for b, n in planned_batches)
    # --baseline-every N: the baselines time every Nth batch, scaled to all by padded tokens (long runs)
    sampled = list(range(0, len(planned_batches), a.baseline_every))
    tensors = []
    for k in sampled:
        batch, padded = planned_batches[k]
        ids, att = pad_batch([torch.from_numpy(enc[i].input_ids.astype(np.int64)) for i, _, _ in batch], 0, padded)
        tensors.append((ids.to(device), att.to(device), [n for _, _, n in batch]))
    scale = padded_all / sum(ids.numel() for ids, _, _ in tensors)
    head = model.lm_head.weight

    def body():
        with torch.no_grad():
            for ids, att, _ in tensors:
                model.model(input_ids=ids, attention_mask=att, use_cache=False)
                sync(device)

    def body_unmasked():  # as forward_features calls it: right padding needs no mask (shared/features.py)
        with torch.no_grad():
            for ids, _, _ in tensors:
                model.model(input_ids=ids, attention_mask=causal_masks(model), use_cache=False)
                sync(device)

    def target():
        with torch.no_grad():
            for ids, att, ns in tensors:
                out = model.model(input_ids=ids, attention_mask=att, use_cache=False).last_hidden_state
                last = out.reshape(-1, out.shape[-1]).index_select(0, valid_index(ns, ids.shape[1]).to(device))
                for lo in range(0, last.shape[0], cfg.logit_chunk):
                    last[lo:lo + cfg.logit_chunk] @ head.T
                sync(device)

    launch, per_batch = [0.0], []

    def feats():
        launch[0] = 0.0
        per_batch.clear()
        with torch.no_grad():
            for ids, att, ns in tensors:
                t0 = time.perf_counter()
                forward_features(model, ids, ns, layer_ids, 16, cfg.logit_chunk)
                launch[0] += time.perf_counter() - t0  # the host's time to queue the batch's work
                sync(device)
                per_batch.append((time.perf_counter() - t0) * 1e3)

    if a.baseline_twice:
        feats()  # warm (the worker already was, over the same shapes)
    t_body, t_target, t_feat = timed(body, device), timed(target, device), timed(feats, device)
    t_unmasked = timed(body_unmasked, device)
    launch[0] *= scale
    log(f"body {t_body:.1f} s, target forward {t_target:.1f} s, forward+features {t_feat:.1f} s "
        f"over {len(tensors)} of {len(planned_batches)} batches")
    if a.baseline_twice:  # the best of two: drift between the first and the last timing
        t_body, t_target = min(t_body, timed(body, device)), min(t_target, timed(target, device))
    t_body, t_target, t_feat, t_unmasked = (t * scale for t in (t_body, t_target, t_feat, t_unmasked))

    # 3. the LM head alone on one chunk: matmul, the earlier top-k/lse paths, the new one per block size
    head_ms, head_check = {}, {}
    if device.type == "cuda":
        x = torch.randn(cfg.logit_chunk, tcfg.hidden_size, device=device, dtype=dtype)
        lse_c = compiled_logsumexp()

        def f32_row():
            logits = (x @ head.T).float()
            lse = torch.logsumexp(logits, dim=-1)
            v, i = logits.topk(16, dim=-1)
            return v - lse[:, None], i

        def row():  # top-k over the whole row in the model's dtype (the path before topk_by_blocks)
            logits = x @ head.T
            v, i = logits.topk(16, dim=-1)
            return i, v.float() - lse_c(logits, logits.amax(dim=-1))[:, None]

        paths = [("matmul only", lambda: x @ head.T), ("float32 top-k over the row + lse", f32_row),
                 ("model-dtype top-k over the row + compiled lse", row)]
        paths += [(f"top-k by blocks of {b} + compiled lse", functools.partial(logit_features, x, head, 16,
                                                                               cfg.logit_chunk, block=b))
                  for b in (64, 128, 256, 512, 1024)]
        for name, fn in paths:
            for _ in range(3):
                fn()
            head_ms[name] = timed(lambda: [fn() for _ in range(20)], device) / 20 * 1e3
        # the same log-probs as top-k over the row, on real-sized logits
        ref = row()[1].cpu()
        for b in (64, 256, 1024):
            head_check[b] = bool(torch.equal(logit_features(x, head, 16, cfg.logit_chunk, block=b)[1].cpu(), ref))
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else float("nan")
    if timeline is not None:
        timeline["baseline_ms"] = list(per_batch)  # the same batches (every --baseline-every'th), in order
        timeline["baseline_index"] = sampled
    if a.dir is None:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"shape": a.shape, "layers": L, "logit_chunk": cfg.logit_chunk, "params_b": n_params / 1e9, "lengths": a.lengths, "samples": len(lengths),
            "tokens": tokens, "mean_len": tokens / len(lengths), "max_len": max(lengths), "buckets": a.buckets,
            "pow2": a.pow2, "batches": len(planned_batches), "shapes": len(shapes),
            "baseline_batches": len(sampled), "padded_tokens": padded_all, "writers": w.writers, "writer_procs": w.procs, "writer_nice": a.writer_nice, "cores": cores,
            "cpu_worker_s": cpu_worker, "cpu_writers_s": cpu_writers, "buffer_wait_s": w.out.pool.waited,
            "unit_queued_s": [float(np.mean(queued)), float(np.max(queued))],
            "unit_write_s": [float(np.mean(writing)), float(np.max(writing))],
            "units": layout.n_units, "body_s": t_body, "body_unmasked_s": t_unmasked, "launch_s": launch[0],
            "target_s": t_target, "features_s": t_feat, "pipeline_gpu_s": t_gpu, "setup_s": t_setup,
            "close_s": w.out.close_s, "pipeline_s": t_pipe, "disk_bytes": disk,
            "raw_bytes": tokens * len(layer_ids) * tcfg.hidden_size * 2, "peak_gib": peak, "head_ms": head_ms, "head_check": head_check,
            "precision": a.precision, "codec": a.codec, "layer_ids": layer_ids, "syncs": syncs,
            "timeline": timeline}


def report(r: dict, label: str = ""):
    tok = r["tokens"]
    print(f"\n{label}{r['shape']} shape, {r['layers']} layers ({r['params_b']:.2f}B params): {r['samples']:,} samples, "
          f"{tok:,} tokens (mean {r['mean_len']:.0f}, max {r['max_len']}), {r['batches']} batches of "
          f"{r['shapes']} distinct shapes, padding {r['padded_tokens'] / tok - 1:.1%}, buckets/octave "
          f"{r['buckets']}{' pow2' if r['pow2'] else ''}; {r['units']} units, {r['writers']} writer "
          f"{'processes' if r.get('writer_procs') else 'threads'}"
          f"{' at nice ' + str(r.get('writer_nice')) if r.get('writer_procs') else ''}, {r['cores']} cores")
    if r.get("baseline_batches", r["batches"]) < r["batches"]:
        print(f"the body, target and forward+features rows: timed over {r['baseline_batches']} of the {r['batches']} "
              f"batches (every Nth), scaled to all by padded tokens: estimates")
    print(f"{'':26s}{'seconds':>9s}{'tok/s':>11s}{'vs target':>11s}{'vs body':>9s}")
    for name, key in (("body forward", "body_s"), ("body, no mask (as ours)", "body_unmasked_s"),
                      ("target forward", "target_s"), ("forward+features", "features_s"),
                      ("pipeline, GPU side", "pipeline_gpu_s"), ("pipeline, store written", "pipeline_s")):
        if key not in r:
            continue
        t = r[key]
        print(f"{name:26s}{t:9.2f}{tok / t:11,.0f}{r['target_s'] / t:11.3f}{r['body_s'] / t:9.3f}")
    if "setup_s" in r:
        t = r["pipeline_gpu_s"] - r["setup_s"]
        print(f"setup before the first batch (unit buffers allocated and pinned, writer processes started, "
              f"beside the model's warm-up forward) "
              f"{r['setup_s']:.2f} s; the GPU side from the first forward {t:.2f} s = {r['target_s'] / t:.3f} of the "
              f"target forward")
    drain = r["pipeline_s"] - r["pipeline_gpu_s"]
    if r.get("close_s"):
        c = r["close_s"]
        print(f"closing the writers: last writes {c['writes']:.2f} s, writer processes' exit {c['processes']:.2f} s, "
              f"unit buffers unpinned and freed {c['buffers']:.2f} s")
    print(f"final drain {drain:.2f} s = {drain / r['pipeline_s']:.1%} of the pipeline; raw bf16 features "
          f"{r['raw_bytes'] / 2**30:.2f} GiB -> {r['disk_bytes'] / 2**30:.2f} GiB on disk "
          f"({r['raw_bytes'] / r['disk_bytes']:.3f}x); raw feature rate at target-forward speed "
          f"{r['raw_bytes'] / r['target_s'] / 1e9:.2f} GB/s; peak GPU memory {r['peak_gib']:.1f} GiB")
    if "launch_s" in r:
        print(f"the host took {r['launch_s']:.2f} s of the {r['features_s']:.2f} s of forward+features to queue its "
              f"work ({r['launch_s'] / r['features_s']:.0%}: near 100% the forward is the host's speed, and any "
              f"other load on the host slows it)")
    if "cpu_worker_s" in r:
        cw, cp = r["cpu_worker_s"], r["cpu_writers_s"]
        print(f"host CPU during the pipeline: {(cw + cp) / r['pipeline_s']:.1f} cores busy (worker process "
              f"{cw / r['pipeline_s']:.1f}, writer processes {cp / r['pipeline_s']:.1f}); raw features written at "
              f"{r['raw_bytes'] / r['pipeline_s'] / 1e9:.2f} GB/s")
        (qm, qx), (wm, wx) = r["unit_queued_s"], r["unit_write_s"]
        print(f"the device waited {r['buffer_wait_s']:.1f} s for a free unit buffer; a unit waited for a writer "
              f"{qm:.2f} s (max {qx:.2f}), then took {wm:.2f} s (max {wx:.2f}) to write")
    if r.get("syncs") is not None:
        where = ", ".join(f"{k} x{n}" for k, n in sorted(r["syncs"].items(), key=lambda kv: -kv[1]))
        print(f"host waits for the device in one batch of the worker: {sum(r['syncs'].values())} ({where or 'none'})")
    if r.get("timeline"):
        report_timeline(r["timeline"])
    if "autotunes" in r:
        print(f"Triton: {r['autotunes']} autotuning runs ({r['autotune_s']:.1f} s of tuning reported), "
              f"{r['cached_kernels']} compiled kernels in the cache after the run")
        for name, (n, secs) in sorted(r.get("tuned_kernels", {}).items(), key=lambda kv: -kv[1][1]):
            print(f"  tuned {name}: {n} key{'s' * (n > 1)}, {secs:.1f} s")
    for name, ms in r["head_ms"].items():
        print(f"  LM head, one chunk of {r['logit_chunk']} tokens: {name:48s}{ms:8.2f} ms")
    for block, same in r.get("head_check", {}).items():
        print(f"  top-k by blocks of {block}: the same log-probs as top-k over the row: {same}")


def report_timeline(t: dict):
    """Where the pipeline's device time went, batch by batch, against the same batch's
    forward+features alone (synced per batch, warm; every --baseline-every'th batch)."""
    dev_all, gaps, host_all, base = (np.array(t[k]) for k in ("device_ms", "gap_ms", "host_ms", "baseline_ms"))
    idx = np.array(t.get("baseline_index", range(len(base))), dtype=int)
    if len(base) != len(idx) or (len(idx) and idx.max() >= len(dev_all)):
        print(f"timeline: {len(dev_all)} batches in the pipeline, {len(base)} in the baseline: not compared")
        return
    seen, first = set(), []
    for b, _ in t["shapes"]:  # a batch size's first batch may compile a kernel (bench/shape_bench.py)
        first.append(b not in seen)
        seen.add(b)
    first, dev, host = np.array(first)[idx], dev_all[idx], host_all[idx]
    idle_before = np.concatenate([[0.0], gaps])[idx]
    which = "" if len(idx) == len(dev_all) else f" (the {len(idx)} of {len(dev_all)} that the baselines ran)"
    print(f"timeline of the pipeline's batches{which} on the device: forward+features {dev.sum() / 1e3:.2f} s "
          f"against {base.sum() / 1e3:.2f} s alone (x{dev.sum() / base.sum():.3f}, median batch "
          f"x{np.median(dev / base):.3f}); over all {len(dev_all)} batches the device idle between batches "
          f"{gaps.sum() / 1e3:.2f} s (max {gaps.max(initial=0) / 1e3:.2f} s), the host queueing them "
          f"{host_all.sum() / 1e3:.2f} s; cudaMallocs {t['device_mallocs']}, allocation retries {t['alloc_retries']}")
    extra = dev - base
    print(f"  batches of a batch size new to the process: {first.sum()}, {extra[first].sum() / 1e3:.2f} s over "
          f"their alone time; the others {extra[~first].sum() / 1e3:.2f} s")
    for j in np.argsort(-extra)[:5]:
        k = idx[j]
        print(f"  batch {k} {tuple(t['shapes'][k])}: {dev[j]:.0f} ms on the device against {base[j]:.0f} ms alone, "
              f"host queueing {host[j]:.0f} ms, idle before it {idle_before[j]:.0f} ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("27b", "tiny"), default="tiny")
    ap.add_argument("--layers", type=int, default=64, help="target layers (27b shape)")
    ap.add_argument("--lengths", choices=("fixed", "chat"), default="fixed")
    ap.add_argument("--seq-len", type=int, default=8192, help="fixed: every length; chat: the cap")
    ap.add_argument("--seqs", type=int, default=16, help="fixed: how many")
    ap.add_argument("--tokens", type=int, default=600_000, help="chat: total tokens")
    ap.add_argument("--runs", default=None, help="chat: e.g. 8:cold,8:warm,0:cold (each in its own process)")
    ap.add_argument("--buckets", type=int, default=0)
    ap.add_argument("--pow2", action="store_true")
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--codec", default="zstd1")
    ap.add_argument("--writers", type=int, default=0, help="0: the worker's automatic count")
    ap.add_argument("--writer-procs", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--writer-nice", type=int, default=ExtractConfig.writer_nice, help="the writer processes' niceness")
    ap.add_argument("--profile", action="store_true", help="run the pipeline under torch.profiler and print "
                    "where the worker process spends it (slower: read the shares, not the times; with --runs, "
                    "warm runs only)")
    ap.add_argument("--cache", default=None, help="--runs: the Triton caches' folder (default: new temp dirs); "
                    "a warm run finds what an earlier invocation's cold run left there")
    ap.add_argument("--once", dest="baseline_twice", action="store_false", help="the body and target forwards "
                    "timed once, not twice, and no warm-up call before them (the best of two guards against drift; "
                    "once is for quick checks)")
    ap.add_argument("--baseline-every", type=int, default=1, help="the baselines time every Nth batch, "
                    "scaled to all by padded tokens (a long run's baselines would take 4x its forward)")
    ap.add_argument("--prune", action="store_true", help="delete each unit's feature shards once it is marked "
                    "(bytes counted first): a long run's store fits the disk")
    ap.add_argument("--shard-tokens", type=int, default=16384)
    ap.add_argument("--dir", default=None, help="where the store is written (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plan-only", action="store_true", help="chat: padding per setting from the planner, no model")
    ap.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.plan_only:
        return plan_only(a)
    if a.runs is None:
        r = measure(a)
        if a.child_json:
            Path(a.child_json).write_text(json.dumps(r))
            return
        report(r)
        results = r
    else:
        results, caches = [], {}
        for spec in a.runs.split(","):
            buckets, cache = spec.split(":")
            key = buckets + ("p" if a.pow2 else "")
            if cache == "cold" or key not in caches:
                if a.cache:  # one place across invocations: a later `--runs B:warm --cache DIR` is warm
                    caches[key] = f"{a.cache}/{key}"
                    if cache == "cold":
                        shutil.rmtree(caches[key], ignore_errors=True)
                    os.makedirs(caches[key], exist_ok=True)
                else:
                    caches[key] = tempfile.mkdtemp(prefix="triton-")
            out = Path(tempfile.mkdtemp()) / "r.json"
            argv = list(sys.argv[1:])
            i = argv.index("--runs")
            del argv[i:i + 2]
            if cache == "cold" and "--profile" in argv:  # a cold run's profile is the tuning's: warm runs only
                argv.remove("--profile")
            cmd = [sys.executable, __file__, *argv, "--buckets", buckets, "--child-json", str(out)]
            env = {**os.environ, "TRITON_CACHE_DIR": caches[key], "TORCHINDUCTOR_CACHE_DIR": caches[key] + "/inductor",
                   "TRITON_PRINT_AUTOTUNING": "1"}
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            # Triton prints "Triton autotuning for function NAME,\nwith key as ...,\nfinished after Xs" (one line or several)
            found = re.findall(r"Triton autotuning for function (\S+?),?\s.*?finished after ([0-9.]+)s",
                               p.stdout + p.stderr, flags=re.S)
            tunes = [float(t) for _, t in found]
            by_kernel = {}
            for name, t in found:
                n, secs = by_kernel.get(name, (0, 0.0))
                by_kernel[name] = (n + 1, secs + float(t))
            if p.returncode != 0 or not out.exists():
                print(f"run {spec} FAILED (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}", flush=True)
                results.append({"run": spec, "error": (p.stdout + p.stderr)[-3000:]})
                continue
            if a.profile and cache == "warm":  # the child's profile tables
                shown = "\n".join(line for line in p.stdout.splitlines() if "it/s]" not in line)
                print(f"[{spec}] profile:\n{shown}", flush=True)
            r = json.loads(out.read_text())
            r.update(run=spec, autotunes=len(tunes), autotune_s=sum(tunes), tuned_kernels=by_kernel,
                     cached_kernels=sum(1 for _ in Path(caches[key]).rglob("*.json")))
            report(r, f"[{spec}] ")
            results.append(r)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
