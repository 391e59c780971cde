"""End to end: the store written by extract, read back, resumed, shared by two writers."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
import zarr
import torch

from conftest import extract_cfg, read_all
from extract.claims import Claims
from extract.plan import assign_units
from extract.run import ExtractError, run
from extract.worker import bucket_length
from shared.features import forward_features, pad_batch
from shared import schema as sc
from shared import store as st
from shared.location import as_location
from shared.target import load_target

@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """One uninterrupted single-worker run, one sequence per forward."""
    store = tmp_path_factory.mktemp("ref") / "store"
    summary = run(extract_cfg(tiny, store, max_batch=1))
    return store, summary


def test_assign_units_never_straddles():
    offs, n = assign_units([300, 500, 300, 1000, 24, 1], 1024)
    assert n == 4  # in order: [300, 500] [300] [1000, 24] [1]
    assert offs.tolist() == [0, 300, 1024, 2048, 3048, 3072]
    for o, l in zip(offs, [300, 500, 300, 1000, 24, 1]):
        assert o // 1024 == (o + l - 1) // 1024


def test_round_trip_equals_target_output_bf16_exact(tiny, reference):
    store, summary = reference
    s = st.Store(store)
    assert summary["samples"] == len(s) == len(tiny["rows"]) and summary["skipped"] == {}
    model = load_target(tiny["target"], torch.device("cpu"), torch.float32)
    layer_ids = s.layer_ids
    assert layer_ids == [0, 1, 3]
    for i in (0, 5, len(s) - 1):
        sample = s.read(i)
        # one sample per forward, padded as the worker pads it (to itself by default)
        n = len(sample.input_ids)
        ids, _ = pad_batch([sample.input_ids], 0, bucket_length(n, 0, 1024))
        hidden, idx, logp, lse, ok = forward_features(model, ids, [n], layer_ids, topk=8)
        assert torch.equal(sample.hidden.view(torch.int16), hidden.bfloat16().view(torch.int16))
        assert torch.equal(sample.topk_idx, idx)
        assert torch.equal(sample.lse, lse)
        assert torch.equal(sample.topk_logp, logp.half().float())
        # a layer subset is read without touching the others
        sub = s.read(i, layer_ids=[3, 0])
        assert torch.equal(sub.hidden[:, 0], sample.hidden[:, 2]) and torch.equal(sub.hidden[:, 1], sample.hidden[:, 0])
    with pytest.raises(st.StoreError, match=r"layers \[2\] are not in the store"):
        s.read(0, layer_ids=[0, 2])


def test_index_points_back_to_source_rows(tiny, reference):
    s = st.Store(reference[0])
    tok = tiny["tokenizer"]
    for i in (0, 7):
        row = int(s.array("index/row")[i])
        ids, mask = s.tokens(i)
        text = tok.decode(ids[mask.astype(bool)])  # the assistant turn, cut at max_len if too long
        assert len(text) > 20 and (tiny["rows"][row]["messages"][1]["content"] + "<|im_end|>").startswith(text)


def test_fp8_within_documented_error(tiny, reference, tmp_path):
    store = tmp_path / "fp8"
    run(extract_cfg(tiny, store, max_batch=1, precision="fp8"))
    a, b = st.Store(reference[0]), st.Store(store)
    assert b.manifest.precision == "fp8"
    for i in (0, 3):
        x, y = a.read(i).hidden.float(), b.read(i).hidden
        assert y.dtype == torch.bfloat16
        amax = x.abs().amax(-1, keepdim=True)
        # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormals below
        # amax/448 * 2^-6 have absolute error <= amax/448 * 2^-9; plus bf16 output rounding 2^-8.
        bound = x.abs() * (2 ** -4 + 2 ** -8) + amax / 448 * 2 ** -9 + 1e-6
        assert ((y.float() - x).abs() <= bound).all()
        assert torch.equal(a.read(i).topk_idx, b.read(i).topk_idx)
    assert b.disk_bytes() < a.disk_bytes()


def test_two_workers_write_one_store_identically(tiny, long_corpus, tmp_path):
    corpus, reference = long_corpus
    store = tmp_path / "two"
    run(extract_cfg(tiny, store, data=str(corpus), max_batch=1, cpu_workers=2))
    done = st.done_units(store)
    assert {m["rank"] for m in done.values()} == {0, 1}  # both workers really wrote
    ref, got = read_all(reference), read_all(store)
    assert ref.keys() == got.keys()
    for k in ref:
        assert np.array_equal(ref[k], got[k]), k


def test_writer_processes_write_the_same_store(tiny, reference, tmp_path):
    """Units written by writer processes from the shared pool equal the in-process writers' bit for
    bit, the processes run at the niceness asked, and a writer process's failure comes back as the
    worker's error, naming the unit."""
    import os

    from extract.writers import UnitWriters
    store = tmp_path / "procs"
    run(extract_cfg(tiny, store, max_batch=1, writer_procs="on", writers=2))
    ref, got = read_all(reference[0]), read_all(store)
    assert ref.keys() == got.keys()
    for k in ref:
        assert np.array_equal(ref[k], got[k]), k
    w = UnitWriters(str(store), st.Store(store).layout, 1, procs=True, extra=0, pin=False, nice=3)
    w.wait_ready()  # the process lowers its priority before it says it is ready
    assert os.getpriority(os.PRIO_PROCESS, w._procs[0].proc.pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 3)
    buf = w.pool.get(10 ** 6, 1, 1)  # no such unit: the store refuses it in the writer process
    w.submit(buf)
    w.close()
    assert isinstance(w.error, RuntimeError) and "unit 1000000" in str(w.error)


