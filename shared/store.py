"""The feature store: schema, creation, unit writes, reads. The only module that touches zarr.

Layout (one Zarr v3 group; token arrays are concatenated over samples, no padding stored):

    STORE/
      zarr.json                       group; attributes["dflash"] = the manifest
      tokens/input_ids   (T,)   int32
      tokens/loss_mask   (T,)   uint8
      features/hidden    (T, L, H) uint16 (bf16 bits) | uint8 (fp8 e4m3 bits)
      features/scale     (T, L) float32   fp8 only: per token and layer, hidden = fp8 * scale
      logits/topk_idx    (T, K) int32     target's top-K tokens, best first (argmax = [:, 0])
      logits/topk_logp   (T, K) float16   their log-probabilities (logit - lse)
      logits/lse         (T,)   float32   log-sum-exp over the full vocabulary (tail mass known)
      index/offset       (N,)   int64     sample -> first token
      index/length       (N,)   int32     sample -> token count
      index/row          (N,)   int64     sample -> source row (within its file)
      index/file         (N,)   int32     sample -> source file (names in the manifest)
      index/ok           (N,)   uint8     0 for samples dropped at extraction (NaN features)
      _progress/unit-XXXXXXX.json         one per finished unit, created whole and only once
      _claims/*.json                      who plans / computes a unit / finalizes, while a run is
                                          going (extract/claims.py); removed when the store is final

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

import asyncio
import json
import os
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import google_crc32c
import numpy as np
import torch
import zarr
import zarr.registry
from zarr.codecs import BloscCodec, BloscShuffle, Crc32cCodec, ZstdCodec
from zarr.codecs.numcodecs import LZ4, Shuffle
from zarr.core.buffer import default_buffer_prototype
from zarr.core.group import GroupMetadata

from shared.location import as_location

# 2: every chunk carries a crc32c of its compressed bytes, checked by zarr on every read.
FORMAT_VERSION = 2
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class StoreError(RuntimeError):
    """A store that is missing, incomplete, or does not match what is asked of it."""


# --- codecs -----------------------------------------------------------------------------

class ThreadedCrc32cCodec(Crc32cCodec):
    """zarr's crc32c codec (same name, same bytes on disk), run in zarr's codec threads like its
    compressors. zarr computes it inline on its one event-loop thread, which every write and read
    of the process goes through: writes stayed at 0.5-0.85 GB/s on a 16-core host for 1 to 16
    writer threads, 0.84-0.94 GB/s with this (separate runs; bench/host_bench.py, BENCHMARKS.md)."""

    async def _encode_single(self, chunk_bytes, chunk_spec):
        return await asyncio.to_thread(self._encode_sync, chunk_bytes, chunk_spec)

    async def _decode_single(self, chunk_bytes, chunk_spec):
        return await asyncio.to_thread(self._decode_sync, chunk_bytes, chunk_spec)


_CRC_KEY = f"{ThreadedCrc32cCodec.__module__}.{ThreadedCrc32cCodec.__qualname__}"
zarr.registry.register_codec("crc32c", ThreadedCrc32cCodec)
zarr.config.set({"codecs.crc32c": _CRC_KEY})  # the implementation zarr picks for "crc32c" chunks


def _codecs(name: str, itemsize: int):
    """(filters, compressors) for a codec name, with a crc32c of each compressed chunk last, so
    that flipped or truncated bytes are an error when read, never values that decode to garbage.
    Byte shuffle groups the exponent bytes of bf16 values together, which is where the redundancy
    is (docs/DESIGN.md, "Measured toolchain facts")."""
    filters, compressors = _compression(name, itemsize)
    return filters, (*compressors, ThreadedCrc32cCodec())


def _compression(name: str, itemsize: int):
    if name == "none":
        return (), ()
    if name == "zstd1":
        return (), (ZstdCodec(level=1),)
    if name == "shuffle-zstd3":
        # zarr's numcodecs Shuffle is a bytes-to-bytes codec: a compressor step, not a filter
        return (), (Shuffle(elementsize=itemsize), ZstdCodec(level=3))
    if name.startswith("blosc-"):  # blosc-zstd1, blosc-zstd3, blosc-lz4: SIMD shuffle inside blosc
        cname, level = name[len("blosc-"):-1], int(name[-1])
        return (), (BloscCodec(cname=cname, clevel=level, shuffle=BloscShuffle.shuffle, typesize=itemsize),)
    if name == "lz4":
        return (), (LZ4(),)
    raise ValueError(f"unknown codec {name!r}; choose one of {CODECS}")


CODECS = ("blosc-zstd1", "blosc-zstd3", "shuffle-zstd3", "zstd1", "blosc-lz41", "lz4", "none")


# --- schema -------------------------------------------------------------------------------

@dataclass
class Layout:
    n_layers: int
    hidden: int
    topk: int
    precision: str  # "bf16" | "fp8"
    codec: str
    shard_tokens: int
    chunk_tokens: int
    n_units: int
    n_samples: int

    @property
    def capacity(self) -> int:
        return self.n_units * self.shard_tokens

    def raw_bytes_per_token(self) -> int:
        """Uncompressed bytes of one token's feature arrays (what a unit buffer holds per token)."""
        return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                   for name, (shape, dtype) in self.arrays().items() if name in FEATURE_ARRAYS)

    def arrays(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (per-token shape, dtype) for every token-axis array."""
        L, H, K = self.n_layers, self.hidden, self.topk
        a = {
            "tokens/input_ids": ((), "int32"),
            "tokens/loss_mask": ((), "uint8"),
            "features/hidden": ((L, H), "uint16" if self.precision == "bf16" else "uint8"),
            "logits/topk_idx": ((K,), "int32"),
            "logits/topk_logp": ((K,), "float16"),
            "logits/lse": ((), "float32"),
        }
        if self.precision == "fp8":
            a["features/scale"] = ((L,), "float32")
        return a


INDEX_ARRAYS = {"index/offset": "int64", "index/length": "int32", "index/row": "int64",
                "index/file": "int32", "index/ok": "uint8"}
FEATURE_ARRAYS = ("features/hidden", "features/scale", "logits/topk_idx", "logits/topk_logp", "logits/lse")


@dataclass
class TargetInfo:
    path: str
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    layer_types: list[str] | None
    weights_fingerprint: str   # safetensors headers, sizes and sampled bytes (shared/target.py)
    tensors_fingerprint: str   # every byte of embed_tokens and lm_head: what training uses
    config: dict               # the target's text config


@dataclass
class TokenizerInfo:
    fingerprint: str           # vocabulary and chat template
    size: int
    pad_token_id: int | None
    eos_token_id: int | None
    mask_token_id: int | None


@dataclass
class DataInfo:
    spec: str                  # DATA as given
    files: list[dict]          # [{"path", "bytes", "sha256"}] in index/file order
    report: dict = field(default_factory=dict)  # rows read, kept, truncated, skipped by reason


@dataclass
class Manifest:
    """What made a store, in its zarr.json attributes under "dflash": read by every stage, written
    by extraction. to_dict/from_dict are the only places its keys are spelled."""
    target: TargetInfo
    tokenizer: TokenizerInfo
    data: DataInfo
    layer_ids: list[int]
    layer_convention: str
    precision: str
    codec: str
    topk: int
    max_len: int
    too_long: str
    chat_template_kwargs: dict  # the chat template options serving must use too
    run_key: dict               # the settings a resumed run must repeat
    dtypes: dict = field(default_factory=dict)
    layout: Layout | None = None
    kind: str = "dflash-target-features"
    created_at: str = ""
    format_version: int = FORMAT_VERSION
    complete: bool = False
    summary: dict | None = None
    completed_at: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "store") -> "Manifest":
        if d.get("format_version") != FORMAT_VERSION:
            raise StoreError(f"{where}: format version {d.get('format_version')}, this code reads "
                             f"{FORMAT_VERSION} (version 2 added per-chunk checksums): re-extract it")
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        try:
            kw["target"], kw["tokenizer"] = TargetInfo(**d["target"]), TokenizerInfo(**d["tokenizer"])
            kw["data"] = DataInfo(**d["data"])
            kw["layout"] = Layout(**d["layout"]) if d.get("layout") else None
            return cls(**kw)
        except (KeyError, TypeError) as e:
            raise StoreError(f"{where}: the manifest is not one this code wrote ({e})") from None


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
        filters, compressors = _codecs(layout.codec if name == "features/hidden" else "zstd1", itemsize)
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

    def __init__(self, where, root: zarr.Group | None = None, manifest: Manifest | None = None):
        self.loc = as_location(where)
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
            self._pool = ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="shard")
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


# --- dtype helpers --------------------------------------------------------------------------

def bf16_to_bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def bits_to_bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def fp8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., H) -> e4m3 bits (uint8) and a float32 scale per row: x ~= fp8 * scale.
    Rows are (token, layer), so each layer of each token gets its own scale."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
    scale = amax / FP8_MAX
    q = (xf / scale).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale.squeeze(-1)


def fp8_decode(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (bits.view(torch.float8_e4m3fn).float() * scale.unsqueeze(-1)).to(torch.bfloat16)


def encode_features(precision: str, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_logp: torch.Tensor,
                    lse: torch.Tensor) -> dict[str, torch.Tensor]:
    """A batch's features in the store's dtypes, keyed by array, still on their device (so the
    conversion runs there and only stored bytes travel): hidden (T, L, H) as bf16 bits or fp8 +
    scale, top-k ids int32, log-probs float16, lse float32."""
    if precision == "bf16":
        out = {"features/hidden": hidden.to(torch.bfloat16).view(torch.int16)}
    else:
        q, scale = fp8_encode(hidden)
        out = {"features/hidden": q, "features/scale": scale}
    out.update({"logits/topk_idx": topk_idx.to(torch.int32), "logits/topk_logp": topk_logp.to(torch.float16),
                "logits/lse": lse.float()})
    return out


def samples_by_unit(offsets: np.ndarray, shard_tokens: int, n_units: int) -> list[np.ndarray]:
    """Each unit's sample ids, ascending, from one stable sort of the index offsets (a scan of
    the whole index per unit costs samples x units)."""
    units = np.asarray(offsets) // shard_tokens
    order = np.argsort(units, kind="stable")
    bounds = np.searchsorted(units[order], np.arange(n_units + 1))
    return [order[bounds[u]:bounds[u + 1]] for u in range(n_units)]


def crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1)) & 0xFFFFFFFF


# --- atomic files ---------------------------------------------------------------------------

def atomic_write_text(path: Path, text: str):
    """Write through a temporary name in the same folder, then rename: readers see the old file
    or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# --- whole shards, encoded here ------------------------------------------------------------

