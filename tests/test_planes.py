"""The bf16 byte-plane codec (shared/planes.py): lossless for every 16-bit pattern, both splits,
refuses what is not its own, and plain zarr reads a store written with it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from shared.planes import BF16Planes, BF16PlanesCodec


def every_kind_of_bf16(n=50_000):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 3)).astype(np.float32)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    specials = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x0001, 0x807F, 0x7F7F, 0xFFFF], dtype=np.uint16)
    return np.concatenate([bits, specials, rng.integers(0, 1 << 16, 1000).astype(np.uint16)])


@pytest.mark.parametrize("split", ["exponent", "byte"])
def test_every_bit_pattern_round_trips_and_the_exponent_plane_is_what_shrinks(split):
    x = every_kind_of_bf16()
    c = BF16Planes(level=1, split=split)
    enc = c.encode(x)
    assert np.array_equal(np.frombuffer(c.decode(enc), dtype=np.uint16), x)
    out = bytearray(x.nbytes)
    c.decode(enc, out=out)
    assert bytes(out) == x.tobytes()
    assert len(enc) < 0.85 * x.nbytes  # the plane with the exponent compresses; the other is raw
    # the same bytes through numcodecs' registry (the codec's config names it)
    import numcodecs
    assert numcodecs.get_codec(c.get_config()).encode(x) == enc


def test_what_is_not_a_chunk_of_the_codec_is_an_error():
    c = BF16Planes()
    with pytest.raises(ValueError, match="whole number of 16-bit values"):
        c.encode(b"abc")
    enc = bytearray(c.encode(every_kind_of_bf16(100)))
    with pytest.raises(ValueError, match="not a chunk of this codec"):
        c.decode(bytes(enc[:-1]))
    enc[0:2] = b"XX"
    with pytest.raises(ValueError, match="not a chunk of this codec"):
        c.decode(bytes(enc))
    with pytest.raises(ValueError, match="split"):
        BF16PlanesCodec(split="nibble")


def test_plain_zarr_reads_an_array_written_with_it_through_the_entry_point(tmp_path):
    """Written here (our module imported); read in a fresh interpreter that imports zarr alone:
    zarr finds the codec by the package's entry point."""
    import zarr
    x = every_kind_of_bf16(64 * 40)[:64 * 40].reshape(64, 40)
    a = zarr.create_array(str(tmp_path / "a.zarr"), shape=x.shape, chunks=(16, 40), dtype="uint16",
                          compressors=[BF16PlanesCodec(level=1)], filters=None)
    a[:] = x
    np.save(tmp_path / "want.npy", x)
    code = ("import sys, numpy as np, zarr; assert 'shared.planes' not in sys.modules; "
            "a = zarr.open_array(sys.argv[1], mode='r'); "
            "assert np.array_equal(a[:], np.load(sys.argv[2])); print(a.metadata.codecs)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a.zarr"), str(tmp_path / "want.npy")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "dflash.bf16_planes" in r.stdout or "BF16PlanesCodec" in r.stdout