def test_writer_processes_compress_on_their_share_of_the_cores(tiny, reference):
    """Each writer process compresses a unit's chunks on the cores the writers have (cores - 2)
    over the writers, 1 to 8 threads; writer threads share one pool (0: min(8, cores))."""
    from extract.worker import encode_threads, writer_count
    cfg = extract_cfg(tiny, "unused")
    assert [encode_threads(16, writer_count(cfg, 16, True), True), encode_threads(16, 14, True),
            encode_threads(16, 1, True), encode_threads(64, 4, True), encode_threads(3, 1, True)] == [2, 1, 8, 8, 2]
    assert encode_threads(16, 8, False) == 0
    assert st.StoreWriter(reference[0], encode_threads=3).pool._max_workers == 3


def test_a_shared_pool_that_does_not_fit_is_a_clear_error(tiny, reference, monkeypatch):
    import errno
    import os

    from extract.writers import UnitPool
    opened = []
    real_memfd = os.memfd_create
    monkeypatch.setattr(os, "memfd_create", lambda *a: opened.append(real_memfd(*a)) or opened[-1])

    def full(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"3 unit buffers of .* GiB do not fit in memory .*fewer --writers") as e:
        UnitPool(st.Store(reference[0]).layout, 3, pin=False, shared=True)
    assert e.value.errno == errno.ENOMEM  # not ENOSPC: the run would report a full disk
    with pytest.raises(OSError):  # the memory file was closed, not leaked
        os.fstat(opened[0])


@pytest.mark.parametrize("kw", [dict(), dict(buckets_per_octave=8), dict(buckets_per_octave=8, pow2_batch=True)],
                         ids=["exact-lengths", "buckets", "buckets+pow2"])
def test_batched_store_matches_single_to_bf16_rounding(tiny, reference, tmp_path, kw):
    store = tmp_path / "batched"
    run(extract_cfg(tiny, store, max_batch=16, **kw))
    a, b = st.Store(reference[0]), st.Store(store)
    for i in range(len(a)):
        x, y = a.read(i), b.read(i)
        diff = (x.hidden.float() - y.hidden.float()).abs()
        # one bf16 ulp, plus fp32 reordering noise relative to the sample's magnitude
        assert (diff <= x.hidden.float().abs() * 2 ** -7 + 1e-5 * x.hidden.float().abs().amax()).all(), i
        assert torch.equal(x.input_ids, y.input_ids)


