"""Regeneration: the target writes the answers; output is a DATA folder extraction reads; kill -9
and rerun = uninterrupted; the OpenAI engine against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from regenerate.config import RegenConfig, RegenError
from regenerate.run import read_shard, run
from shared.data import encode_all

REPO = Path(__file__).resolve().parents[1]

MULTI = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first question"},
                      {"role": "assistant", "content": "old answer one"}, {"role": "user", "content": "second"},
                      {"role": "assistant", "content": "old answer two"}], "tools": None}
PROMPT_ONLY = {"messages": [{"role": "user", "content": "a prompt with no answer yet"}]}


@pytest.fixture(scope="module")
def data(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("regen") / "d.jsonl"
    rows = [json.dumps(r) for r in tiny["rows"][:10]] + [json.dumps(MULTI), json.dumps(PROMPT_ONLY), "{broken"]
    path.write_text("\n".join(rows) + "\n")
    return path


def cfg(tiny, data, out, **kw):
    base = dict(data=str(data), target=str(tiny["target"]), out=str(out), max_new_tokens=12, shard_rows=4,
                batch_size=4, progress=False)
    base.update(kw)
    return RegenConfig(**base)


def rows_of(out: Path) -> list[dict]:
    return [r for f in sorted(out.glob("part-*.jsonl")) for r in read_shard(f)]


def test_line_separators_inside_the_text_do_not_split_a_row(tiny, tmp_path):
    """U+2028, U+2029 and U+0085 are text to JSON (json.dumps(ensure_ascii=False) writes them raw)
    but line ends to str.splitlines(): the summary once failed on them after every shard was
    written (6,000 ShareGPT prompts on the H100)."""
    path = tmp_path / "d.jsonl"
    odd = {"messages": [{"role": "user", "content": "one\u2028two\u2029three\x85four"}]}
    path.write_text(json.dumps(odd) + "\n" + json.dumps(tiny["rows"][0]) + "\n", encoding="utf-8")
    s = run(cfg(tiny, path, tmp_path / "out"))
    assert s["rows"] == 2 and s["skipped"] == {}
    rows = rows_of(tmp_path / "out")
    assert rows[0]["messages"][0]["content"] == "one\u2028two\u2029three\x85four"
    assert "\u2028" in (tmp_path / "out" / "part-00000.jsonl").read_text(encoding="utf-8")  # raw, as written
    _, enc, _ = encode_all(str(tmp_path / "out"), tiny["tokenizer"], 512, "truncate", progress=False)
    assert len(enc) == 2  # and extraction's reader reads both


def test_local_engine_writes_a_data_folder_extraction_reads(tiny, data, tmp_path):
    out = tmp_path / "out"
    s = run(cfg(tiny, data, out, turns="all"))
    assert s["rows"] == 12 and s["skipped"] == {"malformed_json": 1}
    assert sum(s["finish_reasons"].values()) == 10 + 2 + 1  # the multi-turn row has two turns
    rows = rows_of(out)
    assert [r["meta"]["source"]["row"] for r in rows] == list(range(12))  # every source row once, in order
    meta = rows[0]["meta"]
    assert meta["target"].startswith("sha256:") and meta["generation"]["max_new_tokens"] == 12
    assert meta["finish_reason"] in ("stop", "length") and meta["source"]["file"] == str(data)
    multi = rows[10]["messages"]
    assert [m["role"] for m in multi] == ["system", "user", "assistant", "user", "assistant"]
    assert multi[2]["content"] != "old answer one" and multi[4]["content"] != "old answer two"
    assert multi[3]["content"] == "second"                       # prompt turns kept as they were
    assert [m["role"] for m in rows[11]["messages"]] == ["user", "assistant"]  # the answer appended
    # a DATA folder for extraction: every row encodes, the state file is not read as data
    _, enc, report = encode_all(str(out), tiny["tokenizer"], 512, "truncate", progress=False)
    assert len(enc) + sum(report.skipped.values()) == 12 and not report.skipped.get("malformed_json")


def test_regenerated_answer_is_the_targets_greedy_continuation(tiny, data, tmp_path):
    """Batched, left-padded generation = the target's own greedy decoding of each prompt alone."""
    import torch

    from shared.target import load_target
    out = tmp_path / "out"
    run(cfg(tiny, data, out, batch_size=8))
    model = load_target(tiny["target"], torch.device("cpu"), torch.float32)
    tok = tiny["tokenizer"]
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    for r in rows_of(out)[:3]:
        prompt = tok.apply_chat_template(r["messages"][:-1], tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
        want = []
        with torch.no_grad():
            for _ in range(12):
                nxt = int(model(torch.cat([ids, torch.tensor([want], dtype=torch.long)], 1)).logits[0, -1].argmax())
                if nxt == eot:
                    break
                want.append(nxt)
        assert r["messages"][-1]["content"] == tok.decode(want, skip_special_tokens=False)


def test_bad_target_and_data_are_refused_before_any_output(tiny, data, tmp_path, capsys):
    from regenerate.__main__ import main
    out = tmp_path / "out"
    assert main(["--data", str(data), "--target", str(tmp_path / "none"), "--out", str(out)]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["--data", str(tmp_path / "none.jsonl"), "--target", str(tiny["target"]), "--out", str(out)]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert main(["--data", str(data), "--engine", "openai", "--out", str(out)]) == 2
    assert "needs --base-url" in capsys.readouterr().err
    assert not out.exists()


def test_resume_with_other_settings_is_refused(tiny, data, tmp_path):
    out = tmp_path / "out"
    run(cfg(tiny, data, out))
    with pytest.raises(RegenError, match="was written with other generation"):
        run(cfg(tiny, data, out, chat_template_kwargs={"enable_thinking": False}))
    before = {f.name: f.read_text() for f in out.glob("part-*")}
    assert run(cfg(tiny, data, out))["rows"] == 12  # the same command: nothing left to do
    assert {f.name: f.read_text() for f in out.glob("part-*")} == before


def _cmd(tiny, data, out):
    return [sys.executable, "-m", "regenerate", "--data", str(data), "--target", str(tiny["target"]),
            "--out", str(out), "--max-new-tokens", "24", "--shard-rows", "2", "--batch-size", "1", "--no-progress"]


def test_kill_9_then_rerun_equals_uninterrupted(tiny, data, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    ref = tmp_path / "ref"
    assert subprocess.run(_cmd(tiny, data, ref), cwd=REPO, env=env, capture_output=True).returncode == 0
    out = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(tiny, data, out), cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and len(list(out.glob("part-*.jsonl"))) < 2:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    n = len(list(out.glob("part-*.jsonl")))
    assert 0 < n < len(list(ref.glob("part-*.jsonl"))), "the kill must land part-way"
    res = subprocess.run(_cmd(tiny, data, out), cwd=REPO, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    want = {f.name: f.read_bytes() for f in ref.glob("part-*.jsonl")}
    got = {f.name: f.read_bytes() for f in out.glob("part-*.jsonl")}
    assert got == want and not list(out.glob("*.tmp*"))


def test_shards_are_decoded_in_groups_of_whole_batches(tiny, data, tmp_path):
    """The engine gets a group's prompts at once (at least four batches), not one small shard at a
    time; every shard is still its own file, every source row in it once, in order."""
    from regenerate.jobs import Reply, read_jobs
    from regenerate.run import deal, group_of, run_group, shard_path

    class Recorder:  # answers every prompt at once, recording how many it was given
        def __init__(self):
            self.calls = []

        def generate(self, prompts, seed):
            self.calls.append(len(prompts))
            return [Reply(f"answer {i}", "stop", 3) for i in range(len(prompts))]

    c = cfg(tiny, data, tmp_path / "out", shard_rows=1, batch_size=2)  # groups of 4 * 2 / 1 = 8 shards
    (tmp_path / "out").mkdir()
    sources, jobs, _, _ = read_jobs(c)
    assert [group_of(c, k) for k in range(17)] == [(0, 0)] * 8 + [(0, 1)] * 8 + [(0, 2)]
    # two GPUs: shards dealt in turn, each worker's own shards grouped
    assert [group_of(c, k, world=2) for k in (0, 1, 15, 16, 17)] == [(0, 0), (1, 0), (1, 0), (0, 1), (1, 1)]
    groups = deal(c, {j.g: [j] for j in jobs}, 1)[0]  # shards of one row: shard k holds row k
    eng, written = Recorder(), []
    for g in groups.values():
        written += [rows for rows, _ in run_group(eng, c, g, sources, "t")]
    assert eng.calls == [8, 4] and written == [1] * 12   # 12 usable rows (one broken): 8, then 4, 1 a shard
    for j in jobs:  # one file per shard, holding its row
        assert [r["meta"]["source"]["row"] for r in read_shard(shard_path(Path(c.out), j.g))] \
            == [j.row]


# --- the OpenAI engine against a real server -------------------------------------------------------

class FakeServer(ThreadingHTTPServer):
    """/v1/chat/completions answering 'echo: <last user text>'; the first request fails with 503."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.requests, self.in_flight, self.max_in_flight, self.lock = [], 0, 0, threading.Lock()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            srv.requests.append(body)
            first = len(srv.requests) == 1
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
        time.sleep(0.05)
        with srv.lock:
            srv.in_flight -= 1
        last = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
        if self.path != "/v1/chat/completions" or first or last == "refuse me":
            self.send_response(503 if first else 400 if last == "refuse me" else 404)
            self.end_headers()
            self.wfile.write(b'{"error": "prompt too long"}')
            return
        text = f"echo: {last}"[:40]
        # a server with a reasoning parser: the thinking apart from the content (newer vLLM: `reasoning`)
        thought = {"reasoning": f"thinking about {last}"} if last.startswith("think") else {}
        ans = {"choices": [{"message": {"role": "assistant", "content": text, **thought},
                            "finish_reason": "length" if "second" in last else "stop"}],
               "usage": {"completion_tokens": len(text.split())}}
        data = json.dumps(ans).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_openai_engine_with_retries_and_bounded_concurrency(data, tmp_path):
    srv = FakeServer()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        out = tmp_path / "out"
        c = RegenConfig(data=str(data), out=str(out), engine="openai", model="served",
                        base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1", concurrency=3, shard_rows=16,
                        turns="all", chat_template_kwargs={"enable_thinking": False}, progress=False)
        s = run(c)
    finally:
        srv.shutdown()
    assert s["rows"] == 12 and s["finish_reasons"] == {"stop": 12, "length": 1}
    assert 1 < srv.max_in_flight <= 3
    assert len(srv.requests) == 13 + 1  # 13 turns, and the first attempt that failed with 503
    assert all(r["model"] == "served" and r["chat_template_kwargs"] == {"enable_thinking": False}
               for r in srv.requests)
    rows = rows_of(out)
    multi = rows[10]["messages"]
    assert multi[2]["content"] == "echo: first question" and multi[4]["content"] == "echo: second"
    # the second turn was asked with the regenerated first answer in its history
    second = [r for r in srv.requests if r["messages"][-1]["content"] == "second"][0]
    assert second["messages"][2]["content"] == "echo: first question"
    assert rows[10]["meta"]["finish_reasons"] == ["stop", "length"] and rows[10]["meta"]["target"].startswith("openai:")


def test_rows_that_cannot_be_answered_are_skipped_and_named(tiny, data, tmp_path):
    """A prompt over --max-prompt-len (local) or one the server refuses with a 4xx (openai) skips
    that row, counted by reason and named; the run goes on."""
    s = run(cfg(tiny, data, tmp_path / "local", max_prompt_len=40))
    assert s["skipped"]["too_long"] >= 1 and s["rows"] + s["skipped"]["too_long"] == 12
    srv = FakeServer()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    d = tmp_path / "d.jsonl"
    d.write_text(json.dumps({"messages": [{"role": "user", "content": "refuse me"}]}) + "\n" + json.dumps(PROMPT_ONLY) + "\n")
    try:
        s = run(RegenConfig(data=str(d), out=str(tmp_path / "api"), engine="openai", model="m", progress=False,
                            base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1"))
    finally:
        srv.shutdown()
    assert s["rows"] == 1 and s["skipped"] == {"server_refused": 1}
    stats = json.loads((tmp_path / "api" / "part-00000.stats").read_text())
    assert f"{d} row 0: " in stats["examples"]["server_refused"] and "HTTP 400" in stats["examples"]["server_refused"]


def test_openai_engine_gives_up_with_a_clear_error(data, tmp_path):
    c = RegenConfig(data=str(data), out=str(tmp_path / "o"), engine="openai", base_url="http://127.0.0.1:9/v1",
                    retries=2, progress=False)
    with pytest.raises(RegenError, match=r"127.0.0.1:9/v1/chat/completions: request failed after 2 attempt"):
        run(c)
    assert not list((tmp_path / "o").glob("part-*"))


def test_openai_engine_keeps_the_servers_reasoning_and_extraction_trains_it(tiny, tmp_path):
    """The thinking a reasoning parser returns apart is kept as reasoning_content, each later turn
    is asked with it in its history, and the rows extract with every turn as served."""
    import copy

    from test_chat_turns import QWENLIKE, served, trained
    d = tmp_path / "d.jsonl"
    d.write_text(json.dumps({"messages": [{"role": "user", "content": "think of a number"},
                                          {"role": "assistant", "content": "old"},
                                          {"role": "user", "content": "think again"},
                                          {"role": "assistant", "content": "old too"}]}) + "\n")
    srv = FakeServer()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        run(RegenConfig(data=str(d), out=str(tmp_path / "o"), engine="openai", model="m", progress=False,
                        turns="all", base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1"))
    finally:
        srv.shutdown()
    msgs = rows_of(tmp_path / "o")[0]["messages"]
    assert msgs[1] == {"role": "assistant", "content": "echo: think of a number",
                       "reasoning_content": "thinking about think of a number"}
    assert msgs[3]["reasoning_content"] == "thinking about think again"
    second = [r for r in srv.requests if r["messages"][-1]["content"] == "think again"][-1]
    assert second["messages"][1]["reasoning_content"] == "thinking about think of a number"
    tok = copy.deepcopy(tiny["tokenizer"])
    tok.chat_template = QWENLIKE
    row = rows_of(tmp_path / "o")[0]
    assert trained(tok, row) == served(tok, row) and len(served(tok, row)) == 2
    _, samples, report = encode_all(str(tmp_path / "o"), tok, 4096, "truncate", progress=False)
    assert len(samples) == 2 and not report.skipped and report.turns_split == 1


def test_first_turns_keep_the_first_exchange_only(tiny, data, tmp_path):
    """--turns first: the first user message (after any system message) answered by the target,
    the rest of the row dropped; a row whose first assistant turn has no user message before it
    is skipped and named (the recipe's ShareGPT first turns)."""
    src = tmp_path / "first.jsonl"
    opens_with_assistant = {"messages": [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": "old"}]}
    src.write_text("".join(json.dumps(r) + "\n" for r in (MULTI, PROMPT_ONLY, opens_with_assistant)))
    out = tmp_path / "out"
    s = run(cfg(tiny, src, out, turns="first"))
    assert s["rows"] == 2 and s["skipped"] == {"no_prompt": 1}
    rows = rows_of(out)
    assert [m["role"] for m in rows[0]["messages"]] == ["system", "user", "assistant"]
    assert rows[0]["messages"][1]["content"] == "first question"
    assert rows[0]["messages"][2]["content"] != "old answer one"
    assert [m["role"] for m in rows[1]["messages"]] == ["user", "assistant"]
