"""Planning: tokenize DATA, cut the token axis into units, and create the store with its tokens
and index; the manifest is attached last, in one atomic write (a crash while planning leaves
nothing that looks like a store: shared/store.py)."""

from __future__ import annotations

import numpy as np

from extract.config import ExtractConfig
from shared import schema as sc
from shared import store as st
from shared.data import Encoded, encode_all
from shared.progress import log


def assign_units(lengths: list[int], shard_tokens: int, order: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """Token offsets that pack samples, in `order` (default: sample order), into units of
    shard_tokens without a sample straddling two units. Returns (offsets per sample, number of
    units)."""
    offsets = np.zeros(len(lengths), dtype=np.int64)
    unit, used = 0, 0
    for i in (range(len(lengths)) if order is None else order):
        n = lengths[i]
        if used + n > shard_tokens:
            unit, used = unit + 1, 0
        offsets[i] = unit * shard_tokens + used
        used += n
    return offsets, unit + 1


def by_length(lengths: list[int]) -> np.ndarray:
    """Longest first (ties in sample order): units of similar lengths, so a unit's forwards pad
    little. In sample order, one long chat pads every short one batched with it (a log-normal
    chat mix computed 76% more tokens than it has; longest first, 1%: docs/DESIGN.md, "Extraction
    speed")."""
    return np.lexsort((np.arange(len(lengths)), -np.asarray(lengths, dtype=np.int64)))


def plan(cfg: ExtractConfig, manifest: sc.Manifest, tokenizer, n_layers: int, hidden: int, planner: dict | None = None):
    """Tokenize DATA and create the store with its tokens and index."""
    _, encoded, report = encode_all(cfg.data, tokenizer, cfg.max_len, cfg.too_long, cfg.progress,
                                    cfg.chat_template_kwargs, cfg.inexact_turns, cfg.strip_reasoning, cfg.max_rows)
    manifest.data.report = report.to_dict()
    write_plan(cfg, manifest, encoded, n_layers, hidden, planner)
    for reason, n in sorted(report.skipped.items()):
        log(f"skipped {n} row(s): {reason}; first: {report.examples[reason]}")


def write_plan(cfg: ExtractConfig, manifest: sc.Manifest, encoded: list[Encoded], n_layers: int, hidden: int,
               planner: dict | None = None):
    """planner: who is planning (recorded in the store while it plans)."""
    lengths = [len(e.input_ids) for e in encoded]
    offsets, n_units = assign_units(lengths, cfg.shard_tokens, by_length(lengths))
    manifest.layout = sc.Layout(n_layers=n_layers, hidden=hidden, topk=cfg.topk, precision=cfg.precision,
                                codec=cfg.codec, shard_tokens=cfg.shard_tokens, chunk_tokens=cfg.chunk_tokens,
                                n_units=n_units, n_samples=len(encoded))
    w = st.create(cfg.store, manifest, planning=planner)
    ids = np.zeros(cfg.shard_tokens, dtype=np.int32)
    mask = np.zeros(cfg.shard_tokens, dtype=np.uint8)
    in_offset_order = np.argsort(offsets, kind="stable")
    j = 0
    for u in range(n_units):  # one whole shard per write
        ids[:], mask[:] = 0, 0
        while j < len(encoded) and offsets[in_offset_order[j]] // cfg.shard_tokens == u:
            i = in_offset_order[j]
            lo = offsets[i] - u * cfg.shard_tokens
            ids[lo:lo + lengths[i]] = encoded[i].input_ids
            mask[lo:lo + lengths[i]] = encoded[i].loss_mask
            j += 1
        w.write_tokens(u, ids, mask)
    w.write_index(offsets, lengths, [e.row for e in encoded], [e.file for e in encoded])
    w.publish()