def test_interrupted_planning_leaves_no_store(tiny, reference, tmp_path, monkeypatch):
    """A planner that dies after writing part of its plan leaves a store that refuses to be read;
    a rerun takes the dead planner's claim over at once (its pid is gone) and plans again."""
    store = tmp_path / "s"
    real = st.StoreWriter.write_index

    def crash(*a, **kw):
        raise KeyboardInterrupt("killed while planning")

    monkeypatch.setattr(st.StoreWriter, "write_index", crash)
    with pytest.raises(KeyboardInterrupt):
        run(extract_cfg(tiny, store, max_batch=1))
    assert st.store_state(store)[0] == "planning"
    with pytest.raises(st.StoreError, match="still planning"):
        st.Store(store, require_complete=False)
    # the planner's claim as a process killed with -9 leaves it: held, unexpired, its pid dead
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    claims = Claims(as_location(store))
    rec = json.loads(claims._record(time.time() + 3600))
    (store / "_claims").mkdir(exist_ok=True)
    (store / "_claims" / "plan.json").write_text(json.dumps({**rec, "pid": int(dead.stdout)}))
    monkeypatch.setattr(st.StoreWriter, "write_index", real)
    run(extract_cfg(tiny, store, max_batch=1))
    assert st.Store(store).manifest.complete and not (store / "_claims").exists()
    ref, got = read_all(reference[0]), read_all(store)
    assert all(np.array_equal(ref[k], got[k]) for k in ref)


def test_resume_with_other_settings_refuses_and_leaves_store_intact(tiny, reference, tmp_path):
    import shutil
    store = tmp_path / "copy"
    shutil.copytree(reference[0], store)
    before = read_all(store)
    with pytest.raises(ExtractError, match=r"topk: store has 8, asked 4"):
        run(extract_cfg(tiny, store, max_batch=1, topk=4))
    other = tmp_path / "other.jsonl"
    other.write_text(tiny["corpus"].read_text().splitlines()[0] + "\n")
    with pytest.raises(ExtractError, match="DATA files differ"):
        run(extract_cfg(tiny, store, data=str(other)))
    after = read_all(store)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_nan_sample_dropped_and_named(tiny, tmp_path, monkeypatch, capsys):
    import extract.worker as w
    real = w.forward_features
    calls = {"n": 0}

    def poisoned(*a, **kw):
        hidden, idx, logp, lse, ok = real(*a, **kw)
        calls["n"] += 1
        if calls["n"] == 3:  # third forward = one sample (max_batch=1)
            hidden[0, 0, 0] = float("nan")
            ok[:] = False
        return hidden, idx, logp, lse, ok

    monkeypatch.setattr(w, "forward_features", poisoned)
    store = tmp_path / "nan"
    summary = run(extract_cfg(tiny, store, max_batch=1))
    assert summary["skipped"] == {"nan_features": 1}
    assert summary["samples"] == len(tiny["rows"]) - 1
    ok = st.Store(store).array("index/ok")[:]
    assert ok.sum() == len(ok) - 1
    err = capsys.readouterr().err
    assert "NaN/inf features" in err and "chat.jsonl row" in err


def test_verify_passes_and_catches_corruption(tiny, reference, tmp_path):
    import shutil
    from extract.inspect import main as inspect_main, verify
    store = tmp_path / "v"
    shutil.copytree(reference[0], store)
    assert verify(str(store), progress=False) == []
    assert inspect_main([str(store)]) == 0
    # Overwrite one unit's hidden states with other values through zarr: decodes fine, checksum differs.
    g = zarr.open_group(str(store), mode="r+")
    S = st.Store(store).layout.shard_tokens
    g["features/hidden"][S:S + 10] = 7
    problems = verify(str(store), progress=False)
    assert any("unit 1: features/hidden checksum" in p for p in problems)
    (store / "_progress" / "unit-0000000.json").unlink()
    assert any("unit 0: not written" in p for p in verify(str(store), progress=False))


