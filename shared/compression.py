"""How the store's chunks are compressed: the codec chains by name, what they are expected to save,
and whole shards encoded here rather than chunk by chunk through zarr (ShardEncoder).

Every chain ends with a crc32c of each compressed chunk, so flipped or truncated bytes are an
error when read, never values that decode to garbage.
"""

from __future__ import annotations

import asyncio
import sys
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import google_crc32c
import numpy as np
import zarr
import zarr.registry
from zarr.codecs import BloscCodec, BloscShuffle, Crc32cCodec, ZstdCodec
from zarr.codecs.numcodecs import LZ4, Shuffle

from shared.planes import NAME as PLANES_NAME
from shared.planes import BF16PlanesCodec


@dataclass(frozen=True)
class Codec:
    """A codec of the hidden states: its zarr chain (before the crc32c) for an item size and the
    values per token (layers x hidden, the row the window split takes its columns from), and the
    ratio raw/stored measured on real features (BENCHMARKS.md, "The store's codec": SmolLM2-135M
    layers [1, 8, 14, 20, 27]) for bf16 and for fp8 (scales included), rounded down, which
    extraction's size estimate and free-space check use. Everything about a codec is here: the
    shard encoder runs any chain whose steps it knows (`_bytes_step`), and tests/test_store.py
    checks every codec through it against zarr."""
    name: str
    chain: Callable[[int, int], tuple]
    ratio: tuple[float, float]


def _blosc(cname: str, level: int):
    return lambda itemsize, row: (BloscCodec(cname=cname, clevel=level, shuffle=BloscShuffle.shuffle, typesize=itemsize),)


# ratios: bf16 hidden states, fp8 bytes (bench/codec_bench.py on the real store, BENCHMARKS.md)
TABLE = {c.name: c for c in (
    Codec("zstd1", lambda itemsize, row: (ZstdCodec(level=1),), (1.23, 1.17)),
    # the default: the exponents as 4-bit offsets in a window per (layer, channel), zstd1; sign
    # and mantissa raw (shared/planes.py, its passes compiled from shared/window.c); fp8 stores:
    # zstd1. 0.676 of raw bf16 on real features; faster than zstd1 per core, on threads too
    # (BENCHMARKS.md, "The window split", "Ninth session")
    Codec("bf16-window", lambda itemsize, row: (BF16PlanesCodec(level=1, split="window", row=row),)
          if itemsize == 2 else (ZstdCodec(level=1),), (1.47, 1.17)),
    # the exponent plane zstd1, the sign+mantissa plane raw (shared/planes.py); fp8 stores: zstd1
    Codec("bf16-planes", lambda itemsize, row: (BF16PlanesCodec(level=1, split="exponent"),) if itemsize == 2 else
          (ZstdCodec(level=1),), (1.40, 1.17)),
    # zarr's numcodecs Shuffle is a bytes-to-bytes codec: a compressor step, not a filter
    Codec("shuffle-zstd3", lambda itemsize, row: (Shuffle(elementsize=itemsize), ZstdCodec(level=3)), (1.33, 1.17)),
    # blosc: its SIMD byte shuffle inside
    Codec("blosc-zstd1", _blosc("zstd", 1), (1.23, 1.17)),
    Codec("blosc-zstd3", _blosc("zstd", 3), (1.29, 1.17)),
    Codec("blosc-lz41", _blosc("lz4", 1), (1.07, 1.0)),
    Codec("lz4", lambda itemsize, row: (LZ4(),), (1.0, 1.0)),
    Codec("none", lambda itemsize, row: (), (1.0, 1.0)),
)}
CODECS = tuple(TABLE)


def expected_ratio(codec: str, precision: str) -> float:
    return TABLE[codec].ratio[0 if precision == "bf16" else 1]


SMALL_ARRAYS_RATIO = 2.0  # token ids, loss mask, top-k and lse arrays (zstd1)


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
# also found through the package's entry point (group zarr.codecs) by a zarr that never imports us
zarr.registry.register_codec(PLANES_NAME, BF16PlanesCodec)


def codec_chain(name: str, itemsize: int, row: int):
    """(filters, compressors) for a codec name, with a crc32c of each compressed chunk last, so
    that flipped or truncated bytes are an error when read, never values that decode to garbage.
    row: the values per token of the array."""
    if name not in TABLE:
        raise ValueError(f"unknown codec {name!r}; choose one of {CODECS}")
    return (), (*TABLE[name].chain(itemsize, row), ThreadedCrc32cCodec())


def crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1)) & 0xFFFFFFFF


# --- whole shards, encoded here ------------------------------------------------------------

def _crc32c_appended(b) -> bytes:
    """zarr's crc32c codec: the bytes, then their crc32c as a little-endian uint32."""
    if not isinstance(b, bytes):
        b = np.ascontiguousarray(b).view(np.uint8).reshape(-1)
    return b"".join((b, google_crc32c.value(b).to_bytes(4, "little")))


def numcodec(codec):
    """The numcodecs object that a zarr bytes-to-bytes codec of TABLE encodes with (the same
    object zarr builds from the codec's configuration), or None for one not known here."""
    if isinstance(codec, ZstdCodec):
        return codec._zstd_codec
    if isinstance(codec, BloscCodec):
        return codec._blosc_codec
    if isinstance(codec, (LZ4, Shuffle)):  # numcodecs' own codec objects, under zarr's wrappers
        return codec._codec
    if isinstance(codec, BF16PlanesCodec):
        return codec.codec
    return None


def numcodecs_chain(name: str, itemsize: int, row: int) -> list:
    """A codec's chain as numcodecs objects (benchmarks run them one chunk at a time)."""
    return [numcodec(c) for c in TABLE[name].chain(itemsize, row)]


def _bytes_step(codec):
    """A bytes-to-bytes codec of zarr as the function its encode runs, or None."""
    if isinstance(codec, Crc32cCodec):
        return _crc32c_appended
    c = numcodec(codec)
    return None if c is None else c.encode


def token_axis_shards(arr: zarr.Array) -> tuple[int, int, list] | None:
    """(rows per inner chunk, inner chunks per shard, the inner codecs after the bytes codec) of an
    array whose shards split only its token axis, with zarr's shard index at the end (bytes and
    crc32c) and little-endian values; None for any other layout. What the store's own shard
    encoder (here) and shard reader (shared/shards.py) both take on, and nothing else."""
    from zarr.codecs import BytesCodec, ShardingCodec
    from zarr.codecs.sharding import ShardingCodecIndexLocation
    codecs = arr.metadata.codecs
    if len(codecs) != 1 or not isinstance(codecs[0], ShardingCodec) or sys.byteorder != "little":
        return None
    sh = codecs[0]
    shard, inner = arr.metadata.chunk_grid.chunk_shape, sh.chunk_shape
    index_ok = (sh.index_location == ShardingCodecIndexLocation.end and len(sh.index_codecs) == 2
                and isinstance(sh.index_codecs[0], BytesCodec) and isinstance(sh.index_codecs[1], Crc32cCodec))
    first, *rest = sh.codecs
    little = isinstance(first, BytesCodec) and (first.endian is None or first.endian.value == "little")
    if not (index_ok and little and tuple(shard[1:]) == tuple(inner[1:]) and shard[0] % inner[0] == 0):
        return None
    return inner[0], shard[0] // inner[0], rest


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
        layout = token_axis_shards(arr)
        if layout is None:
            return None
        chunk_rows, n_chunks, inner = layout
        steps = [_bytes_step(c) for c in inner]
        return cls(chunk_rows, n_chunks, steps) if all(steps) else None

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
