"""A lossless codec for bfloat16 features near their entropy: each 16-bit value is split into two
byte planes, the plane that carries the exponent is zstd-compressed, the other (mostly mantissa
bits, close to random) is stored as it is (docs/DESIGN.md, "The store's codec").

Splits (`split`):
- "window": plane B = sign and 7 mantissa bits; plane A = each exponent as a 4-bit offset above
  its column's base (the column's top exponent in the chunk less 14, at least 0; a column is one
  position of the `row` values that make one token: layer and channel), two offsets a byte, behind the
  bases, zstd-compressed. An exponent more than 14 below its column's top (tiny values, zeros)
  is an escape: code 15 in the plane, its index and exponent in a list. Rows of zeros at the
  chunk's end (a unit's unused tail) are not stored. Per column, a real
  feature's exponent carries ~2.6 bits against ~3.1 over all columns, and zstd's entropy coder
  sees a byte of two offsets; the plane it compresses is a quarter of the raw bytes, not half,
  which is what makes this split faster than zstd1 over the raw bytes.
- "exponent": plane A = the 8 exponent bits, plane B = sign and 7 mantissa bits.
- "byte": plane A = the high byte (sign, 7 exponent bits), plane B = the low byte.

Encoded chunk: b"BP", a version byte (1), the split (0 byte, 1 exponent, 2 window), the value
count as a little-endian uint64, plane A's compressed length as a uint32; for "window" then the
values per row, the escape count and the values stored (uint32 each; the values past them are
zeros); plane A (a zstd frame); for "window" the escapes (uint32 indices, then uint8 exponents);
plane B.

The window split runs as compiled C (shared/window.c, built on first use by shared/native.py),
one call a chunk without the interpreter lock; where it does not build, the numpy code below gives
the same bytes (slower on threads: each of its ~30 calls a chunk takes the lock back).

Two faces, one format: `BF16Planes` is a numcodecs codec (`numcodecs.get_codec({"id":
"dflash.bf16_planes", ...})`), `BF16PlanesCodec` the zarr v3 bytes-to-bytes codec named
"dflash.bf16_planes". zarr finds it by its entry point (group `zarr.codecs`, pyproject.toml): plain
`zarr.open` reads a store written with it once this package is installed, no import needed.
"""

from __future__ import annotations

import asyncio
import ctypes
import struct
import sys
import threading
from dataclasses import dataclass
from functools import cached_property

import numcodecs
import numpy as np
from numcodecs.abc import Codec
from numcodecs.compat import ensure_contiguous_ndarray
from numcodecs.zstd import Zstd
from zarr.abc.codec import BytesBytesCodec
from zarr.core.buffer.cpu import as_numpy_array_wrapper
from zarr.core.common import parse_named_configuration

NAME = "dflash.bf16_planes"
SPLITS = ("byte", "exponent", "window")
_HEAD = struct.Struct("<2sBBQI")  # magic, version, split, values, plane A's compressed length
_WIN = struct.Struct("<III")  # window split: values per row, escapes, values stored
TOP = 14  # window offsets 0..14 above the base (a column's top exponent - 14); 15 marks an escape


def _bytes(buf) -> np.ndarray:
    """Any buffer (bytes, memoryview, array) as a flat uint8 array, without a copy where possible."""
    return ensure_contiguous_ndarray(buf).reshape(-1).view(np.uint8)


def _kernel():
    """shared/window.c loaded (shared/native.py), or None: the numpy code below, same bytes."""
    global _KERNEL
    if _KERNEL is None:
        from shared.native import load
        lib = load("window") if sys.byteorder == "little" else None  # (it stores the format's bytes as they lie)
        if lib is not None:
            p, i64 = ctypes.c_void_p, ctypes.c_int64
            lib.window_used.argtypes, lib.window_used.restype = (p, i64, i64), i64
            lib.window_encode.argtypes, lib.window_encode.restype = (p, i64, i64, p, p, p, p, p, p, p), i64
            lib.window_decode.argtypes, lib.window_decode.restype = (p, p, p, i64, p, i64, i64, p), ctypes.c_int
        _KERNEL = lib if lib is not None else False
    return _KERNEL or None


_KERNEL = None