def _crc32c_appended(b) -> bytes:
    """zarr's crc32c codec: the bytes, then their crc32c as a little-endian uint32."""
    if not isinstance(b, bytes):
        b = np.ascontiguousarray(b).view(np.uint8).reshape(-1)
    return b"".join((b, google_crc32c.value(b).to_bytes(4, "little")))


def _bytes_step(codec):
    """A bytes-to-bytes codec of zarr as the function its encode runs (the same numcodecs object
    zarr builds from the codec's configuration), or None for one not known here."""
    if isinstance(codec, Crc32cCodec):
        return _crc32c_appended
    if isinstance(codec, ZstdCodec):
        return codec._zstd_codec.encode
    if isinstance(codec, BloscCodec):
        return codec._blosc_codec.encode
    if isinstance(codec, (LZ4, Shuffle)):  # numcodecs' own codec objects, under zarr's wrappers
        return codec._codec.encode
    return None


class ShardEncoder:
    """One array's whole shard encoded as zarr's sharding codec writes it: the inner chunks in
    order, each through the array's codecs (bytes, compressor, crc32c), then the index of
    (offset, length) pairs and its crc32c; the same bytes, tested against zarr's own write. zarr
    passes each inner chunk through its one event-loop thread, and that serial work, not the
    compression, held a writer process to ~0.27 GB/s of raw features per busy core against
    zstd's ~0.84 per core (bench/host_bench.py); here the chunks are compressed on a thread pool
    and the shard is written in one call. for_array() is None for what it does not know (filters,
    the index at the start, chunks split along more than the token axis): those arrays are written
    through zarr."""

    def __init__(self, chunk_rows: int, n_chunks: int, steps: list):
        self.chunk_rows, self.n_chunks, self.steps = chunk_rows, n_chunks, steps

    @classmethod
    def for_array(cls, arr: zarr.Array) -> "ShardEncoder | None":
        from zarr.codecs import BytesCodec, ShardingCodec
        from zarr.codecs.sharding import ShardingCodecIndexLocation
        if os.environ.get("DFLASH_ZARR_SHARDS") == "1":  # benchmarks' baseline: zarr writes every shard
            return None
        codecs = arr.metadata.codecs
        if len(codecs) != 1 or not isinstance(codecs[0], ShardingCodec) or sys.byteorder != "little":
            return None
        sh = codecs[0]
        shard, inner = arr.metadata.chunk_grid.chunk_shape, sh.chunk_shape
        index_ok = (sh.index_location == ShardingCodecIndexLocation.end and len(sh.index_codecs) == 2
                    and isinstance(sh.index_codecs[0], BytesCodec) and isinstance(sh.index_codecs[1], Crc32cCodec))
        first, *rest = sh.codecs
        steps = [_bytes_step(c) for c in rest]
        little = isinstance(first, BytesCodec) and (first.endian is None or first.endian.value == "little")
        if not (index_ok and little and all(steps) and tuple(shard[1:]) == tuple(inner[1:])
                and shard[0] % inner[0] == 0):
            return None
        return cls(inner[0], shard[0] // inner[0], steps)

    def _chunk(self, data: np.ndarray, i: int) -> bytes:
        b = np.ascontiguousarray(data[i * self.chunk_rows:(i + 1) * self.chunk_rows]).view(np.uint8).reshape(-1)
        for step in self.steps:
            b = step(b)
        return bytes(b) if not isinstance(b, bytes) else b

    def encode(self, data: np.ndarray, pool: ThreadPoolExecutor):
        """The shard's bytes, in pieces to be written one after another, each chunk as soon as it
        is compressed (the pool compresses the later ones meanwhile), the index last."""
        assert data.shape[0] == self.chunk_rows * self.n_chunks, data.shape
        lengths = []
        for part in pool.map(lambda i: self._chunk(data, i), range(self.n_chunks)):
            lengths.append(len(part))
            yield part
        lengths = np.array(lengths, dtype=np.uint64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64)
        index = np.stack([offsets, lengths], axis=-1).astype("<u8")
        yield _crc32c_appended(index.tobytes())


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

    def __init__(self, where, require_complete: bool = True):
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
        self._index_cache: dict[tuple[str, int], np.ndarray] = {}

    def __len__(self) -> int:
        return self.layout.n_samples

    def array(self, name: str):
        if name not in self._arr:
            self._arr[name] = self.root[name]
        return self._arr[name]

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
             decode: bool = True) -> Sample:
        """One sample. Hidden states come back as bf16 whatever the store's precision; with
        decode=False an fp8 store returns its e4m3 bits (uint8) and Sample.scale instead, so the
        conversion can run on the GPU (train.step.draft) rather than in a CPU loader worker."""
        lo, hi = self.span(i)
        pos = self.layer_positions(layer_ids)
        ids, mask = self.array("tokens/input_ids")[lo:hi], self.array("tokens/loss_mask")[lo:hi]
        hidden = torch.empty(0)
        if features:
            full = len(pos) == self.layout.n_layers and pos == sorted(pos)
            sel = slice(None) if full else pos
            raw = self.array("features/hidden")[lo:hi] if full else \
                self.array("features/hidden").get_orthogonal_selection((slice(lo, hi), sel, slice(None)))
            if self.layout.precision == "bf16":
                hidden = bits_to_bf16(raw)
            else:
                scale = torch.from_numpy(self.array("features/scale")[lo:hi][:, pos])
                hidden = fp8_decode(torch.from_numpy(raw), scale) if decode else torch.from_numpy(raw)
        sample = Sample(
            input_ids=torch.from_numpy(ids.astype(np.int64)),
            loss_mask=torch.from_numpy(mask.astype(bool)),
            hidden=hidden,
            topk_idx=torch.from_numpy(self.array("logits/topk_idx")[lo:hi].astype(np.int64)),
            topk_logp=torch.from_numpy(self.array("logits/topk_logp")[lo:hi].astype(np.float32)),
            lse=torch.from_numpy(self.array("logits/lse")[lo:hi]),
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
        return self.array(name)[unit * S:(unit + 1) * S]

    def hidden_bits(self, lo: int, hi: int) -> np.ndarray:
        """Stored hidden-state bits of token rows lo:hi, undecoded (codec benchmarks)."""
        return self.array("features/hidden")[lo:hi]

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
