"""One extraction worker: owns one device and every unit u with u % world == rank.

The device never waits on compression or disk: the forward of batch k+1 is launched while a
collector thread waits for batch k's device-to-host copy and places it in its unit's host
buffer, and a pool of writer threads compresses and writes finished units. Both hand-offs are
bounded queues, so host memory stays flat whatever the corpus size.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from extract.features import forward_features, pad_batch
from shared import store as st
from shared.config import ExtractConfig
from shared.target import load_target

_STOP = object()


@dataclass
class UnitBuffer:
    unit: int
    arrays: dict[str, np.ndarray]
    remaining: int
    samples: int
    tokens: int
    dropped: list = field(default_factory=list)
    started: float = field(default_factory=time.time)


def new_unit_buffer(layout: st.Layout, unit: int, n_samples: int, n_tokens: int) -> UnitBuffer:
    shapes = layout.arrays()
    arrays = {name: np.zeros((layout.shard_tokens, *shape), dtype=dtype)
              for name, (shape, dtype) in shapes.items() if name in st.FEATURE_ARRAYS}
    return UnitBuffer(unit, arrays, n_samples, n_samples, n_tokens)


def plan_batches(items: list[tuple[int, int, int]], batch_tokens: int, max_batch: int):
    """items: (sample, offset, length). Longest first, so each batch pads little; deterministic,
    so a resumed unit is computed exactly as an uninterrupted one."""
    items = sorted(items, key=lambda x: (-x[2], x[0]))
    batch = []
    for it in items:
        if batch and (len(batch) + 1 > max_batch or (len(batch) + 1) * batch[0][2] > batch_tokens):
            yield batch
            batch = []
        batch.append(it)
    if batch:
        yield batch


class Worker:
    def __init__(self, cfg: ExtractConfig, rank: int, world: int, device: torch.device, progress_q=None,
                 model=None):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.model = model  # benchmarks pass a model built in memory; otherwise loaded from cfg.target
        self.progress_q = progress_q
        self.root = st.zarr.open_group(store=cfg.store, mode="r+")
        man = self.root.attrs["dflash"]
        self.layout = st.Layout(**man["layout"])
        self.layer_ids = man["layer_ids"]
        self.pad_id = man["tokenizer"]["pad_token_id"]
        self.error: BaseException | None = None
        self.collect_q: queue.Queue = queue.Queue(maxsize=4)
        self.write_q: queue.Queue = queue.Queue(maxsize=cfg.queue_units)

    # -- threads ---------------------------------------------------------------------------
    def _guard(self, fn):
        def run():
            try:
                fn()
            except BaseException as e:  # surfaced in the main loop
                self.error = e
                # keep draining so that the producer never blocks forever
                for q in (self.collect_q, self.write_q):
                    try:
                        while True:
                            q.get_nowait()
                    except queue.Empty:
                        pass
        return run

    def _collector(self):
        while (item := self.collect_q.get()) is not _STOP:
            event, tensors, placements = item
            if event is not None:
                event.synchronize()
            hidden, scale, idx, logp, lse, ok = (None if t is None else _host(t) for t in tensors)
            shape = self.layout.arrays()["features/hidden"][0]
            if hidden.shape[1:] != shape:  # numpy would broadcast a wrong layer count silently
                raise RuntimeError(f"features of shape {hidden.shape[1:]} for a store of {shape}")
            pos = 0
            for buf, sample, local, n, meta in placements:
                a = buf.arrays
                if ok[meta["b"]]:
                    a["features/hidden"][local:local + n] = hidden[pos:pos + n]
                    if scale is not None:
                        a["features/scale"][local:local + n] = scale[pos:pos + n]
                    a["logits/topk_idx"][local:local + n] = idx[pos:pos + n]
                    a["logits/topk_logp"][local:local + n] = logp[pos:pos + n]
                    a["logits/lse"][local:local + n] = lse[pos:pos + n]
                else:
                    buf.dropped.append({"sample": sample, **meta["src"]})
                pos += n
                buf.remaining -= 1
                if buf.remaining == 0:
                    self.write_q.put(buf)
        for _ in range(self.cfg.writers):
            self.write_q.put(_STOP)

    def _writer(self):
        while (buf := self.write_q.get()) is not _STOP:
            info = {"samples": buf.samples, "tokens": buf.tokens, "dropped": buf.dropped,
                    "rank": self.rank, "seconds": round(time.time() - buf.started, 3)}
            st.write_unit(self.root, self.cfg.store, buf.unit, buf.arrays, info)
            if self.progress_q is not None:
                self.progress_q.put(("unit", buf.unit, buf.samples - len(buf.dropped), buf.tokens))

    # -- main loop -------------------------------------------------------------------------
    def run(self, units: list[int]):
        cfg = self.cfg
        offsets = self.root["index/offset"][:]
        lengths = self.root["index/length"][:]
        rows, files = self.root["index/row"][:], self.root["index/file"][:]
        S = self.layout.shard_tokens
        unit_of = offsets // S
        dtype = {"auto": torch.bfloat16 if self.device.type == "cuda" else torch.float32,
                 "bf16": torch.bfloat16, "fp32": torch.float32}[cfg.dtype]
        model = self.model if self.model is not None else load_target(cfg.target, self.device, dtype)
        ids_arr = self.root["tokens/input_ids"]

        threads = [threading.Thread(target=self._guard(self._collector), daemon=True)]
        threads += [threading.Thread(target=self._guard(self._writer), daemon=True) for _ in range(cfg.writers)]
        for t in threads:
            t.start()
        cuda = self.device.type == "cuda"
        try:
            for u in units:
                members = np.nonzero(unit_of == u)[0]
                buf = new_unit_buffer(self.layout, u, len(members), int(lengths[members].sum()))
                if len(members) == 0:
                    self.write_q.put(buf)
                    continue
                unit_ids = ids_arr[u * S:(u + 1) * S]
                items = [(int(i), int(offsets[i]) - u * S, int(lengths[i])) for i in members]
                for batch in plan_batches(items, cfg.batch_tokens, cfg.max_batch):
                    if self.error:
                        raise self.error
                    seqs = [torch.from_numpy(unit_ids[lo:lo + n].astype(np.int64)) for _, lo, n in batch]
                    ids, att = pad_batch(seqs, self.pad_id)
                    ns = [n for _, _, n in batch]
                    hidden, idx, logp, lse, ok = forward_features(
                        model, ids.to(self.device, non_blocking=True), att.to(self.device, non_blocking=True),
                        ns, self.layer_ids, self.layout.topk, cfg.logit_chunk)
                    if self.layout.precision == "bf16":
                        hidden, scale = hidden.to(torch.bfloat16).view(torch.int16), None
                    else:
                        hidden, scale = st.fp8_encode(hidden)
                    dev = [hidden, scale, idx.to(torch.int32), logp.to(torch.float16), lse.float(), ok]
                    host = [None if t is None else
                            (torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                             if cuda else t) for t in dev]
                    event = None
                    if cuda:
                        event = torch.cuda.Event()
                        event.record()
                    placements = [(buf, s, lo, n, {"b": b, "src": {"file": int(files[s]), "row": int(rows[s])}})
                                  for b, (s, lo, n) in enumerate(batch)]
                    self.collect_q.put((event, host, placements))
                    if self.progress_q is not None:
                        self.progress_q.put(("batch", 0, len(batch), sum(ns)))
        finally:
            self.collect_q.put(_STOP)
            for t in threads:
                t.join()
        if self.error:
            raise self.error


def _host(t: torch.Tensor) -> np.ndarray:
    """numpy view in the storage dtype (bf16 bits travel as int16, are stored as uint16)."""
    a = t.numpy()
    return a.view(np.uint16) if a.dtype == np.int16 else a


def worker_main(cfg: ExtractConfig, rank: int, world: int, device: str, units: list[int], progress_q, threads: int):
    """Entry point of a spawned worker process."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    else:
        torch.set_num_threads(max(1, threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    Worker(cfg, rank, world, torch.device(device), progress_q).run(units)
