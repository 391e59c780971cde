"""The loader's shard reader (shared/shards.py) against zarr's own read of the same rows."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from shared import compression as cx
from shared import store as st
from shared.shards import DamagedShard, ShardReader, zstd_content_size
from tests.test_store import _manifest, _unit

SHARD, CHUNK = 256, 64
POOL = ThreadPoolExecutor(3)  # decodes a read's chunks (the loader gives workers a share of the cores)


def _slices(rng, rows: int) -> list[tuple[int, int]]:
    """Every kind of slice: within a chunk, across chunks and shards, whole shards, the unit never
    written, empty, the last rows, and random ones."""
    fixed = [(0, 1), (0, CHUNK), (5, 9), (60, 70), (63, 64), (64, 128), (200, 300), (0, SHARD), (SHARD, 2 * SHARD),
             (250, 2 * SHARD + 3), (0, rows), (rows - 1, rows), (100, 100), (rows, rows)]
    rand = [tuple(sorted(rng.integers(0, rows + 1, 2))) for _ in range(40)]
    return fixed + rand


def _write(w: st.StoreWriter, by_zarr: bool) -> dict[int, dict[str, np.ndarray]]:
    """Units 0 and 2 of every token-axis array (unit 1 never written): feature arrays through the
    store's shard encoder or through zarr, token arrays through zarr."""
    units = {u: _unit(w.layout, u) for u in (0, 2)}
    rng = np.random.default_rng(7)
    for u, arrays in units.items():
        if by_zarr:
            for name, a in arrays.items():
                w.feature_array(name)[u * SHARD:(u + 1) * SHARD] = a
        else:
            assert st.write_unit(w, u, arrays, {})
        for name in ("tokens/input_ids", "tokens/loss_mask"):
            arr = w.root[name]
            a = rng.integers(0, 2 if "mask" in name else 1000, (SHARD, *arr.shape[1:])).astype(arr.dtype)
            arr[u * SHARD:(u + 1) * SHARD] = a
    return units


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("codec", cx.CODECS)
@pytest.mark.parametrize("by_zarr", [False, True], ids=["encoder", "zarr"])
def test_reader_returns_what_zarr_reads(tmp_path, precision, codec, by_zarr):
    """Every token-axis array, every codec, shards written by our encoder or by zarr: any slice
    read straight from the shards, in the calling thread or with its chunks decoded on a pool,
    equals zarr's read of it, dtype included."""
    w = st.create(tmp_path / "s", _manifest(precision, codec, 3, SHARD, CHUNK))
    _write(w, by_zarr)
    w.publish()
    s = st.Store(tmp_path / "s", require_complete=False)
    rng = np.random.default_rng(0)
    for name in w.layout.arrays():  # every token-axis array of the layout
        arr = s.array(name)
        r = ShardReader.for_array(s.loc, name, arr)
        assert r is not None, name
        r.pool_min_bytes = 0  # the pool for chunks of any size
        for lo, hi in _slices(rng, arr.shape[0]):
            want = arr[lo:hi]
            for got in (r.read(lo, hi), r.read(lo, hi, POOL)):
                assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want), (name, lo, hi)


def test_store_read_equals_the_zarr_path(store, monkeypatch):
    """Store.read (what the loader calls) gives the same samples with the reader as through zarr,
    with all layers, a subset out of order, and without features or log-probabilities."""
    direct = st.Store(store)
    for name in direct.layout.arrays():
        direct.rows(name, 0, 0)  # its readers made before for_array is patched away
    monkeypatch.setattr(ShardReader, "for_array", classmethod(lambda cls, loc, name, arr: None))
    via_zarr = st.Store(store)
    L = direct.layer_ids
    for i in range(len(direct)):
        for kw in ({}, {"layer_ids": [L[-1], L[0]]}, {"features": False, "logprobs": False}):
            a, b = direct.read(i, **kw), via_zarr.read(i, **kw)
            for f in ("input_ids", "loss_mask", "hidden", "topk_idx", "topk_logp", "lse"):
                assert getattr(a, f).dtype == getattr(b, f).dtype and getattr(a, f).equal(getattr(b, f)), (i, kw, f)
    assert direct._readers and [n for n, r in direct._readers.items() if r is None] == []
    assert all(r is None for r in via_zarr._readers.values())


def test_damaged_bytes_are_an_error_naming_the_shard_and_chunk(tmp_path):
    w = st.create(tmp_path / "s", _manifest("bf16", "zstd1", 1, 128, 64))
    arrays = _unit(w.layout, 0)
    st.write_unit(w, 0, arrays, {})
    w.publish()
    name = "features/hidden"
    key = f"{name}/" + w.feature_array(name).metadata.encode_chunk_key((0, 0, 0))
    good = w.loc.read(key)
    b = bytearray(good)
    b[10] ^= 0xFF  # in chunk 0
    w.loc.write(key, bytes(b))
    s = st.Store(tmp_path / "s", require_complete=False)
    r = ShardReader.for_array(s.loc, name, s.array(name))
    r.pool_min_bytes = 0
    assert np.array_equal(r.read(64, 128), arrays[name][64:])  # the other chunk is intact
    with pytest.raises(DamagedShard, match=r"features/hidden, shard 0, chunk 0: crc32c mismatch"):
        r.read(0, 64)
    with pytest.raises(DamagedShard, match=r"features/hidden, shard 0, chunk 0: crc32c mismatch"):
        r.read(0, 128, POOL)  # decoded on threads: the damaged chunk's error, not the good one's rows
    b = bytearray(good)
    b[-6] ^= 0xFF  # in the index
    w.loc.write(key, bytes(b))
    r = ShardReader.for_array(s.loc, name, s.array(name))
    with pytest.raises(DamagedShard, match=r"features/hidden, shard 0: its index is damaged"):
        r.read(0, 1)
    w.loc.write(key, good[:-200])  # truncated: the index is read from the end, so it is damaged too
    r = ShardReader.for_array(s.loc, name, s.array(name))
    with pytest.raises(DamagedShard, match="index is damaged"):
        r.read(0, 1)


