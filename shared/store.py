"""The feature store: creation, unit writes, reads. The only module that opens zarr arrays.

The arrays and the manifest are described in shared/schema.py, the codecs in
shared/compression.py.

STORE is a folder or an object-storage URL (shared/location.py); the rules below use only what
both have: whole-object writes, create-if-absent and compare-and-swap.

Units. The token axis is cut into units of `shard_tokens` tokens; every array's shard boundary
is a unit boundary, and the planner never lets a sample straddle two units. A unit is written
by the one process holding its claim, in one call per array (whole shards: two writers never
touch one shard, docs/DESIGN.md, "Measured toolchain facts"), then its marker is created. A unit
without a marker is rewritten from scratch on resume, so nothing half-written can look complete.

The manifest. zarr.json's attributes are written whole, in one atomic write: while planning they
hold only "dflash_planning"; the manifest ("dflash") replaces them once the tokens and the index
are written, so a store with a manifest always has its whole plan.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import zarr
from zarr.codecs import ZstdCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.group import GroupMetadata

from shared.compression import ShardEncoder, ThreadedCrc32cCodec, codec_chain, crc
from shared.location import as_location
from shared.schema import (FORMAT_VERSION, INDEX_ARRAYS, Layout, Manifest, StoreError, bits_to_bf16,
                           fp8_decode)
from shared.shards import ShardReader

PLANNING = "dflash_planning"   # zarr.json attribute of a store whose plan is being written
CLAIMS, PROGRESS = "_claims", "_progress"


def write_attributes(where, attributes: dict):
    """The store's zarr.json, with these attributes, in one atomic write (see the module doc)."""
    meta = GroupMetadata(attributes=attributes, zarr_format=3)
    as_location(where).write("zarr.json", meta.to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes())


def store_state(where) -> tuple[str, dict | None]:
    """("absent" | "planning" | "foreign" | "store", the attributes): what a location holds.
    "absent" allows nothing but claims; "planning" is a plan being (or left half) written."""
    loc = as_location(where)
    raw = loc.read("zarr.json")
    if raw is None:
        return ("foreign" if loc.names() - {CLAIMS} else "absent"), None
    try:
        attrs = json.loads(raw).get("attributes") or {}
    except (json.JSONDecodeError, AttributeError):
        return "foreign", None
    if "dflash" in attrs:
        return "store", attrs
    return ("planning" if PLANNING in attrs else "foreign"), attrs


def create(where, manifest: Manifest, planning: dict | None = None) -> "StoreWriter":
    """Create an empty store with every array sized for `manifest.layout`; the manifest is
    published by StoreWriter.publish once the plan is written. Anything but claims already at
    the location is deleted first (the caller checked it is a store's leftover)."""
    loc = as_location(where)
    loc.prepare()
    loc.delete_all(keep=(CLAIMS,))
    layout = manifest.layout
    root = zarr.create_group(store=loc.zarr_store(), zarr_format=3, attributes={PLANNING: planning or {}})
    S = layout.shard_tokens
    for name, (shape, dtype) in layout.arrays().items():
        itemsize = np.dtype(dtype).itemsize
        # Big feature chunks keep compression efficient; small per-token arrays get longer chunks.
        chunk = layout.chunk_tokens if name == "features/hidden" else min(S, max(layout.chunk_tokens, 4096))
        filters, compressors = codec_chain(layout.codec if name == "features/hidden" else "zstd1", itemsize,
                                           int(np.prod(shape, dtype=np.int64)))
        root.create_array(name, shape=(layout.capacity, *shape), dtype=dtype,
                          chunks=(chunk, *shape), shards=(S, *shape), filters=filters,
                          compressors=compressors, fill_value=0,
                          config={"write_empty_chunks": False})
    n = max(layout.n_samples, 1)
    for name, dtype in INDEX_ARRAYS.items():
        root.create_array(name, shape=(layout.n_samples,), dtype=dtype, chunks=(min(n, 1 << 16),),
                          shards=(min(n, 1 << 22),) if n > (1 << 16) else None,
                          compressors=(ZstdCodec(level=3), ThreadedCrc32cCodec()), fill_value=0)
    manifest.format_version, manifest.complete = FORMAT_VERSION, False
    return StoreWriter(loc, root, manifest)


