"""A lossless codec for bfloat16 features near their entropy: each 16-bit value is split into two
byte planes, the plane that carries the exponent is zstd-compressed, the other (mostly mantissa
bits, close to random) is stored as it is (docs/DESIGN.md, "The store's codec").

Splits (`split`):
- "exponent": plane A = the 8 exponent bits, plane B = sign and 7 mantissa bits. Keeps the
  whole exponent, the only part of a feature with much redundancy, in the compressed plane.
- "byte": plane A = the high byte (sign, 7 exponent bits), plane B = the low byte.

Encoded chunk: b"BP", a version byte (1), the split (0 byte, 1 exponent), the value count as a
little-endian uint64, plane A's compressed length as a uint32, plane A (a zstd frame), plane B.

Two faces, one format: `BF16Planes` is a numcodecs codec (`numcodecs.get_codec({"id":
"dflash.bf16_planes", ...})`), `BF16PlanesCodec` the zarr v3 bytes-to-bytes codec named
"dflash.bf16_planes". zarr finds it by its entry point (group `zarr.codecs`, pyproject.toml): plain
`zarr.open` reads a store written with it once this package is installed, no import needed.
"""

from __future__ import annotations

import asyncio
import struct
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
SPLITS = ("byte", "exponent")
_HEAD = struct.Struct("<2sBBQI")  # magic, version, split, values, plane A's compressed length


def _bytes(buf) -> np.ndarray:
    """Any buffer (bytes, memoryview, array) as a flat uint8 array, without a copy where possible."""
    return ensure_contiguous_ndarray(buf).reshape(-1).view(np.uint8)


class BF16Planes(Codec):
    codec_id = NAME

    def __init__(self, level: int = 1, split: str = "exponent"):
        if split not in SPLITS:
            raise ValueError(f"{NAME}: split must be one of {SPLITS}, not {split!r}")
        self.level, self.split = int(level), split
        self._zstd = Zstd(level=self.level)

    def encode(self, buf) -> bytes:
        b = _bytes(buf)
        if b.size % 2:
            raise ValueError(f"{NAME}: {b.size} bytes is not a whole number of 16-bit values")
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
        if magic != b"BP" or version != 1 or split >= len(SPLITS) or len(mv) != _HEAD.size + m + n:
            raise ValueError(f"{NAME}: not a chunk of this codec (header {magic!r} v{version} split {split}, "
                             f"{n} values, plane {m} bytes, {len(mv)} bytes in all)")
        a = np.frombuffer(self._zstd.decode(mv[_HEAD.size:_HEAD.size + m]), dtype=np.uint8)
        rest = np.frombuffer(mv[_HEAD.size + m:], dtype=np.uint8)
        if a.size != n:
            raise ValueError(f"{NAME}: plane A holds {a.size} values, the header says {n}")
        res = np.empty(2 * n, dtype=np.uint8) if out is None else np.frombuffer(out, dtype=np.uint8)
        if SPLITS[split] == "byte":
            pairs = res.reshape(-1, 2)
            pairs[:, 0], pairs[:, 1] = rest, a
        else:
            v = res.view("<u2")
            np.left_shift(a.astype(np.uint16), 7, out=v)
            v |= rest & 0x7F
            v |= (rest & 0x80).astype(np.uint16) << 8
        return res if out is None else out

    def get_config(self):
        return {"id": NAME, "level": self.level, "split": self.split}


numcodecs.register_codec(BF16Planes)


@dataclass(frozen=True)
class BF16PlanesCodec(BytesBytesCodec):
    """zarr v3's face of BF16Planes (same bytes)."""

    is_fixed_size = False
    level: int = 1
    split: str = "exponent"

    def __init__(self, *, level: int = 1, split: str = "exponent"):
        if split not in SPLITS:
            raise ValueError(f"{NAME}: split must be one of {SPLITS}, not {split!r}")
        object.__setattr__(self, "level", int(level))
        object.__setattr__(self, "split", split)

    @classmethod
    def from_dict(cls, data):
        _, cfg = parse_named_configuration(data, NAME)
        return cls(**cfg)

    def to_dict(self):
        return {"name": NAME, "configuration": {"level": self.level, "split": self.split}}

    @cached_property
    def codec(self) -> BF16Planes:
        return BF16Planes(self.level, self.split)

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
