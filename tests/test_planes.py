"""The bf16 byte-plane codec (shared/planes.py): lossless for every 16-bit pattern, both splits,
refuses what is not its own, and plain zarr reads a store written with it. Every test runs twice:
with the window split's compiled passes (shared/window.c) and with its numpy code."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import shared.planes as planes
from shared.planes import SPLITS, BF16Planes, BF16PlanesCodec


@pytest.fixture(autouse=True, params=["compiled", "numpy"])
def window_code(request, monkeypatch):
    """The window split through shared/window.c, then through numpy: the same bytes either way
    (the rule written out below checks both)."""
    if request.param == "numpy":
        monkeypatch.setattr(planes, "_KERNEL", False)
    else:
        import shutil
        if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
            pytest.skip("no C compiler on this machine: the numpy code is what runs here")
        monkeypatch.setattr(planes, "_KERNEL", None)
        assert planes._kernel() is not None, "shared/window.c did not build (its reason is in the log above)"
    return request.param


def every_kind_of_bf16(n=50_000):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 3)).astype(np.float32)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    specials = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x0001, 0x807F, 0x7F7F, 0xFFFF], dtype=np.uint16)
    return np.concatenate([bits, specials, rng.integers(0, 1 << 16, 1000).astype(np.uint16)])


@pytest.mark.parametrize("split", ["exponent", "byte", "window"])
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
    assert bytes(numcodecs.get_codec(c.get_config()).encode(x)) == bytes(enc)


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


@pytest.mark.parametrize("cfg", [{}, {"split": "window", "row": 40}])
def test_plain_zarr_reads_an_array_written_with_it_through_the_entry_point(tmp_path, cfg):
    """Written here (our module imported); read in a fresh interpreter that imports zarr alone:
    zarr finds the codec by the package's entry point."""
    import zarr
    x = every_kind_of_bf16(64 * 40)[:64 * 40].reshape(64, 40)
    a = zarr.create_array(str(tmp_path / "a.zarr"), shape=x.shape, chunks=(16, 40), dtype="uint16",
                          compressors=[BF16PlanesCodec(level=1, **cfg)], filters=None)
    a[:] = x
    np.save(tmp_path / "want.npy", x)
    code = ("import sys, numpy as np, zarr; assert 'shared.planes' not in sys.modules; "
            "a = zarr.open_array(sys.argv[1], mode='r'); "
            "assert np.array_equal(a[:], np.load(sys.argv[2])); print(a.metadata.codecs)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a.zarr"), str(tmp_path / "want.npy")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "dflash.bf16_planes" in r.stdout or "BF16PlanesCodec" in r.stdout


