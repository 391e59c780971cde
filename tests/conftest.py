"""Shared fixtures: a tiny hybrid target and a small chat corpus, built once per test session."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]


def start_group(cmd: list[str], **env) -> subprocess.Popen:
    """A process (torchrun, a CLI) in its own process group, faulthandler on, so a hang can be
    made to print every thread's stack (finish_groups)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **env}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...); None once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_tree(pid: int) -> list[int]:
    """pid and every process below it, from /proc's parent links. A process group is not enough:
    torchrun starts each rank in a session of its own, so signalling torchrun's group left the
    ranks running, holding the stderr pipe, with their stacks unprinted."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        if (fields := proc_stat(int(d.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo.extend(children.get(out[-1], []))
    return out


def _signal(pids: list[int], sig: int):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def finish_groups(procs: list[subprocess.Popen], timeout: float = 300) -> list[str]:
    """Wait for every process; their stderr. If they are not done by the timeout, every process
    below each of them is sent SIGABRT (faulthandler prints where each thread was) and the test
    fails with those stacks; nothing is left running either way."""
    deadline, errs, trees = time.time() + timeout, [], {}
    try:
        for p in procs:
            errs.append(p.communicate(timeout=max(1.0, deadline - time.time()))[1] or "")
    except subprocess.TimeoutExpired:
        stacks = []
        trees = {p.pid: process_tree(p.pid) for p in procs if p.poll() is None}  # before any exits
        for tree in trees.values():
            _signal(tree, signal.SIGABRT)
        for p in procs:
            try:
                stacks.append((p.communicate(timeout=20)[1] or "")[-12000:])
            except subprocess.TimeoutExpired:
                stacks.append("(no output 20 s after SIGABRT)")
        raise AssertionError(f"{len(procs)} process group(s) still running after {timeout:.0f} s; their stderr "
                             f"and stacks:\n" + "\n----\n".join(stacks)) from None
    finally:
        for p in procs:
            tree = trees.get(p.pid) or (process_tree(p.pid) if p.poll() is None else [])
            _signal(tree, signal.SIGKILL)
            p.wait()
    return errs


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict:
    """A 4-layer qwen3_5_text target (3 DeltaNet + 1 full attention), hidden 64, and 48 chat rows."""
    from shared.tiny import build_target, build_tokenizer, stdlib_chat_pairs

    root = tmp_path_factory.mktemp("tiny")
    rows = stdlib_chat_pairs(max_source_chars=600)[:48]
    texts = [m["content"] for r in rows for m in r["messages"]]
    tok = build_tokenizer(texts, root / "target", vocab_size=512)
    build_target(tok, root / "target", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                 linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                 linear_value_head_dim=16, initializer_range=0.2)
    corpus = root / "chat.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"target": root / "target", "corpus": corpus, "rows": rows, "tokenizer": tok}


@pytest.fixture(scope="session")
def store(tiny, tmp_path_factory):
    """One default store of the tiny target for the tests that only read it (training, fidelity)."""
    from extract.run import run as extract_run
    path = tmp_path_factory.mktemp("train") / "store"
    extract_run(extract_cfg(tiny, path))
    return path


def extract_cfg(tiny, store: Path, **kw):
    from extract.config import ExtractConfig
    base = dict(data=str(tiny["corpus"]), target=str(tiny["target"]), store=str(store), layer_ids=[0, 1, 3],
                max_len=256, shard_tokens=1024, chunk_tokens=64, batch_tokens=1024, topk=8, progress=False)
    base.update(kw)
    return ExtractConfig(**base)


def read_all(store) -> dict:
    """Every array of a store (a folder or a URL) as numpy, for exact comparisons."""
    from shared.store import Store
    g = Store(store, require_complete=False).root
    out = {}
    for group in ("tokens", "features", "logits", "index"):
        for name, arr in g[group].arrays():
            out[f"{group}/{name}"] = arr[:]
    return out


@pytest.fixture(scope="session")
def long_corpus(tiny, tmp_path_factory):
    """The tiny corpus 8 times over (72 units), so that two workers or runs started together both
    get units before the first is done (with 10, one loading faster took them all), and its
    one-worker store."""
    from extract.run import run
    d = tmp_path_factory.mktemp("long")
    corpus = d / "chat.jsonl"
    corpus.write_text(tiny["corpus"].read_text() * 8)
    store = d / "store"
    run(extract_cfg(tiny, store, data=str(corpus), max_batch=1))
    return corpus, store


@pytest.fixture(scope="session")
def draft(tiny, tmp_path_factory):
    """A 2-layer drafter on target layers [0, 3] (a subset of the store's [0, 1, 3])."""
    from train.config import DrafterConfig
    cfg = DrafterConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                        intermediate_size=128, num_hidden_layers=2, vocab_size=512, num_target_layers=4,
                        target_layer_ids=[0, 3], mask_token_id=tiny["tokenizer"].mask_token_id, block_size=4,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=32)
    path = tmp_path_factory.mktemp("draft") / "config.json"
    path.write_text(json.dumps(cfg.to_hf()))
    return path


def tcfg(store, draft, out, **kw):
    base = dict(store=str(store), out=str(out), draft=str(draft), seq_len=256, max_anchors=16, epochs=1,
                lr=3e-3, log_every=2, save_every=1000, workers=0, progress=False, loss_chunk=64)
    base.update(kw)
    from train.config import TrainConfig
    return TrainConfig(**base)


def params(out: Path) -> dict:
    import torch
    ck = torch.load(out / "checkpoints" / (out / "checkpoints" / "latest").read_text(), weights_only=False)
    return ck["model"]


def history(out: Path) -> list[dict]:
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def assert_trained_alike(one: Path, two: Path, steps: int):
    """Two runs that should be one computation (N ranks vs one rank with N-step accumulation).
    Adam divides by sqrt(v): on an element whose gradient is ~0, float summation-order noise
    between gloo's all-reduce and local accumulation moves the update by a visible fraction of
    lr. So parameters are compared at 1% of one step's size (lr 3e-3), and what the global-batch
    normalisation decides (the pre-clip gradient norm, the loss) tightly."""
    import torch
    p1, p2 = params(one), params(two)
    for k in p1:
        torch.testing.assert_close(p1[k], p2[k], rtol=1e-3, atol=3e-5)
    h1, h2 = history(one)[-1], history(two)[-1]
    assert h1["step"] == h2["step"] == steps
    assert abs(h1["grad_norm"] - h2["grad_norm"]) <= 1e-5 * h1["grad_norm"], (h1["grad_norm"], h2["grad_norm"])
    assert abs(h1["loss"] - h2["loss"]) <= 1e-5 * h1["loss"]


def mask_runs(tok, ids, mask) -> list[str]:
    """The loss-masked tokens of a sequence, decoded run by run."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(int(i))
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3 server on 127.0.0.1 (SeaweedFS) for the whole session, its client settings in
    the environment (inherited by the subprocesses the tests start)."""
    from shared.s3local import S3Server
    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    yield server
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()
