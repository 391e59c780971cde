"""Token rows of a sharded array read straight from its shards: the reading counterpart of
compression.ShardEncoder, for the training loader.

zarr reads a slice through its event-loop thread and decodes each inner chunk on a thread of its
own; a loader worker's one sample (a few hundred tokens) cost 9-12 ms that way against 3 ms read
and decoded here (bench/loader_rows.py, BENCHMARKS.md). Here the shard's index (at its end) is
read once and cached, the chunks a slice needs are fetched in one ranged read, checked against
their crc32c and decoded, in the calling thread or, given a pool, a read's chunks on its threads
(zstd decodes without the interpreter lock; the 27B drafter's 3.3 MB chunks made one thread per
loader worker 0.85x zarr's threaded read on a 16-core host where workers left cores idle). A
loader worker is a process, so its decoding shares no interpreter lock with other workers (a numpy
codec loses most of its speed when threads share one: BENCHMARKS.md, "Eighth session").

for_array() is None for an array this does not know how to read (no sharding, the index at the
start, chunks split along more than the token axis, a codec step it does not know), and for every
array with DFLASH_SHARD_READER=0 in the environment; the store then reads it through zarr. tests/test_shards.py checks every codec and every kind of slice
against zarr's own read.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Executor

import google_crc32c
import numpy as np
import zarr
from numcodecs.zstd import Zstd
from zarr.codecs import Crc32cCodec

from shared.compression import numcodec, token_axis_shards
from shared.location import Location
from shared.planes import BF16Planes


class DamagedShard(ValueError):
    """Bytes of a shard that do not match their checksum or their index. Not a StoreError: the
    loader names the sample, unit and source row it was reading around it (train/loader.py)."""


_EMPTY = np.uint64(2**64 - 1)  # an index entry of a chunk never written (zarr: offset and length all ones)


def zstd_content_size(b) -> int | None:
    """The decompressed size a zstd frame's header states (RFC 8878, 3.1.1.1), None where it
    states none: numcodecs' zstd decodes into a larger buffer's start without a word, so a chunk
    decoded into a kept buffer is checked against this first."""
    if len(b) < 6 or bytes(b[:4]) != b"\x28\xb5\x2f\xfd":
        return None
    fhd = b[4]
    fcs_flag, single, did_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    at = 5 + (0 if single else 1) + (0, 1, 2, 4)[did_flag]  # past the window descriptor and dictionary id
    width = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if width == 0 or len(b) < at + width:
        return None
    size = int.from_bytes(bytes(b[at:at + width]), "little")
    return size + 256 if width == 2 else size


class _Scratch(threading.local):
    """A chunk-sized buffer per thread that one-step chains decode into: a fresh one per chunk
    took new pages each time (glibc maps blocks this size afresh), and a loader worker read the
    window codec's rows at half speed in some processes (BENCHMARKS.md, "Ninth session")."""

    def get(self, nbytes: int) -> np.ndarray:
        if getattr(self, "buf", None) is None or self.buf.size != nbytes:
            self.buf = np.empty(nbytes, np.uint8)
        return self.buf


_SCRATCH = _Scratch()


def _crc_ok(b: memoryview) -> bool:
    # (google_crc32c takes a numpy view of the bytes without a copy, not a memoryview slice)
    return google_crc32c.value(np.frombuffer(b[:-4], np.uint8)) == int.from_bytes(b[-4:], "little")


