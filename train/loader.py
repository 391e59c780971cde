"""Rows for training: samples from the store packed into fixed-length rows with document ids.

One static shape: every row is `seq_len` tokens, documents packed greedily in a per-epoch
shuffled order (the drafter reads cached features, so packing is exact for it: the mask keeps
documents apart). Each rank gets a disjoint, equal share of the rows. Anchors are drawn per
row from a generator seeded by (seed, epoch, row), so the data a step sees depends only on
(seed, epoch, step): resuming mid-epoch reproduces an uninterrupted run exactly, whatever the
number of loader workers.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from shared.store import Store
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
        ok = store.array("index/ok")[:].astype(bool)
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


class RowDataset(Dataset):
    def __init__(self, store_path: str, rows: list[tuple[int, list[int]]], layer_ids: list[int], seq_len: int,
                 max_anchors: int, seed: int, epoch: int, distill: bool, first_row: int = 0):
        self.store_path, self.rows, self.layer_ids = store_path, rows, layer_ids
        self.seq_len, self.max_anchors, self.seed, self.epoch = seq_len, max_anchors, seed, epoch
        self.distill, self.first_row = distill, first_row
        self._store = None

    def __len__(self):
        return len(self.rows) - self.first_row

    @property
    def store(self) -> Store:
        if self._store is None:  # opened in each loader worker, not pickled across
            self._store = Store(self.store_path)
        return self._store

    def __getitem__(self, j: int) -> dict:
        row, samples = self.rows[self.first_row + j]
        s, S = self.store, self.seq_len
        L, H = len(self.layer_ids), s.layout.hidden
        K = s.layout.topk
        fp8 = s.layout.precision == "fp8"
        out = {
            # fp8 stores travel as e4m3 bits + scales (half the bytes); train.step.draft decodes
            # them on the device
            "hidden": torch.zeros(S, L * H, dtype=torch.uint8 if fp8 else torch.bfloat16),
            "input_ids": torch.zeros(S, dtype=torch.long),
            "loss_mask": torch.zeros(S, dtype=torch.bool),
            "doc": torch.full((S,), -1, dtype=torch.long),
            "argmax": torch.zeros(S, dtype=torch.long),
        }
        if fp8:
            out["hidden_scale"] = torch.zeros(S, L, dtype=torch.float32)
        if self.distill:
            out["topk_idx"] = torch.zeros(S, K, dtype=torch.long)
            out["topk_logp"] = torch.full((S, K), -1e4, dtype=torch.float32)
        pos = 0
        for d, i in enumerate(samples):
            x = s.read(i, self.layer_ids, decode=False)
            n = min(len(x.input_ids), S - pos)
            sl = slice(pos, pos + n)
            out["hidden"][sl] = x.hidden[:n].reshape(n, L * H)
            if fp8:
                out["hidden_scale"][sl] = x.scale[:n]
            out["input_ids"][sl] = x.input_ids[:n]
            out["loss_mask"][sl] = x.loss_mask[:n]
            out["doc"][sl] = d
            out["argmax"][sl] = x.topk_idx[:n, 0]
            if self.distill:
                out["topk_idx"][sl] = x.topk_idx[:n]
                out["topk_logp"][sl] = x.topk_logp[:n]
            pos += n
        g = torch.Generator().manual_seed(int(np.random.SeedSequence([self.seed, self.epoch + 1, row]).generate_state(1)[0]))
        out["anchors"], out["anchor_valid"] = sample_anchors(out["loss_mask"], out["doc"], self.max_anchors, g)
        return out


def make_loader(ds: RowDataset, micro_batch: int, workers: int, prefetch: int, pin: bool) -> DataLoader:
    kw = dict(num_workers=workers, pin_memory=pin)
    if workers > 0:
        kw.update(prefetch_factor=prefetch, persistent_workers=False)
    return DataLoader(ds, batch_size=micro_batch, shuffle=False, drop_last=True, **kw)
