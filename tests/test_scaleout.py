"""Beyond one process: the store on a real S3 server (SeaweedFS on 127.0.0.1), kill -9 and
resume (there and on a local disk), concurrent runs sharing one store through claims, and two torchrun agents
(--nnodes 2) extracting into one store and training from it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_trained_alike, extract_cfg, finish_groups, read_all, start_group, tcfg
from extract.inspect import main as inspect_main, verify
from extract.run import run
from shared import store as st
from shared.location import as_location

REPO = Path(__file__).resolve().parents[1]


def _cmd(tiny, store, *extra, module=("-m", "extract")):
    return [*module, "--data", str(tiny["corpus"]), "--target", str(tiny["target"]), "--store", str(store),
            "--layers", "0,1,3", "--max-len", "256", "--shard-tokens", "1024", "--batch-tokens", "1024",
            "--max-batch", "1", "--topk", "8", "--no-progress", *extra]


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _same(a, b):
    ref, got = read_all(a), read_all(b)
    assert ref.keys() == got.keys()
    for k in ref:
        assert np.array_equal(ref[k], got[k]), k


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(port: int, *args) -> list[str]:
    """One torchrun agent of a two-node job whose rendezvous is on 127.0.0.1:port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=job{port}", *args]


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """One uninterrupted single-worker run on a local disk, one sequence per forward."""
    store = tmp_path_factory.mktemp("ref") / "store"
    run(extract_cfg(tiny, store, max_batch=1))
    return store


@pytest.fixture(scope="module")
def s3_store(tiny, s3):
    url = s3.url("stores/plain")
    run(extract_cfg(tiny, url, max_batch=1))
    return url


def test_s3_store_equals_local_and_verifies(reference, s3_store, capsys):
    _same(reference, s3_store)
    assert verify(s3_store, progress=False) == []
    assert inspect_main([s3_store]) == 0
    out = capsys.readouterr().out
    assert s3_store in out and "complete" in out
    loc = as_location(s3_store)
    assert not loc.list(st.CLAIMS + "/")  # claims live only while the store is being made
    assert st.Store(s3_store).disk_bytes() == loc.size() > 0