class ShardReader:
    """Rows of one sharded array whose shards split only the token axis."""

    # chunks smaller than this are decoded in the calling thread even given a pool: handing them to
    # threads cost more than it saved (the window codec's 49 KB chunks read at 0.68x on 2 threads)
    pool_min_bytes = 256 * 1024

    def __init__(self, loc: Location, name: str, arr: zarr.Array, chunk_rows: int, decoders: list):
        self.loc, self.name = loc, name
        self.shard_rows, self.chunk_rows = arr.metadata.chunk_grid.chunk_shape[0], chunk_rows
        self.n_chunks = self.shard_rows // chunk_rows
        self.row_shape, self.dtype, self.rows = tuple(arr.shape[1:]), arr.dtype, arr.shape[0]
        self.fill = arr.metadata.fill_value
        self.chunk_bytes = chunk_rows * int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize
        self.decoders = decoders  # inner compressors, last applied first
        encode_key = arr.metadata.encode_chunk_key
        self.shard_key = lambda shard: f"{name}/{encode_key((shard,) + (0,) * len(self.row_shape))}"
        self._indexes: OrderedDict[int, np.ndarray | None] = OrderedDict()  # shard -> (n_chunks, 2) uint64
        self._lock = threading.Lock()  # the loader reads a row's samples on threads on object storage

    @classmethod
    def for_array(cls, loc: Location, name: str, arr: zarr.Array) -> "ShardReader | None":
        if os.environ.get("DFLASH_SHARD_READER", "1") == "0":  # everything through zarr (a baseline, a fallback)
            return None
        layout = token_axis_shards(arr)
        if layout is None:
            return None
        chunk_rows, _, rest = layout
        if not (rest and isinstance(rest[-1], Crc32cCodec) and tuple(arr.metadata.chunk_grid.chunk_shape[1:])
                == tuple(arr.shape[1:])):
            return None
        decoders = [numcodec(c) for c in rest[:-1]]
        if any(d is None for d in decoders):
            return None
        return cls(loc, name, arr, chunk_rows, decoders[::-1])

    def _where(self, shard: int) -> str:
        return f"{self.loc}: {self.name}, shard {shard}"

    def _index(self, shard: int) -> np.ndarray | None:
        """The shard's (offset, length) per chunk; None for a shard never written (all fill)."""
        with self._lock:
            if shard in self._indexes:
                self._indexes.move_to_end(shard)
                return self._indexes[shard]
        n = self.n_chunks * 16 + 4
        raw = self.loc.read_tail(self.shard_key(shard), n)
        if raw is None:
            index = None
        else:
            if len(raw) != n or not _crc_ok(memoryview(raw)):
                raise DamagedShard(f"{self._where(shard)}: its index is damaged (crc32c or length); re-extract this unit")
            index = np.frombuffer(raw, "<u8", count=2 * self.n_chunks).reshape(-1, 2)
        with self._lock:
            self._indexes[shard] = index
            if len(self._indexes) > 64:
                self._indexes.popitem(last=False)
        return index

    def _fits(self, d, payload: memoryview) -> bool:
        """Whether decoder d decodes this chunk into a chunk-sized buffer exactly (zstd: its
        frame's stated size; the bf16 planes codec checks its size itself, and refuses any other)."""
        if isinstance(d, Zstd):
            return zstd_content_size(payload) == self.chunk_bytes
        return isinstance(d, BF16Planes)

    def _decode(self, b: memoryview, shard: int, chunk: int) -> np.ndarray:
        """The chunk's rows; a view of this thread's scratch buffer where the codec decodes into it
        (used before the thread's next decode)."""
        if len(b) < 4 or not _crc_ok(b):
            raise DamagedShard(f"{self._where(shard)}, chunk {chunk}: crc32c mismatch (damaged bytes); "
                               f"re-extract this unit")
        out = b[:-4]
        if len(self.decoders) == 1 and self._fits(self.decoders[0], out):
            try:
                out = self.decoders[0].decode(out, out=_SCRATCH.get(self.chunk_bytes))
            except ValueError as e:  # the window codec: a chunk of another size
                raise DamagedShard(f"{self._where(shard)}, chunk {chunk}: {e}") from None
            return out.view(self.dtype).reshape((self.chunk_rows,) + self.row_shape)
        for d in self.decoders:
            out = d.decode(out)
        a = np.frombuffer(out, np.uint8)
        if a.size != self.chunk_bytes:
            raise DamagedShard(f"{self._where(shard)}, chunk {chunk}: decodes to {a.size} bytes, not {self.chunk_bytes}")
        return a.view(self.dtype).reshape((self.chunk_rows,) + self.row_shape)

    def read(self, lo: int, hi: int, pool: Executor | None = None) -> np.ndarray:
        """Rows lo:hi, as zarr's arr[lo:hi] returns them; pool: decodes a shard's chunks."""
        if not 0 <= lo <= hi <= self.rows:
            raise IndexError(f"{self.name}: rows {lo}:{hi} of {self.rows}")
        out = np.empty((hi - lo,) + self.row_shape, self.dtype)
        S = self.shard_rows
        for shard in range(lo // S, (hi - 1) // S + 1 if hi > lo else lo // S):
            s_lo, s_hi = max(lo, shard * S), min(hi, (shard + 1) * S)
            cached = shard in self._indexes
            try:
                self._read_shard(shard, s_lo, s_hi, out[s_lo - lo:s_hi - lo], pool)
            except (DamagedShard, FileNotFoundError):
                if not cached:
                    raise
                # a cached index is stale if the shard was written again since (a unit re-extracted
                # while this store was open): read it afresh once; damaged bytes stay an error
                with self._lock:
                    self._indexes.pop(shard, None)
                self._read_shard(shard, s_lo, s_hi, out[s_lo - lo:s_hi - lo], pool)
        return out

    def _read_shard(self, shard: int, s_lo: int, s_hi: int, out: np.ndarray, pool: Executor | None):
        """Rows s_lo:s_hi (all in this shard) into out."""
        S, C = self.shard_rows, self.chunk_rows
        index = self._index(shard)
        if index is None:
            out[:] = self.fill
            return
        c0, c1 = (s_lo - shard * S) // C, (s_hi - 1 - shard * S) // C + 1
        entries = index[c0:c1]
        written = entries[:, 0] != _EMPTY
        if written.any():  # one ranged read from the first written chunk's start to the last's end
            start = int(entries[written, 0].min())
            end = int((entries[written, 0] + entries[written, 1]).max())
            buf = memoryview(self.loc.read_range(self.shard_key(shard), start, end))
            if len(buf) != end - start:
                raise DamagedShard(f"{self._where(shard)}: {len(buf)} bytes where its index says {end - start}")
        jobs = []  # (chunk, its bytes, where its rows go, which of its rows)
        for j, (off, length) in enumerate(entries):
            c = c0 + j
            r_lo, r_hi = max(s_lo, shard * S + c * C), min(s_hi, shard * S + (c + 1) * C)
            dst = out[r_lo - s_lo:r_hi - s_lo]
            if off == _EMPTY:
                dst[:] = self.fill
                continue
            first = shard * S + c * C
            jobs.append((c, buf[int(off) - start:int(off + length) - start], dst, r_lo - first, r_hi - first))

        def decode(job):
            c, b, dst, x0, x1 = job
            dst[:] = self._decode(b, shard, c)[x0:x1]

        if pool is not None and len(jobs) > 1 and self.chunk_bytes >= self.pool_min_bytes:
            for _ in pool.map(decode, jobs):  # (the first chunk's error, if any, raised here)
                pass
        else:
            for job in jobs:
                decode(job)