def read_manifest(where) -> Manifest | None:
    """The manifest of the store at `where`; None if it holds no feature store (yet)."""
    state, attrs = store_state(where)
    return Manifest.from_dict(attrs["dflash"], str(where)) if state == "store" else None


class StoreWriter:
    """Every write to a store goes through here: the planner's tokens and index, the workers'
    units (whole shards, then the marker), the finalizer's flags and manifest."""

    def __init__(self, where, root: zarr.Group | None = None, manifest: Manifest | None = None,
                 encode_threads: int = 0):
        """encode_threads: the threads a unit's chunks are compressed on; 0: min(8, the cores)."""
        self.loc = as_location(where)
        self.encode_threads = encode_threads or min(8, os.cpu_count() or 1)
        self.path = self.loc.url
        self.root = root if root is not None else zarr.open_group(store=self.loc.zarr_store(), mode="r+")
        if manifest is None:
            manifest = read_manifest(self.loc)
            if manifest is None:
                raise StoreError(f"{self.loc}: not a feature store")
        self.manifest = manifest
        self.layout: Layout = self.manifest.layout
        self._features: dict[str, zarr.Array] = {}
        self._encoders: dict[str, ShardEncoder | None] = {}
        self._pool: ThreadPoolExecutor | None = None

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The threads a unit's chunks are compressed on (the codecs release the GIL)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.encode_threads, thread_name_prefix="shard")
        return self._pool

    def shard_encoder(self, name: str) -> "ShardEncoder | None":
        if name not in self._encoders:
            self._encoders[name] = ShardEncoder.for_array(self.feature_array(name))
        return self._encoders[name]

    def write_shard(self, name: str, unit: int, data: np.ndarray):
        """One unit's whole shard of a feature array: encoded here where the encoder knows the
        array's codecs, else through zarr (write_empty_chunks: every chunk written)."""
        enc = self.shard_encoder(name)
        if enc is None:
            S = self.layout.shard_tokens
            self.feature_array(name)[unit * S:(unit + 1) * S] = data
            return
        key = self.feature_array(name).metadata.encode_chunk_key((unit,) + (0,) * (data.ndim - 1))
        self.loc.write(f"{name}/{key}", enc.encode(data, self.pool))

    def feature_array(self, name: str) -> zarr.Array:
        """A feature array opened once, writing every chunk of a whole-shard write: zarr's
        default scans each chunk for all-zeros first, a full extra pass that cost ~40% of the
        write rate (bench/host_bench.py); a unit's zero tail compresses to almost nothing."""
        if name not in self._features:
            self._features[name] = self.root[name].with_config({"write_empty_chunks": True})
        return self._features[name]

    def write_tokens(self, unit: int, ids: np.ndarray, mask: np.ndarray):
        """One unit's token ids and loss mask: one whole shard per array."""
        sl = slice(unit * self.layout.shard_tokens, (unit + 1) * self.layout.shard_tokens)
        self.root["tokens/input_ids"][sl] = ids
        self.root["tokens/loss_mask"][sl] = mask

    def write_index(self, offsets, lengths, rows, files):
        self.root["index/offset"][:] = np.asarray(offsets, dtype=np.int64)
        self.root["index/length"][:] = np.asarray(lengths, dtype=np.int32)
        self.root["index/row"][:] = np.asarray(rows, dtype=np.int64)
        self.root["index/file"][:] = np.asarray(files, dtype=np.int32)
        self.root["index/ok"][:] = np.ones(len(offsets), dtype=np.uint8)

    def publish(self):
        """Attach the manifest: from here on the location is a (not yet complete) store."""
        write_attributes(self.loc, {"dflash": self.manifest.to_dict()})

    def mark_dropped(self, samples: list[int]):
        ok = self.root["index/ok"][:]
        ok[np.asarray(samples, dtype=np.int64)] = 0
        self.root["index/ok"][:] = ok

    def finish(self, summary: dict, completed_at: str):
        self.manifest.complete, self.manifest.summary, self.manifest.completed_at = True, summary, completed_at
        self.publish()