def features_like(rows=64, layers=3, hidden=40, seed=1):
    """bf16 bits shaped like hidden states: each (layer, channel) its own scale, a few huge
    values (massive activations) and exact zeros, which fall out of a column's window."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.standard_normal((layers, hidden)) * 1.5)
    x = (rng.standard_normal((rows, layers, hidden)) * scale).astype(np.float32)
    x[0, :, :3] *= 3000.0
    x[rng.integers(0, rows, 20), rng.integers(0, layers, 20), rng.integers(0, hidden, 20)] = 0.0
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def window_reference(bits: np.ndarray, row: int):
    """The window split's plane A content and escapes, written out value by value from the rule in
    shared/planes.py: rows of zeros at the end are dropped; base = a column's top exponent - 14
    (at least 0); offset = exponent - base; an offset outside 0..14 is an escape (code 15, its
    index and exponent listed)."""
    flat = [int(b) for b in bits.reshape(-1)]
    n = len(flat)
    row = row if row and n % row == 0 else n
    row = row if n else 0
    while flat and not any(flat[-row:]):
        flat = flat[:-row]
    n = len(flat)
    exps = [(b >> 7) & 0xFF for b in flat]
    base = [max(max(exps[i] for i in range(c, n, row)) - 14, 0) if n else 0 for c in range(row)]
    codes, esc_idx, esc_exp = [], [], []
    for i, e in enumerate(exps):
        off = e - base[i % row]
        if 0 <= off <= 14:
            codes.append(off)
        else:
            codes.append(15)
            esc_idx.append(i)
            esc_exp.append(e)
    if n % 2:
        codes.append(0)
    packed = [codes[i] << 4 | codes[i + 1] for i in range(0, len(codes), 2)]
    plane_b = [((b >> 8) & 0x80) | (b & 0x7F) for b in flat]
    return row, n, bytes(base + packed), esc_idx, esc_exp, bytes(plane_b)


@pytest.mark.parametrize("shape,row,zero_rows", [((64, 3, 40), 120, 0), ((64, 3, 40), 120, 20), ((7, 3, 5), 15, 0),
                                                ((9, 1, 3), 3, 2), ((5, 1, 1), 4, 0), ((0, 1, 1), 4, 0),
                                                ((1, 1, 1), 1, 0), ((6, 2, 2), 4, 6), ((4, 1, 3), 0, 1)])
def test_the_window_split_is_the_rule_written_out(shape, row, zero_rows):
    """The encoded chunk against a loop written from the format's description: header, plane A
    (bases, then two 4-bit offsets a byte), escapes, plane B; rows of zeros at the end not stored;
    a row that does not divide the chunk makes the chunk one row; odd counts pad the last offset."""
    import struct
    bits = features_like(*shape) if shape[0] else np.zeros((0, 1, 1), np.uint16)
    if zero_rows:
        bits[-zero_rows:] = 0
    bits = bits.reshape(-1)
    c = BF16Planes(level=1, split="window", row=row)
    enc = bytes(c.encode(bits))
    want_row, want_k, want_a, esc_idx, esc_exp, want_b = window_reference(bits, row)
    magic, version, split, n, m = struct.unpack_from("<2sBBQI", enc)
    got_row, n_esc, k = struct.unpack_from("<III", enc, 16)
    assert (magic, version, split, n, got_row, n_esc, k) == (b"BP", 1, 2, bits.size, want_row, len(esc_idx), want_k)
    from numcodecs.zstd import Zstd
    assert (Zstd(1).decode(enc[28:28 + m]) if m else b"") == want_a
    esc = enc[28 + m:28 + m + 5 * n_esc]
    assert list(np.frombuffer(esc[:4 * n_esc], "<u4")) == esc_idx and list(esc[4 * n_esc:]) == esc_exp
    assert enc[28 + m + 5 * n_esc:] == want_b
    assert np.array_equal(np.frombuffer(c.decode(enc), np.uint16), bits)


@pytest.mark.parametrize("row", [0, 1, 100, 4096, 50_000])
def test_the_window_split_is_lossless_for_every_bit_pattern(row):
    x = every_kind_of_bf16()[:51_000]  # NaNs, infinities, subnormals, zeros, random bits
    c = BF16Planes(level=1, split="window", row=row)
    enc = c.encode(x)
    assert np.array_equal(np.frombuffer(c.decode(enc), dtype=np.uint16), x)
    out = bytearray(x.nbytes)
    c.decode(enc, out=out)
    assert bytes(out) == x.tobytes()
    import numcodecs
    assert bytes(numcodecs.get_codec(c.get_config()).encode(x)) == bytes(enc)


def test_the_window_split_beats_the_exponent_split_on_features_with_column_scales():
    x = features_like(256, 4, 64)
    window = len(BF16Planes(split="window", row=4 * 64).encode(x))
    exponent = len(BF16Planes(split="exponent").encode(x))
    assert window < 0.97 * exponent and window < 0.75 * x.nbytes


def test_a_window_chunk_with_bad_escapes_is_an_error():
    x = features_like(16, 2, 8)
    c = BF16Planes(split="window", row=16)
    enc = bytearray(c.encode(x))
    import struct
    m = struct.unpack_from("<I", enc, 12)[0]
    n_esc = struct.unpack_from("<I", enc, 20)[0]
    assert n_esc > 0  # the zeros and the tiny values beside the huge ones
    struct.pack_into("<I", enc, 28 + m, 10 ** 6)  # the first escape's index, past the chunk
    with pytest.raises(ValueError, match="past the chunk"):
        c.decode(bytes(enc))
    with pytest.raises(ValueError, match="not a chunk of this codec"):
        c.decode(bytes(enc[:-1]))


def test_a_window_chunk_stores_no_rows_of_zeros_at_its_end():
    """A unit's unused tail: the chunk past it costs a header and a tiny frame, the chunk it ends
    in only its used rows (plane B would keep zeros raw)."""
    c = BF16Planes(split="window", row=120)
    x = features_like(64, 3, 40)
    half = x.copy()
    half[32:] = 0
    zero = np.zeros_like(x)
    full, part, empty = (len(c.encode(a)) for a in (x, half, zero))
    assert empty < 200 and part < 0.6 * full
    for a in (half, zero):
        assert np.array_equal(np.frombuffer(c.decode(c.encode(a)), np.uint16), a.reshape(-1))


@pytest.mark.parametrize("split", SPLITS)
def test_decoding_into_an_output_of_another_size_is_an_error(split):
    """A chunk decoded into a buffer (the shard reader's in-place decode) must fill it exactly:
    one larger or smaller is refused, not left partly written."""
    v = np.arange(64 * 8, dtype=np.uint16).reshape(64, 8)
    c = BF16Planes(1, split, 8)
    e = c.encode(v)
    out = np.full((64, 8), 7, np.uint16)
    c.decode(e, out=out)
    assert np.array_equal(out, v)
    for rows in (63, 65):
        with pytest.raises(ValueError, match="room for"):
            c.decode(e, out=np.empty((rows, 8), np.uint16))

