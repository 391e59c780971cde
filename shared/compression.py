"""How the store's chunks are compressed: the codec chains by name, what they are expected to save,
and whole shards encoded here rather than chunk by chunk through zarr (ShardEncoder).

Every chain ends with a crc32c of each compressed chunk, so flipped or truncated bytes are an
error when read, never values that decode to garbage.
"""

from __future__ import annotations

import asyncio
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor

import google_crc32c
import numpy as np
import zarr
import zarr.registry
from zarr.codecs import BloscCodec, BloscShuffle, Crc32cCodec, ZstdCodec
from zarr.codecs.numcodecs import LZ4, Shuffle

CODECS = ("blosc-zstd1", "blosc-zstd3", "shuffle-zstd3", "zstd1", "blosc-lz41", "lz4", "none")

# Compression of hidden states seen so far (BENCHMARKS.md: 1.27-1.39x for bf16, 1.22x for fp8
# bytes), the low end: extraction's free-space check refuses only a store clearly too big.
EXPECTED_RATIO = {"none": 1.0, "lz4": 1.1, "blosc-lz41": 1.1, "zstd1": 1.2, "shuffle-zstd3": 1.2,
                  "blosc-zstd1": 1.2, "blosc-zstd3": 1.2}
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


def codec_chain(name: str, itemsize: int):
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


def crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1)) & 0xFFFFFFFF


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
