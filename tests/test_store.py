"""The store's own shard encoder against zarr's write of the same data."""

from __future__ import annotations

import numpy as np
import pytest

from shared import compression as cx
from shared import schema as sc
from shared import store as st


def _manifest(precision: str, codec: str, n_units: int, shard: int, chunk: int, L: int = 2, H: int = 48,
              K: int = 4) -> sc.Manifest:
    m = sc.Manifest(
        target=sc.TargetInfo(path="none", model_type="qwen3_5_text", num_hidden_layers=L, hidden_size=H,
                             vocab_size=1000, layer_types=None, weights_fingerprint="", tensors_fingerprint="",
                             config={}),
        tokenizer=sc.TokenizerInfo(fingerprint="", size=1000, pad_token_id=0, eos_token_id=None, mask_token_id=None),
        data=sc.DataInfo(spec="test", files=[], report={}),
        layer_ids=list(range(L)), layer_convention="", precision=precision, codec=codec, topk=K, max_len=shard,
        too_long="truncate", chat_template_kwargs={}, run_key={})
    m.layout = sc.Layout(n_layers=L, hidden=H, topk=K, precision=precision, codec=codec, shard_tokens=shard,
                         chunk_tokens=chunk, n_units=n_units, n_samples=1)
    return m


def _unit(layout: sc.Layout, seed: int) -> dict[str, np.ndarray]:
    """Feature arrays shaped like a unit's, hidden-state-like values, a zero tail (unused tokens)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, dtype) in layout.arrays().items():
        if name not in sc.FEATURE_ARRAYS:
            continue
        x = rng.standard_normal((layout.shard_tokens, *shape)).astype(np.float32)
        if np.dtype(dtype) == np.uint16:
            a = (x.view(np.uint32) >> 16).astype(np.uint16)  # bf16 bits
        elif np.dtype(dtype) == np.uint8:
            a = rng.integers(0, 256, x.shape, dtype=np.uint8)
        elif np.dtype(dtype).kind == "i":
            a = rng.integers(0, 1000, x.shape).astype(dtype)
        else:
            a = x.astype(dtype)
        a[-layout.shard_tokens // 3:] = 0
        out[name] = a
    return out


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("codec", cx.CODECS)
def test_shard_encoder_writes_the_bytes_zarr_writes(tmp_path, precision, codec):
    """Every feature shard that write_unit writes is byte for byte the shard zarr writes for the
    same data (so zarr reads it, checksums and all), for every codec and both precisions, and
    reads back equal."""
    shard, chunk = 256, 64
    ours = st.create(tmp_path / "ours", _manifest(precision, codec, 3, shard, chunk))
    ref = st.create(tmp_path / "ref", _manifest(precision, codec, 3, shard, chunk))
    layout = ours.layout
    units = {u: _unit(layout, u) for u in (0, 2)}
    for u, arrays in units.items():
        assert st.write_unit(ours, u, arrays, {})
        for name, a in arrays.items():  # zarr's own write, as write_unit did before the encoder
            ref.feature_array(name)[u * shard:(u + 1) * shard] = a
    for name in units[0]:
        assert ours.shard_encoder(name) is not None, name
        for u in units:
            key = f"{name}/" + ours.feature_array(name).metadata.encode_chunk_key((u,) + (0,) * (units[u][name].ndim - 1))
            got, want = ours.loc.read(key), ref.loc.read(key)
            assert got is not None and got == want, (name, u)
        back = ours.feature_array(name)[:]
        for u, arrays in units.items():
            assert np.array_equal(back[u * shard:(u + 1) * shard], arrays[name]), (name, u)
        assert not back[shard:2 * shard].any()  # the unit not written reads as zeros


def test_a_corrupt_shard_from_the_encoder_is_an_error_when_read(tmp_path):
    """The encoder's crc32c per chunk is checked by zarr on read, like its own."""
    w = st.create(tmp_path / "s", _manifest("bf16", "zstd1", 1, 128, 64))
    w.publish()
    arrays = _unit(w.layout, 0)
    st.write_unit(w, 0, arrays, {})
    key = "features/hidden/" + w.feature_array("features/hidden").metadata.encode_chunk_key((0, 0, 0))
    b = bytearray(w.loc.read(key))
    b[10] ^= 0xFF
    w.loc.write(key, bytes(b))
    assert np.array_equal(st.Store(tmp_path / "s", require_complete=False).array("features/hidden")[64:],
                          arrays["features/hidden"][64:])  # the other chunk is intact
    with pytest.raises(Exception, match="(?i)checksum|crc"):
        st.Store(tmp_path / "s", require_complete=False).array("features/hidden")[:64]


def test_arrays_the_encoder_does_not_know_are_written_through_zarr(tmp_path, monkeypatch):
    monkeypatch.setattr(cx.ShardEncoder, "for_array", classmethod(lambda cls, arr: None))
    w = st.create(tmp_path / "s", _manifest("fp8", "zstd1", 2, 128, 64))
    arrays = _unit(w.layout, 0)
    assert st.write_unit(w, 1, arrays, {})
    for name, a in arrays.items():
        assert w.shard_encoder(name) is None
        back = w.feature_array(name)[:]
        assert np.array_equal(back[128:], a) and not back[:128].any(), name