# --- units ----------------------------------------------------------------------------------

def unit_name(unit: int) -> str:
    """How a unit is named by its marker and its claim."""
    return f"unit-{unit:07d}"


def marker_key(unit: int) -> str:
    return f"{PROGRESS}/{unit_name(unit)}.json"


def done_unit_ids(where) -> set[int]:
    """Units with a marker (one listing, no reads)."""
    return {int(k.rsplit("-", 1)[1].split(".")[0]) for k in as_location(where).list(PROGRESS + "/")
            if k.endswith(".json")}


def done_units(where) -> dict[int, dict]:
    """Every finished unit's marker (in parallel: one request each on object storage)."""
    loc = as_location(where)
    ids = sorted(done_unit_ids(loc))
    with ThreadPoolExecutor(1 if loc.local else 32) as ex:
        raws = list(ex.map(lambda u: loc.read(marker_key(u)), ids))
    return {u: json.loads(r) for u, r in zip(ids, raws) if r is not None}


def write_unit(w: StoreWriter, unit: int, arrays: dict[str, np.ndarray], info: dict, held=None) -> bool:
    """Write one unit's feature arrays (full shards), then create its marker. held(): whether
    this process still holds the unit's claim, asked before each shard and before the marker; a
    unit whose claim was lost is left to its new holder. False if the unit was not marked here."""
    if not 0 <= unit < w.layout.n_units:  # zarr would write nothing past the end, and say nothing
        raise StoreError(f"{w.loc.url}: no unit {unit} (the store has {w.layout.n_units})")
    checks = {}
    for name, data in arrays.items():
        assert data.shape[0] == w.layout.shard_tokens, (name, data.shape)
        if held is not None and not held():
            return False
        whole = w.pool.submit(crc, data)  # beside the shard's compression
        w.write_shard(name, unit, data)
        checks[name] = whole.result()
    if held is not None and not held():
        return False
    info = {**info, "unit": unit, "crc32": checks}
    # the marker appears only after every shard of the unit is written, and only once
    return w.loc.create(marker_key(unit), json.dumps(info).encode()) is not None


def forget_units(where, units: list[int]):
    """The repair of damaged units: their markers deleted and the manifest marked incomplete, so
    that rerunning the store's extraction resumes and rewrites exactly these units (their shards
    are replaced whole). Training refuses the store until then."""
    loc = as_location(where)
    w = StoreWriter(loc)
    for u in units:
        loc.delete(marker_key(u))
    w.manifest.complete, w.manifest.completed_at = False, None
    w.publish()


# --- reading --------------------------------------------------------------------------------

@dataclass
class Sample:
    input_ids: torch.Tensor      # (S,) int64
    loss_mask: torch.Tensor      # (S,) bool
    hidden: torch.Tensor         # (S, L, H) bf16, layers as selected
    topk_idx: torch.Tensor       # (S, K) int64
    topk_logp: torch.Tensor      # (S, K) float32
    lse: torch.Tensor            # (S,) float32
    scale: torch.Tensor | None = None  # (S, L) fp8 scales when read with decode=False