class _Scratch(threading.local):
    """Work arrays for the window split, one set per thread, kept for the next chunk of the same
    size: numpy takes a new array over 128 KiB from a fresh mmap, and its page faults cost more
    than the arithmetic on a feature chunk (measured: the encode ran at half speed without)."""

    def arrays(self, n: int, row: int) -> dict:
        if getattr(self, "key", None) != (n, row):
            half = (n + 1) // 2
            self.key, self.a = (n, row), {
                "u16": np.empty(n, np.uint16),
                "nib": np.empty(2 * half, np.uint8), "b8": np.empty(n, np.uint8),
                "plane": np.empty(row + half, np.uint8), "h1": np.empty(half, np.uint16), "h2": np.empty(half, np.uint16),
                # the compiled encoder's escapes and scratch
                "esc": np.empty(4 * n, np.uint8), "exp": np.empty(n, np.uint8), "lo": np.empty(row, np.uint8),
                "cols": np.empty(row, np.uint32)}
        return self.a


_SCRATCH = _Scratch()


def _native_encode(lib, v: np.ndarray, row: int, zstd: Zstd) -> bytes:
    """_window_encode's bytes from shared/window.c: one call for the split, one for zstd, both
    without the interpreter lock."""
    n = v.size
    k = lib.window_used(v.ctypes.data, n, row)
    s = _SCRATCH.arrays(k, row)
    plane, nib, pb, esc, exp = s["plane"], s["nib"], s["b8"], s["esc"], s["exp"]
    n_esc = lib.window_encode(v.ctypes.data, k, row, plane.ctypes.data, pb.ctypes.data, esc.ctypes.data,
                              exp.ctypes.data, s["lo"].ctypes.data, s["cols"].ctypes.data, nib.ctypes.data)
    packed = zstd.encode(plane) if plane.size else b""
    head = _HEAD.pack(b"BP", 1, 2, n, len(packed)) + _WIN.pack(row, n_esc, k)
    return b"".join((head, packed, esc[:4 * n_esc], exp[:n_esc], pb[:k]))


def _window_encode(v: np.ndarray, row: int, zstd: Zstd) -> np.ndarray:
    """The window split's chunk (header to plane B) of the uint16 values `v`."""
    n = v.size
    row = row if row and n % row == 0 else n  # a chunk that is not whole rows: one row
    row = row if n else 0
    lib = _kernel()
    if lib is not None:
        return _native_encode(lib, np.ascontiguousarray(v), row, zstd)
    # rows of zeros at the end (a unit's unused tail, a chunk past it) are not stored: plane B
    # would keep them raw
    nonzero = v.reshape(-1, row).any(axis=1) if n else np.zeros(0, bool)
    k = (nonzero.size - int(np.argmax(nonzero[::-1]))) * row if nonzero.any() else 0
    v = v[:k]
    s = _SCRATCH.arrays(k, row)
    nib, plane, b8 = s["nib"], s["plane"], s["b8"]
    np.right_shift(v, 7, out=nib[:k], casting="unsafe")  # the 8 exponent bits (the cast drops the sign)
    idx, exps = np.zeros(0, np.int64), np.zeros(0, np.uint8)
    base = plane[:row]
    if k:
        e = nib[:k].reshape(-1, row)
        np.maximum(e.max(axis=0), TOP, out=base)
        base -= TOP  # the column's top exponent is offset 14
        # escapes: exponents below their column's base, looked for only in the columns that have any
        cols = np.flatnonzero(e.min(axis=0) < base)
        if cols.size:
            r, c = np.nonzero(e[:, cols] < base[cols])
            idx, exps = r * row + cols[c], e[r, cols[c]]  # in flat order, as the rows are
        np.subtract(e, base, out=e)
        nib[idx] = TOP + 1
    else:
        base[:] = 0
    nib[k:] = 0  # an odd count's last, unused offset
    pairs = nib.view("<u2")  # two offsets (first, second) as one little-endian uint16
    np.left_shift(pairs, 4, out=s["h1"])
    np.right_shift(pairs, 8, out=s["h2"])
    np.bitwise_or(s["h1"], s["h2"], out=s["h1"])  # its low byte: first << 4 | second
    np.copyto(plane[row:], s["h1"], casting="unsafe")
    packed = zstd.encode(plane) if plane.size else b""  # (zstd cannot read back an empty frame)
    # the chunk, with plane B computed in place (a copy of the largest part saved)
    head, m, n_esc = _HEAD.size + _WIN.size, len(packed), idx.size
    at = head + m + 5 * n_esc
    out = np.empty(at + k, np.uint8)
    out[:head] = np.frombuffer(_HEAD.pack(b"BP", 1, 2, n, m) + _WIN.pack(row, n_esc, k), np.uint8)
    out[head:head + m] = np.frombuffer(packed, np.uint8)
    out[head + m:head + m + 4 * n_esc] = idx.astype("<u4").view(np.uint8)
    out[head + m + 4 * n_esc:at] = exps
    pb = out[at:]  # plane B: the sign at bit 7, the mantissa below
    np.right_shift(v, 8, out=pb, casting="unsafe")
    np.bitwise_and(pb, 0x80, out=pb)
    np.bitwise_and(v, 0x7F, out=b8[:k], casting="unsafe")
    np.bitwise_or(pb, b8[:k], out=pb)
    return out