def test_arrays_it_does_not_know_are_read_through_zarr(tmp_path):
    """An array without sharding (the index arrays of a small store) gets no reader, and
    Store.rows reads it through zarr."""
    w = st.create(tmp_path / "s", _manifest("bf16", "zstd1", 1, 128, 64))
    w.publish()
    s = st.Store(tmp_path / "s", require_complete=False)
    assert ShardReader.for_array(s.loc, "index/offset", s.array("index/offset")) is None
    assert ShardReader.for_array(w.loc, "tokens/input_ids", w.root["tokens/input_ids"]) is not None


def test_reader_on_object_storage(s3):
    """The same on a real S3 server (ranged GETs and a suffix GET for the index)."""
    url = s3.url("stores/shard-reader")
    w = st.create(url, _manifest("bf16", "zstd1", 3, SHARD, CHUNK))
    _write(w, by_zarr=False)
    w.publish()
    s = st.Store(url, require_complete=False)
    rng = np.random.default_rng(1)
    for name in w.layout.arrays():
        arr = s.array(name)
        r = ShardReader.for_array(s.loc, name, arr)
        assert r is not None, name
        for lo, hi in _slices(rng, arr.shape[0])[:20]:
            assert np.array_equal(r.read(lo, hi), arr[lo:hi]), (name, lo, hi)


def test_a_shard_written_again_is_read_afresh(tmp_path):
    """A reader that cached a shard's index reads the shard's new bytes after it is written again
    (a unit re-extracted while a store is open), not an error or the old values."""
    w = st.create(tmp_path / "s", _manifest("bf16", "zstd1", 1, 128, 64))
    first, second = _unit(w.layout, 0), _unit(w.layout, 5)
    second["features/hidden"][:] = second["features/hidden"][::-1]  # other chunk lengths
    st.write_unit(w, 0, first, {})
    w.publish()
    s = st.Store(tmp_path / "s", require_complete=False)
    assert np.array_equal(s.rows("features/hidden", 0, 128), first["features/hidden"])
    st.write_unit(w, 0, second, {})
    assert np.array_equal(s.rows("features/hidden", 0, 128), second["features/hidden"])


def test_the_environment_switch_sends_every_read_through_zarr(store, monkeypatch):
    """DFLASH_SHARD_READER=0: no array gets a reader (a baseline for benchmarks, a fallback for a
    storage the reader would mishandle), and samples read the same."""
    direct = st.Store(store)
    monkeypatch.setenv("DFLASH_SHARD_READER", "0")
    via_zarr = st.Store(store)
    for i in range(min(3, len(direct))):
        a, b = direct.read(i), via_zarr.read(i)
        assert a.hidden.equal(b.hidden) and a.input_ids.equal(b.input_ids)
    assert via_zarr._readers and all(r is None for r in via_zarr._readers.values())


def test_loader_workers_share_the_cores(store, monkeypatch):
    """Each reading process decodes on its rank's share of the cores over the loader's readers
    (1 to 8 threads), and the workers' stores get that count."""
    from train import loader
    monkeypatch.setattr(loader.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert [loader.decode_threads(w) for w in (0, 1, 4, 12, 32)] == [8, 8, 4, 1, 1]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert [loader.decode_threads(w) for w in (0, 2, 4)] == [8, 4, 2]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    ds = loader.RowDataset(str(store), [], loader.RowSpec((0,), 8, 1, 0), 0)
    loader.make_loader(ds, 1, 0, 2, False)
    assert ds.decode_threads == 2 and ds.store.decode_threads == 2
    assert ds.store._decode_pool()._max_workers == 2


def test_the_zstd_frame_header_gives_the_decoded_size():
    """What decoding a chunk into a kept buffer checks first (numcodecs' zstd fills a larger
    buffer's start without a word): every width of the header's size field, as numcodecs writes."""
    from numcodecs.zstd import Zstd
    rng = np.random.default_rng(0)
    for n in (1, 255, 256, 300, 65_791, 65_792, 70_000, 3_276_800):
        for data in (np.zeros(n, np.uint8), rng.integers(0, 256, n, dtype=np.uint8)):
            assert zstd_content_size(Zstd(level=1).encode(data)) == n, n
    assert zstd_content_size(b"\x00" * 16) is None


@pytest.mark.parametrize("codec", ["zstd1", "bf16-window"])
def test_a_chunk_of_another_size_is_an_error(tmp_path, codec):
    """A chunk that decodes to another size than the array's chunks (a store written with another
    layout) is an error naming it, never a kept buffer's stale bytes."""
    w = st.create(tmp_path / "s", _manifest("bf16", codec, 1, 128, 64))
    st.write_unit(w, 0, _unit(w.layout, 0), {})
    w.publish()
    s = st.Store(tmp_path / "s", require_complete=False)
    name = "features/hidden"
    r = ShardReader.for_array(s.loc, name, s.array(name))
    r.read(0, 64)  # a chunk-sized buffer kept by this thread
    r.chunk_bytes += 2  # as if the array's chunks were larger than the ones stored
    with pytest.raises(DamagedShard, match=r"chunk 0: "):
        r.read(0, 64)