class Store:
    """Read-only view of a store. Opening costs the same for any number of samples: only the
    manifest is read; the index is read a chunk at a time as samples are asked for."""

    def __init__(self, where, require_complete: bool = True, decode_threads: int = 1):
        """decode_threads: threads that decode the chunks of one read (the loader gives each worker
        its share of the cores: train/loader.py)."""
        self.loc = as_location(where)
        self.path = self.loc.url
        state, attrs = store_state(self.loc)
        if state == "planning":
            raise StoreError(f"{self.path}: extraction is still planning (or its planning was interrupted): "
                             f"rerun the same extract command to finish it")
        if state != "store":
            what = "a zarr group but not a feature store (no 'dflash' manifest)" if attrs is not None else \
                "not a feature store (no zarr.json)"
            raise StoreError(f"{self.path}: {what}")
        self.root = zarr.open_group(store=self.loc.zarr_store(read_only=True), mode="r")
        self.manifest = Manifest.from_dict(attrs["dflash"], str(self.path))
        self.layout: Layout = self.manifest.layout
        if require_complete and not self.manifest.complete:
            n_done = len(done_unit_ids(self.loc))
            raise StoreError(f"{self.path}: extraction is not complete ({n_done} of {self.layout.n_units} units "
                             f"written); rerun the same extract command to finish it")
        self.layer_ids: list[int] = list(self.manifest.layer_ids)
        self._arr = {}
        self._readers: dict[str, ShardReader | None] = {}
        self.decode_threads = max(1, int(decode_threads))
        self._pool: tuple[int, ThreadPoolExecutor] | None = None  # (the process that made it, the pool)
        self._index_cache: dict[tuple[str, int], np.ndarray] = {}

    def __len__(self) -> int:
        return self.layout.n_samples

    def array(self, name: str):
        if name not in self._arr:
            self._arr[name] = self.root[name]
        return self._arr[name]

    def rows(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Token rows lo:hi of a token-axis array, read straight from its shards where the shard
        reader knows the array (shared/shards.py: a third of zarr's time per sample), else
        through zarr."""
        if name not in self._readers:
            self._readers[name] = ShardReader.for_array(self.loc, name, self.array(name))
        r = self._readers[name]
        return r.read(lo, hi, self._decode_pool()) if r is not None else self.array(name)[lo:hi]

    def _decode_pool(self) -> ThreadPoolExecutor | None:
        if self.decode_threads == 1:
            return None
        if self._pool is None or self._pool[0] != os.getpid():  # a fork keeps the object, not its threads
            self._pool = (os.getpid(), ThreadPoolExecutor(self.decode_threads, thread_name_prefix="decode"))
        return self._pool[1]

    def _index(self, name: str, i: int) -> int:
        arr = self.array(name)
        c = arr.chunks[0]
        key = (name, i // c)
        block = self._index_cache.get(key)
        if block is None:
            if len(self._index_cache) > 256:
                self._index_cache.clear()
            block = self._index_cache[key] = arr[(i // c) * c:(i // c + 1) * c]
        return int(block[i % c])

    def span(self, i: int) -> tuple[int, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range (store has {len(self)})")
        off = self._index("index/offset", i)
        return off, off + self._index("index/length", i)

    def unit_of(self, i: int) -> int:
        return self._index("index/offset", i) // self.layout.shard_tokens

    def describe_sample(self, i: int, with_store: bool = True) -> str:
        """"STORE: unit U, sample I (file F row R)": what an error about one sample names."""
        try:
            files = self.manifest.data.files
            src = f" ({files[self._index('index/file', i)]['path']} row {self._index('index/row', i)})"
            unit = f"unit {self.unit_of(i)}, "
        except Exception:  # the index itself is damaged: name what is known
            src, unit = "", ""
        return (f"{self.path}: " if with_store else "") + f"{unit}sample {i}{src}"

    def layer_positions(self, layer_ids: list[int] | None) -> list[int]:
        if layer_ids is None:
            return list(range(len(self.layer_ids)))
        missing = [l for l in layer_ids if l not in self.layer_ids]
        if missing:
            raise StoreError(f"{self.path}: layers {missing} are not in the store; it holds "
                             f"layers {self.layer_ids} (asked for {list(layer_ids)})")
        return [self.layer_ids.index(l) for l in layer_ids]

    def tokens(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.span(i)
        return self.array("tokens/input_ids")[lo:hi], self.array("tokens/loss_mask")[lo:hi]

    def read(self, i: int, layer_ids: list[int] | None = None, features: bool = True,
             decode: bool = True, logprobs: bool = True) -> Sample:
        """One sample. Hidden states come back as bf16 whatever the store's precision; with
        decode=False an fp8 store returns its e4m3 bits (uint8) and Sample.scale instead, so the
        conversion can run on the GPU (train.step.draft) rather than in a CPU loader worker.
        logprobs=False leaves topk_logp and lse empty: two array reads fewer for a trainer that
        does not distill (through zarr, each read cost ~3 ms and this gave 1.19x the rows per
        second; every array is now read straight from its shards, see rows())."""
        lo, hi = self.span(i)
        pos = self.layer_positions(layer_ids)
        ids, mask = self.rows("tokens/input_ids", lo, hi), self.rows("tokens/loss_mask", lo, hi)
        hidden = torch.empty(0)
        if features:
            full = len(pos) == self.layout.n_layers and pos == sorted(pos)
            raw = self.rows("features/hidden", lo, hi)  # whole chunks are decoded either way
            raw = raw if full else np.ascontiguousarray(raw[:, pos])
            if self.layout.precision == "bf16":
                hidden = bits_to_bf16(raw)
            else:
                scale = torch.from_numpy(self.rows("features/scale", lo, hi)[:, pos])
                hidden = fp8_decode(torch.from_numpy(raw), scale) if decode else torch.from_numpy(raw)
        sample = Sample(
            input_ids=torch.from_numpy(ids.astype(np.int64)),
            loss_mask=torch.from_numpy(mask.astype(bool)),
            hidden=hidden,
            topk_idx=torch.from_numpy(self.rows("logits/topk_idx", lo, hi).astype(np.int64)),
            topk_logp=torch.from_numpy(self.rows("logits/topk_logp", lo, hi).astype(np.float32)) if logprobs
            else torch.empty(0),
            lse=torch.from_numpy(self.rows("logits/lse", lo, hi)) if logprobs else torch.empty(0),
        )
        if features and not decode and self.layout.precision == "fp8":
            sample.scale = scale
        return sample

    def lengths(self) -> np.ndarray:
        """All sample lengths: O(N) and read on demand only (the loader packs by them)."""
        return self.array("index/length")[:]

    def index(self) -> dict[str, np.ndarray]:
        """The whole index (offset, length, row, file, ok per sample): O(N), for the planner's
        workers and verify, never for opening a store."""
        return {name.split("/")[1]: self.array(name)[:] for name in INDEX_ARRAYS}

    def sources(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(file, row) of samples lo..hi-1: the samples one chat row was split into are adjacent."""
        return self.array("index/file")[lo:hi], self.array("index/row")[lo:hi]

    def unit_tokens(self, unit: int) -> np.ndarray:
        return self.unit_array("tokens/input_ids", unit)

    def unit_array(self, name: str, unit: int) -> np.ndarray:
        """One unit of a token-axis array, as stored (verify's checksums)."""
        S = self.layout.shard_tokens
        return self.rows(name, unit * S, (unit + 1) * S)

    def hidden_bits(self, lo: int, hi: int) -> np.ndarray:
        """Stored hidden-state bits of token rows lo:hi, undecoded (codec benchmarks)."""
        return self.rows("features/hidden", lo, hi)

    def unit_hidden(self, unit: int) -> torch.Tensor | None:
        """One unit's hidden states as bf16 (bf16 stores; None for fp8)."""
        return bits_to_bf16(self.unit_array("features/hidden", unit)) if self.layout.precision == "bf16" else None

    def ok_mask(self) -> np.ndarray:
        return self.array("index/ok")[:].astype(bool)

    def disk_bytes(self) -> int:
        return disk_bytes(self.loc)


def disk_bytes(where) -> int:
    """Bytes a store takes on disk or on object storage, every file or object counted."""
    return as_location(where).size()