def test_opening_a_store_reads_no_per_sample_data(tmp_path, monkeypatch):
    """Opening cost does not grow with the sample count: a 10M-sample store opens without any
    index chunk existing on disk, and one sample's index is read a chunk at a time."""
    lay = sc.Layout(n_layers=2, hidden=8, topk=2, precision="bf16", codec="zstd1", shard_tokens=1024,
                    chunk_tokens=64, n_units=1, n_samples=10_000_000)
    path = tmp_path / "big"
    man = sc.Manifest(
        target=sc.TargetInfo("t", "qwen3_5_text", 4, 8, 16, None, "", "", {}),
        tokenizer=sc.TokenizerInfo("", 16, 0, None, None), data=sc.DataInfo("d", []), layer_ids=[0, 1],
        layer_convention="", precision="bf16", codec="zstd1", topk=2, max_len=1024, too_long="truncate",
        chat_template_kwargs={}, run_key={}, layout=lay)
    st.create(path, man).finish({}, "now")
    reads = []
    real = st.Store.array

    def spy(self, name):
        reads.append(name)
        return real(self, name)

    monkeypatch.setattr(st.Store, "array", spy)
    s = st.Store(path)
    assert len(s) == 10_000_000 and reads == []
    assert not any(p.is_file() for p in (path / "index").rglob("c/*"))  # no index chunk written at all
    assert s.span(9_999_999) == (0, 0)  # fill values: one chunk of each index array, nothing else
    assert set(reads) == {"index/offset", "index/length"}


def test_plain_qwen3_target(tiny, tmp_path):
    """The non-hybrid family member (model type qwen3) goes through the same extraction."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    path = tmp_path / "qwen3"
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tiny["tokenizer"].save_pretrained(path)
    store = tmp_path / "store"
    run(extract_cfg(tiny, store, target=str(path), layer_ids=[0, 2], max_batch=1))
    s = st.Store(store)
    assert s.manifest.target.model_type == "qwen3" and s.layout.n_layers == 2
    model = load_target(path, torch.device("cpu"), torch.float32)
    x = s.read(4)
    ids = x.input_ids[None]
    hidden, *_ = forward_features(model, ids, [ids.shape[1]], [0, 2], topk=8)
    assert torch.equal(x.hidden.view(torch.int16), hidden.bfloat16().view(torch.int16))


def test_wrong_layer_count_is_an_error_not_a_broadcast(tiny, tmp_path, monkeypatch):
    """A copy of (n, 1, H) features into an (n, 3, H) buffer would broadcast silently."""
    import extract.worker as w
    real = w.forward_features

    def one_layer(*a, **kw):
        hidden, *rest = real(*a, **kw)
        return (hidden[:, :1], *rest)

    monkeypatch.setattr(w, "forward_features", one_layer)
    with pytest.raises(RuntimeError, match=r"features/hidden of shape \(1, 64\) for a store of \(3, 64\)"):
        run(extract_cfg(tiny, tmp_path / "s"))
    assert not st.done_units(tmp_path / "s")


def test_a_target_that_fails_to_load_stops_the_writers_made_beside_it(tiny, tmp_path, monkeypatch):
    """The unit buffers and writer processes are made on a thread while the target loads: when the
    load fails, its error is the run's, and the writer processes made meanwhile are stopped."""
    import multiprocessing

    import extract.worker as w

    def broken(*a, **kw):
        raise OSError("target weights unreadable")

    monkeypatch.setattr(w, "load_target", broken)
    with pytest.raises(OSError, match="target weights unreadable"):
        run(extract_cfg(tiny, tmp_path / "s", writer_procs="on", writers=2))
    assert not multiprocessing.active_children()
    assert not st.done_units(tmp_path / "s")
