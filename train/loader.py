"""Rows for training: samples from the store packed into fixed-length rows with document ids.

One static shape: every row is `seq_len` tokens, documents packed greedily in a per-epoch
shuffled order (the drafter reads cached features, so packing is exact for it: the mask keeps
documents apart). Each rank gets a disjoint, equal share of the rows. Anchors are drawn per
row from a generator seeded by (seed, epoch, row), so the data a step sees depends only on
(seed, epoch, step): resuming mid-epoch reproduces an uninterrupted run exactly, whatever the
number of loader workers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from shared.location import is_url
from shared.store import Store, StoreError
from train.mask import sample_anchors


def pack_rows(lengths: np.ndarray, order: np.ndarray, seq_len: int) -> list[list[int]]:
    """Greedy packing of samples (in `order`) into rows of at most seq_len tokens."""
    rows, cur, used = [], [], 0
    for i in order:
        n = min(int(lengths[i]), seq_len)
        if cur and used + n > seq_len:
            rows.append(cur)
            cur, used = [], 0
        cur.append(int(i))
        used += n
    if cur:
        rows.append(cur)
    return rows


class EpochPlan:
    """Which samples each rank's rows hold in a given epoch."""

    def __init__(self, store: Store, seq_len: int, seed: int, rank: int, world: int, exclude=()):
        self.lengths = store.lengths()  # O(N) small read; opening the store itself reads nothing
        ok = store.ok_mask()
        self.samples = np.setdiff1d(np.nonzero(ok)[0], np.asarray(sorted(exclude), dtype=np.int64))
        self.seq_len, self.seed, self.rank, self.world = seq_len, seed, rank, world

    def rows(self, epoch: int) -> list[tuple[int, list[int]]]:
        """(global row id, samples) for this rank's rows; the id seeds the row's anchors."""
        rng = np.random.default_rng([self.seed, epoch])
        order = self.samples[rng.permutation(len(self.samples))]
        rows = pack_rows(self.lengths, order, self.seq_len)
        per_rank = len(rows) // self.world   # equal step counts on every rank (DDP)
        if per_rank == 0:
            raise ValueError(f"{len(rows)} packed rows of {self.seq_len} tokens cannot feed {self.world} ranks; "
                             f"lower --seq-len or use fewer GPUs")
        # Interleaved shares: global step k of N ranks sees the same rows as one rank with N-fold
        # gradient accumulation, so results do not depend on the GPU count (tested).
        return list(enumerate(rows))[:per_rank * self.world][self.rank::self.world]