@pytest.mark.parametrize("where", ["local", "s3"])
def test_kill_9_then_resume_equals_uninterrupted(tiny, reference, tmp_path, where, request):
    url = str(tmp_path / "killed") if where == "local" else request.getfixturevalue("s3").url("stores/killed")
    n_units = st.Store(reference).layout.n_units
    proc = subprocess.Popen([sys.executable, *_cmd(tiny, url)], cwd=REPO, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and len(st.done_unit_ids(url)) < 2:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    n_done = len(st.done_unit_ids(url))
    assert 0 < n_done < n_units, "the kill must land part-way"
    with pytest.raises(st.StoreError, match="not complete"):
        st.Store(url)
    # the killed process's claims are still there, unexpired: the rerun takes them over at once
    # because their holder's pid is gone
    assert as_location(url).list(st.CLAIMS + "/")
    t0 = time.time()
    res = subprocess.run([sys.executable, *_cmd(tiny, url)], cwd=REPO, env=_env(), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "resuming" in res.stderr and time.time() - t0 < 100  # not the 120 s lease
    _same(reference, url)
    assert not as_location(url).list(st.CLAIMS + "/")
    # a third run finds nothing to do
    res = subprocess.run([sys.executable, *_cmd(tiny, url)], cwd=REPO, env=_env(), capture_output=True, text=True)
    assert res.returncode == 0 and "already complete" in res.stderr


@pytest.mark.parametrize("where", ["local", "s3"])
def test_two_concurrent_runs_share_the_units(tiny, long_corpus, tmp_path, where, request):
    """The same command started twice at once (as on two nodes): one plans, both compute units,
    each unit is written by one of them, the store equals the one-worker store."""
    corpus, reference = long_corpus
    store = str(tmp_path / "s") if where == "local" else request.getfixturevalue("s3").url(f"stores/{tmp_path.name}")
    cmd = _cmd({**tiny, "corpus": corpus}, store)
    procs = [start_group([sys.executable, *cmd]) for _ in range(2)]
    errs = finish_groups(procs)
    assert [p.returncode for p in procs] == [0, 0], errs
    _same(reference, store)
    owners = {m["by"] for m in st.done_units(store).values()}
    assert len(owners) == 2, owners  # both runs really computed units
    assert not as_location(store).list(st.CLAIMS + "/")


def test_two_torchrun_nodes_extract_into_one_s3_store(tiny, long_corpus, s3):
    corpus, reference = long_corpus
    url = s3.url("stores/torchrun")
    port = _free_port()
    agents = [start_group(_torchrun(port, *_cmd({**tiny, "corpus": corpus}, url))) for _ in range(2)]
    errs = finish_groups(agents)
    assert [a.returncode for a in agents] == [0, 0], [e[-3000:] for e in errs]
    _same(reference, url)
    done = st.done_units(url)
    assert {m["rank"] for m in done.values()} == {0, 1}  # RANK of each node's process
    assert not as_location(url).list(st.CLAIMS + "/")


def test_two_torchrun_nodes_train_from_s3_like_one_process_with_accumulation(reference, s3_store, draft, tmp_path):
    """Two agents (--nnodes 2, gloo) reading the store from S3 = one process with 2-step
    accumulation reading it from a local disk (the same tolerances as the one-host test)."""
    from train.loop import train
    one = train(tcfg(reference, draft, tmp_path / "one", seq_len=512, grad_accum=2, seed=3))
    port = _free_port()
    args = ["-m", "train", "--store", s3_store, "--out", str(tmp_path / "two"), "--draft", str(draft),
            "--seq-len", "512", "--max-anchors", "16", "--epochs", "1", "--lr", "3e-3", "--seed", "3",
            "--workers", "1", "--loss-chunk", "64", "--log-every", "2", "--no-progress"]
    agents = [start_group(_torchrun(port, *args)) for _ in range(2)]
    errs = finish_groups(agents, timeout=300)
    assert [a.returncode for a in agents] == [0, 0], [e[-3000:] for e in errs]
    assert one["step"] > 0
    assert_trained_alike(tmp_path / "one", tmp_path / "two", one["step"])


@pytest.mark.parametrize("where", ["local", "s3"])
def test_claims_one_winner_takeover_and_loss(tmp_path, where, request):
    """The primitives under every claim, on both kinds of location: of 8 concurrent takers of a
    free claim exactly one wins; a live claim is refused; of 8 concurrent takers of an expired
    claim exactly one wins; the old holder learns it lost, so it no longer holds it."""
    from concurrent.futures import ThreadPoolExecutor
    from extract.claims import Claims
    url = str(tmp_path / "c") if where == "local" else request.getfixturevalue("s3").url(f"claims/{tmp_path.name}")
    loc = as_location(url)
    loc.prepare()
    loc.write(f"{st.CLAIMS}/warm-up", b"")  # SeaweedFS's first write to a new folder can take seconds

    def race(name, lease):
        takers = [Claims(loc, lease_s=lease) for _ in range(8)]
        with ThreadPoolExecutor(8) as ex:
            won = list(ex.map(lambda c: c.take(name), takers))
        return [c for c, w in zip(takers, won) if w]

    winners = race("unit-0000001", lease=5.0)
    assert len(winners) == 1
    old = winners[0]
    assert old.holds("unit-0000001")
    assert not Claims(loc, lease_s=5.0).take("unit-0000001")  # live: refused
    time.sleep(max(0.0, old.held["unit-0000001"].until - time.time()) + 0.2)  # the holder stops renewing: its lease runs out
    assert not old.holds("unit-0000001")  # and it knows, without asking the store
    winners = race("unit-0000001", lease=30.0)
    assert len(winners) == 1
    old.renew()
    assert "unit-0000001" not in old.held  # the renewal failed: lost to the new holder
    assert loc.read(f"{st.CLAIMS}/unit-0000001.json") is not None
    winners[0].release("unit-0000001")
    assert loc.read(f"{st.CLAIMS}/unit-0000001.json") is None