def _window_decode(a: np.ndarray, esc: np.ndarray, sm: np.ndarray, n: int, row: int, res: np.ndarray):
    """The first n uint16 values of `res` (the stored ones) from plane A (decompressed), the
    escapes and plane B; the caller zeroes the rest."""
    lib = _kernel()
    if lib is not None:
        if lib.window_decode(a.ctypes.data, esc.ctypes.data, esc.ctypes.data + 4 * (esc.size // 5), esc.size // 5,
                             sm.ctypes.data, n, row, res.ctypes.data):
            raise ValueError(f"{NAME}: an escape's index is past the chunk's {n} values")
        return
    s = _SCRATCH.arrays(n, row)
    h1, h2, b8 = s["h1"], s["h2"], s["b8"]
    np.copyto(h1, a[row:])
    np.right_shift(h1, 4, out=h2)  # first offsets
    np.bitwise_and(h1, 15, out=h1)
    np.left_shift(h1, 8, out=h1)
    np.bitwise_or(h1, h2, out=h1)  # bytes in order: first, second
    e = h1.view(np.uint8)[:n]
    if n:
        np.add(e.reshape(-1, row), a[:row], out=e.reshape(-1, row))  # wraps like the encoder's subtraction
    n_esc = esc.size // 5
    if n_esc:
        idx = esc[:4 * n_esc].view("<u4")
        if idx.max() >= n:
            raise ValueError(f"{NAME}: an escape's index {idx.max()} is past the chunk's {n} values")
        e[idx] = esc[4 * n_esc:]
    u16 = np.uint16
    np.left_shift(e, u16(7), out=res, dtype=u16)  # the exponent
    np.bitwise_and(sm, 0x7F, out=b8)
    np.bitwise_or(res, b8, out=res)  # the mantissa
    np.bitwise_and(sm, 0x80, out=b8)
    np.left_shift(b8, u16(8), out=s["u16"], dtype=u16)
    np.bitwise_or(res, s["u16"], out=res)  # the sign


class BF16Planes(Codec):
    codec_id = NAME

    def __init__(self, level: int = 1, split: str = "exponent", row: int = 0):
        if split not in SPLITS:
            raise ValueError(f"{NAME}: split must be one of {SPLITS}, not {split!r}")
        self.level, self.split, self.row = int(level), split, int(row)
        self._zstd = Zstd(level=self.level)

    def encode(self, buf):  # bytes, or for the window split a uint8 array (written in place, no copy)
        b = _bytes(buf)
        if b.size % 2:
            raise ValueError(f"{NAME}: {b.size} bytes is not a whole number of 16-bit values")
        if self.split == "window":
            if b.size // 2 >= 1 << 32:
                raise ValueError(f"{NAME}: {b.size // 2} values in one chunk; the window split takes < 2**32")
            return _window_encode(b.view("<u2"), self.row, self._zstd)
        if self.split == "byte":
            pairs = b.reshape(-1, 2)  # little-endian: [low, high]
            a, rest = pairs[:, 1], np.ascontiguousarray(pairs[:, 0])
        else:
            v = b.view("<u2")
            a = (v >> 7).astype(np.uint8)  # bits 7..14: the exponent (the sign drops off)
            rest = ((v >> 8) & 0x80 | v & 0x7F).astype(np.uint8)
        packed = self._zstd.encode(np.ascontiguousarray(a))
        head = _HEAD.pack(b"BP", 1, SPLITS.index(self.split), b.size // 2, len(packed))
        return b"".join((head, packed, rest.tobytes()))

    def decode(self, buf, out=None):
        mv = memoryview(_bytes(buf))
        if len(mv) < _HEAD.size:
            raise ValueError(f"{NAME}: {len(mv)} bytes, shorter than its header")
        magic, version, split, n, m = _HEAD.unpack_from(mv)
        start, row, n_esc, k = _HEAD.size, 0, 0, n  # k: the values stored
        if split == 2 and len(mv) >= _HEAD.size + _WIN.size:
            row, n_esc, k = _WIN.unpack_from(mv, _HEAD.size)
            start += _WIN.size
        if (magic != b"BP" or version != 1 or split >= len(SPLITS) or len(mv) != start + m + 5 * n_esc + k
                or (split == 2 and (k > n or row == 0 and n or row and (n % row or k % row)))):
            raise ValueError(f"{NAME}: not a chunk of this codec (header {magic!r} v{version} split {split}, "
                             f"{n} values, plane {m} bytes, {len(mv)} bytes in all)")
        a = np.frombuffer(self._zstd.decode(mv[start:start + m]) if m else b"", dtype=np.uint8)
        rest = np.frombuffer(mv[start + m + 5 * n_esc:], dtype=np.uint8)
        want = row + (k + 1) // 2 if split == 2 else n
        if a.size != want:
            raise ValueError(f"{NAME}: plane A holds {a.size} bytes, the header says {want}")
        res = np.empty(2 * n, dtype=np.uint8) if out is None else _bytes(out)
        if res.size != 2 * n:
            raise ValueError(f"{NAME}: the chunk holds {n} values, the output has room for {res.size // 2}")
        if SPLITS[split] == "window":
            esc = np.frombuffer(mv[start + m:start + m + 5 * n_esc], dtype=np.uint8)
            _window_decode(a, esc, rest, k, row, res[:2 * k].view("<u2"))
            res[2 * k:] = 0  # the rows of zeros at the end
        elif SPLITS[split] == "byte":
            pairs = res.reshape(-1, 2)
            pairs[:, 0], pairs[:, 1] = rest, a
        else:
            v = res.view("<u2")
            np.left_shift(a.astype(np.uint16), 7, out=v)
            v |= rest & 0x7F
            v |= (rest & 0x80).astype(np.uint16) << 8
        return res if out is None else out

    def get_config(self):
        cfg = {"id": NAME, "level": self.level, "split": self.split}
        return {**cfg, "row": self.row} if self.split == "window" else cfg


numcodecs.register_codec(BF16Planes)


@dataclass(frozen=True)
class BF16PlanesCodec(BytesBytesCodec):
    """zarr v3's face of BF16Planes (same bytes)."""

    is_fixed_size = False
    level: int = 1
    split: str = "exponent"
    row: int = 0

    def __init__(self, *, level: int = 1, split: str = "exponent", row: int = 0):
        if split not in SPLITS:
            raise ValueError(f"{NAME}: split must be one of {SPLITS}, not {split!r}")
        object.__setattr__(self, "level", int(level))
        object.__setattr__(self, "split", split)
        object.__setattr__(self, "row", int(row))

    @classmethod
    def from_dict(cls, data):
        _, cfg = parse_named_configuration(data, NAME)
        return cls(**cfg)

    def to_dict(self):
        cfg = self.codec.get_config()
        del cfg["id"]
        return {"name": NAME, "configuration": cfg}

    @cached_property
    def codec(self) -> BF16Planes:
        return BF16Planes(self.level, self.split, self.row)

    def _encode_sync(self, chunk_bytes, chunk_spec):
        return as_numpy_array_wrapper(self.codec.encode, chunk_bytes, chunk_spec.prototype)

    def _decode_sync(self, chunk_bytes, chunk_spec):
        return as_numpy_array_wrapper(self.codec.decode, chunk_bytes, chunk_spec.prototype)

    async def _encode_single(self, chunk_bytes, chunk_spec):
        return await asyncio.to_thread(self._encode_sync, chunk_bytes, chunk_spec)

    async def _decode_single(self, chunk_bytes, chunk_spec):
        return await asyncio.to_thread(self._decode_sync, chunk_bytes, chunk_spec)

    def compute_encoded_size(self, _input_byte_length, _chunk_spec):
        raise NotImplementedError