class StepSchedule:
    """Steps per epoch, for epochs of any length. Greedy packing of a fresh shuffle gives a
    slightly different row count every epoch, so each epoch's step count is computed from its own
    packing (the same on every rank) and the schedule's total is known before step 1."""

    def __init__(self, plan: EpochPlan, rows_per_step: int):
        self.plan, self.rows_per_step = plan, rows_per_step
        self._steps: dict[int, int] = {}

    def steps(self, epoch: int) -> int:
        if epoch not in self._steps:
            self._steps[epoch] = len(self.plan.rows(epoch)) // self.rows_per_step
        return self._steps[epoch]

    def total(self, epochs: int) -> int:
        return sum(self.steps(e) for e in range(epochs))

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, step within that epoch) of global step `step` (0-based)."""
        epoch = 0
        while step >= self.steps(epoch):
            if self.steps(epoch) == 0:
                raise ValueError(f"epoch {epoch} has fewer rows than one step needs ({self.rows_per_step})")
            step -= self.steps(epoch)
            epoch += 1
        return epoch, step


@dataclass(frozen=True)
class RowSpec:
    """What one packed row holds: the same for every row of a run."""
    layer_ids: tuple[int, ...]
    seq_len: int
    max_anchors: int
    seed: int
    distill: bool = False


class RowDataset(Dataset):
    """Rows `rows[first_row:]` of one epoch. `epoch=None` is the held-out set: its anchors are
    drawn from their own stream, fixed for the whole run."""

    def __init__(self, store_path: str, rows: list[tuple[int, list[int]]], spec: RowSpec,
                 epoch: int | None, first_row: int = 0):
        self.store_path, self.rows, self.spec = store_path, rows, spec
        self.epoch, self.first_row = epoch, first_row
        self.decode_threads = 1  # per reading process; make_loader gives it the worker's share of the cores
        self._store = None
        self._pool = None

    def __len__(self):
        return len(self.rows) - self.first_row

    def __getstate__(self):  # loader workers open their own store
        return {**self.__dict__, "_store": None, "_pool": None}

    def _read_row(self, samples: list[int]) -> list:
        """A row's samples. On object storage they are read concurrently: each read is a few
        requests whose latency, not bandwidth, bounds one reader (21 vs 12 ms per tiny sample
        with 8 threads against a local S3 server; a local disk gains nothing)."""
        if not is_url(self.store_path) or len(samples) == 1:
            return [self._read(i) for i in samples]
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(8, thread_name_prefix="row-read")
        return list(self._pool.map(self._read, samples))

    @property
    def store(self) -> Store:
        if self._store is None:  # opened in each loader worker, not pickled across
            self._store = Store(self.store_path, decode_threads=self.decode_threads)
        return self._store

    def _read(self, i: int):
        try:
            return self.store.read(i, list(self.spec.layer_ids), decode=False, logprobs=self.spec.distill)
        except StoreError:
            raise
        except Exception as e:  # a checksum mismatch, a truncated shard: name what was being read
            raise StoreError(f"{self.store.describe_sample(i)} could not be read: {type(e).__name__}: {e}. "
                             f"Run `python -m extract.inspect {self.store_path} --verify` for every damaged "
                             f"unit, then re-extract them") from None

    def __getitem__(self, j: int) -> dict:
        row, samples = self.rows[self.first_row + j]
        sp, s = self.spec, self.store
        S, L, H, K = sp.seq_len, len(sp.layer_ids), s.layout.hidden, s.layout.topk
        fp8 = s.layout.precision == "fp8"
        out = {
            # fp8 stores travel as e4m3 bits + scales (half the bytes); train.step.draft decodes
            # them on the device
            "hidden": torch.zeros(S, L * H, dtype=torch.uint8 if fp8 else torch.bfloat16),
            "input_ids": torch.zeros(S, dtype=torch.long),
            "loss_mask": torch.zeros(S, dtype=torch.bool),
            "doc": torch.full((S,), -1, dtype=torch.long),
            "argmax": torch.zeros(S, dtype=torch.long),
            "row": torch.tensor(row, dtype=torch.long),  # names the samples when a step goes wrong
        }
        if fp8:
            out["hidden_scale"] = torch.zeros(S, L, dtype=torch.float32)
        if sp.distill:
            out["topk_idx"] = torch.zeros(S, K, dtype=torch.long)
            out["topk_logp"] = torch.full((S, K), -1e4, dtype=torch.float32)
        pos = 0
        for d, x in enumerate(self._read_row(samples)):
            n = min(len(x.input_ids), S - pos)
            sl = slice(pos, pos + n)
            out["hidden"][sl] = x.hidden[:n].reshape(n, L * H)
            if fp8:
                out["hidden_scale"][sl] = x.scale[:n]
            out["input_ids"][sl] = x.input_ids[:n]
            out["loss_mask"][sl] = x.loss_mask[:n]
            out["doc"][sl] = d
            out["argmax"][sl] = x.topk_idx[:n, 0]
            if sp.distill:
                out["topk_idx"][sl] = x.topk_idx[:n]
                out["topk_logp"][sl] = x.topk_logp[:n]
            pos += n
        stream = 0 if self.epoch is None else self.epoch + 1
        g = torch.Generator().manual_seed(int(np.random.SeedSequence([sp.seed, stream, row]).generate_state(1)[0]))
        out["anchors"], out["anchor_valid"] = sample_anchors(out["loss_mask"], out["doc"], sp.max_anchors, g)
        return out


def decode_threads(workers: int) -> int:
    """Threads each reading process decodes a sample's chunks on: this rank's share of the cores
    (LOCAL_WORLD_SIZE ranks on the host, as torchrun sets it) over its readers, at most 8. A
    worker alone on a 16-core host read the 27B drafter's chunks at 0.85x zarr's threaded read on
    one thread (BENCHMARKS.md, "Ninth session")."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    per_rank = cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(8, per_rank // max(1, workers)))


def make_loader(ds: RowDataset, micro_batch: int, workers: int, prefetch: int, pin: bool) -> DataLoader:
    ds.decode_threads = decode_threads(workers)  # before the workers take their copy of ds
    kw = dict(num_workers=workers, pin_memory=pin)
    if workers > 0:
        kw.update(prefetch_factor=prefetch, persistent_workers=False)
        if is_url(ds.store_path):
            # the object-storage client runs a thread pool (tokio) that a fork() copies in a
            # locked state: workers forked from this process hang on their first read
            kw["multiprocessing_context"] = "forkserver"
    return DataLoader(ds, batch_size=micro_batch, shuffle=False, drop_last=True, **kw)
