"""Every bad input and every broken store gets a clear answer (README: "Bad input")."""

from __future__ import annotations

import errno
import json
import shutil
import time

import numpy as np
import pytest
import zarr

from conftest import extract_cfg, mask_runs, read_all
from extract.__main__ import main
from extract.run import ExtractError, run
from shared.data import Encoder, encode_all
from shared import store as st
from shared.location import as_location
from shared.target import TargetError

CHAT = {"messages": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi there friend"}]}


# --- inputs ------------------------------------------------------------------------------------

def test_jsonl_with_a_byte_order_mark_keeps_its_first_row(tiny, tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps(CHAT) + "\n").encode() * 3)
    _, rows, report = encode_all(str(path), tiny["tokenizer"], 256, "truncate", progress=False)
    assert len(rows) == 3 and not report.skipped and [r.row for r in rows] == [0, 1, 2]


def test_bytes_that_are_not_utf8_skip_the_row_with_a_reason(tiny, tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = (json.dumps(CHAT) + "\n").encode()
    bad = json.dumps({"messages": [{"role": "user", "content": "caf_"},
                                   {"role": "assistant", "content": "ok then friend"}]}).encode().replace(b"_", b"\xe9")
    path.write_bytes(good + bad + b"\n" + good)
    _, rows, report = encode_all(str(path), tiny["tokenizer"], 256, "truncate", progress=False)
    assert [r.row for r in rows] == [0, 2]
    assert dict(report.skipped) == {"invalid_utf8": 1}
    assert f"{path} line 2" in report.examples["invalid_utf8"] and "b'\\xe9" in report.examples["invalid_utf8"]


def test_a_lone_carriage_return_neither_ends_a_row_nor_shifts_line_numbers(tiny, tmp_path):
    """JSON Lines rows end at LF; a stray CR (or CRLF) is not a row end."""
    path = tmp_path / "cr.jsonl"
    chat = json.dumps(CHAT).encode()
    path.write_bytes(b"not json\rstill line 1\n" + chat + b"\r\n" + b'{"messages": 5}\n' + chat + b"\n")
    _, rows, report = encode_all(str(path), tiny["tokenizer"], 256, "truncate", progress=False)
    assert [r.row for r in rows] == [1, 3]
    assert dict(report.skipped) == {"malformed_json": 1, "bad_field": 1}
    assert f"{path} line 1:" in report.examples["malformed_json"]
    assert f"{path} line 3: field 'messages' is not a list of messages (int)" in report.examples["bad_field"]


def test_a_chat_that_opens_with_the_assistant_is_blamed_for_that(tiny, tmp_path):
    """An assistant turn no user message precedes has no serving prompt: not trained, and the
    row's reason says so (it once read "empty conversation")."""
    path = tmp_path / "assistant_first.jsonl"
    rows = [{"messages": [{"role": "assistant", "content": "hello, how can I help"}]},
            {"messages": [{"role": "assistant", "content": "hello"}, *CHAT["messages"]]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, got, report = encode_all(str(path), tiny["tokenizer"], 256, "truncate", progress=False)
    assert [r.row for r in got] == [1]
    assert dict(report.skipped) == {"no_loss_tokens": 1}
    assert "no assistant turn answers a user message" in report.examples["no_loss_tokens"]


def test_a_target_without_tokenizer_files_is_named(tiny, tmp_path):
    from shared.target import load_tokenizer
    folder = tmp_path / "target"
    shutil.copytree(tiny["target"], folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(TargetError, match="has no tokenizer: none of tokenizer.json"):
        load_tokenizer(folder)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("empty", ["", None])
def test_tool_calls_and_results_render_through_the_template(tiny, empty):
    row = {"tools": TOOLS, "messages": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": empty,
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny, 21C"},
        {"role": "assistant", "content": "It is sunny in Paris."}]}
    tok = tiny["tokenizer"]
    enc = Encoder(tok, 512, "truncate")
    text = tok.decode(enc.render(row, "r").samples[0].ids)
    assert "<tools>" in text and '"get_weather"' in text and "<tool_response>\nsunny, 21C\n</tool_response>" in text
    [(ids, mask, _)], _ = enc.encode(row, "r")
    # loss on what the assistant writes: its tool call and its answer, each with <|im_end|>
    assert mask_runs(tok, ids, mask) == [
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is sunny in Paris.<|im_end|>"]


def test_a_template_without_tool_support_is_refused_not_dropped(tiny):
    import copy
    tok = copy.deepcopy(tiny["tokenizer"])
    tok.chat_template = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                         "'<|im_end|>\\n' }}{%- endfor %}")
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                                                           "tool_calls": [{"name": "lookup", "arguments": {}}]}]}
    from shared.data import RowError
    with pytest.raises(RowError, match="does not render tool calls") as e:
        Encoder(tok, 512, "truncate").encode(row, "f line 1")
    assert e.value.reason == "template_error"


def test_chat_template_kwargs_render_mask_manifest_and_resume(tiny, tmp_path):
    tok = tiny["tokenizer"]
    off = Encoder(tok, 512, "truncate", {"enable_thinking": False})
    text = tok.decode(off.render(CHAT, "r").samples[0].ids)
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nhi there friend" in text
    [(ids, mask, _)], _ = off.encode(CHAT, "r")
    assert mask_runs(tok, ids, mask) == ["hi there friend<|im_end|>"]  # the empty think block is prompt
    assert "<think>" not in tok.decode(Encoder(tok, 512, "truncate").render(CHAT, "r").samples[0].ids)
    # the CLI takes the JSON, the manifest records it, a resume with other options refuses
    store = tmp_path / "s"
    args = ["--data", str(tiny["corpus"]), "--target", str(tiny["target"]), "--store", str(store), "--layers",
            "0,3", "--max-len", "256", "--shard-tokens", "1024", "--batch-tokens", "1024", "--topk", "4",
            "--no-progress"]
    assert main(args + ["--chat-template-kwargs", '{"enable_thinking": false}']) == 0
    s = st.Store(store)
    assert s.manifest.chat_template_kwargs == {"enable_thinking": False}
    ids, mask = s.tokens(0)
    assert "<think>\n\n</think>" in tok.decode(ids)
    with pytest.raises(ExtractError, match="chat_template_kwargs: store has {'enable_thinking': False}, asked {}"):
        run(extract_cfg(tiny, store, layer_ids=[0, 3], topk=4))
    assert main(args + ["--chat-template-kwargs", "[1, 2]"]) == 2


def test_save_to_disk_folder_among_files_is_loaded_as_a_dataset(tiny, tmp_path):
    import datasets
    rows = tiny["rows"][:3]
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    datasets.Dataset.from_list(tiny["rows"][3:5]).save_to_disk(str(data / "nested" / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(tiny["rows"][5:6])}).save_to_disk(str(data / "dd"))
    files, got, report = encode_all(str(data), tiny["tokenizer"], 256, "truncate", progress=False)
    assert [f.name for f in files] == ["a.jsonl", "dd", "saved"]
    assert len(got) == 6 and not report.skipped, dict(report.skipped)


def test_resume_refusal_names_the_changed_file_and_both_hashes(tiny, tmp_path):
    data = tmp_path / "d.jsonl"
    shutil.copy(tiny["corpus"], data)
    store = tmp_path / "s"
    run(extract_cfg(tiny, store, data=str(data), layer_ids=[0], topk=2))
    old = st.Store(store).manifest.data.files[0]["sha256"]
    with data.open("a") as f:
        f.write(json.dumps(CHAT) + "\n")
    import hashlib
    new = hashlib.sha256(data.read_bytes()).hexdigest()
    with pytest.raises(ExtractError) as e:
        run(extract_cfg(tiny, store, data=str(data), layer_ids=[0], topk=2))
    assert f"DATA files differ: {data} (sha256 {old[:16]}... in the store, now {new[:16]}...)" in str(e.value)


# --- target and store ----------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncate", "garble"])
def test_broken_safetensors_refused_before_planning(tiny, tmp_path, damage, capsys):
    target = tmp_path / "target"
    shutil.copytree(tiny["target"], target)
    f = next(target.glob("*.safetensors"))
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000] if damage == "truncate" else data[:8] + b"{not json" + data[17:])
    store = tmp_path / "s"
    with pytest.raises(TargetError, match=f"TARGET {f}: " + ("truncated" if damage == "truncate" else
                                                             "not a readable safetensors file")):
        run(extract_cfg(tiny, store, target=str(target)))
    assert not store.exists() and not (tmp_path / "s.partial").exists()
    assert main(["--data", str(tiny["corpus"]), "--target", str(target), "--store", str(store), "--no-progress"]) == 2
    assert str(f) in capsys.readouterr().err


def test_store_that_is_a_regular_file_is_refused(tiny, tmp_path):
    f = tmp_path / "store"
    f.write_text("not a store")
    with pytest.raises(ExtractError, match=f"STORE {f} is an existing file, not a folder"):
        run(extract_cfg(tiny, f))
    assert f.read_text() == "not a store"


def test_free_space_estimate_refuses_and_can_be_overridden(tiny, tmp_path, monkeypatch, capsys):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=20_000))
    store = tmp_path / "s"
    with pytest.raises(ExtractError, match=r"GiB of features still to write, only 0.00 GiB free.*--ignore-free-space"):
        run(extract_cfg(tiny, store))
    err = capsys.readouterr().err
    assert "estimated size of the features still to write" in err and "3 layers x 64 x bf16" in err
    assert not st.done_units(store)  # planned, nothing written: rerunning resumes
    assert run(extract_cfg(tiny, store, ignore_free_space=True))["samples"] == len(tiny["rows"])


def test_disk_full_is_a_clear_message_and_a_rerun_resumes(tiny, tmp_path, monkeypatch):
    ref = tmp_path / "ref"
    run(extract_cfg(tiny, ref))
    real, calls = st.write_unit, {"n": 0}

    def full(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **kw)

    monkeypatch.setattr(st, "write_unit", full)
    store = tmp_path / "s"
    with pytest.raises(ExtractError) as e:
        run(extract_cfg(tiny, store, writers=1))
    msg = str(e.value)
    assert f"STORE {store}: the disk is full" in msg and "GiB written" in msg and "rerun the same command" in msg
    monkeypatch.setattr(st, "write_unit", real)
    run(extract_cfg(tiny, store))
    a, b = read_all(ref), read_all(store)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_no_claim_is_left_and_a_live_claim_is_waited_for(tiny, tmp_path, monkeypatch):
    """Claims live only while a store is being made: none after it is complete, none after a
    refused run; a unit claimed by a live process of another run is left to it (the run waits,
    and takes it over once the lease runs out)."""
    store = tmp_path / "s"
    run(extract_cfg(tiny, store, layer_ids=[0], topk=2))
    assert not (store / "_claims").exists() and not list(tmp_path.glob("s.*"))
    with pytest.raises(ExtractError):  # refused run (other settings)
        run(extract_cfg(tiny, store, layer_ids=[1], topk=2))
    assert not (store / "_claims").exists()

    from extract.claims import Claims
    other = tmp_path / "o"
    run(extract_cfg(tiny, other, layer_ids=[0], topk=2, max_batch=1))  # a reference
    fresh = tmp_path / "f"
    monkeypatch.setattr(st, "write_unit", lambda *a, **kw: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        run(extract_cfg(tiny, fresh, layer_ids=[0], topk=2, max_batch=1))
    monkeypatch.undo()
    # unit 0 held by a live process (this one, as another owner) whose lease runs out in 4 s
    holder = Claims(as_location(fresh), lease_s=4)
    assert holder.take("unit-0000000")
    t0 = time.time()
    run(extract_cfg(tiny, fresh, layer_ids=[0], topk=2, max_batch=1, lease_seconds=4))
    assert time.time() - t0 >= 3  # it waited for the lease
    holder.renew()  # the claim was taken over (and the store finalized): the old holder knows it lost it
    assert not holder.holds("unit-0000000")
    a, b = read_all(other), read_all(fresh)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not (fresh / "_claims").exists()


# --- verify ----------------------------------------------------------------------------------------

def test_verify_reports_a_truncated_shard_and_goes_on(tiny, tmp_path, capsys):
    from extract.inspect import main as inspect_main
    store = tmp_path / "s"
    run(extract_cfg(tiny, store))
    shard = next(p for p in (store / "features" / "hidden" / "c" / "0").rglob("*") if p.is_file())
    shard.write_bytes(shard.read_bytes()[:300])
    last = st.Store(store).layout.n_units - 1
    g = zarr.open_group(str(store), mode="r+")
    S = st.Store(store).layout.shard_tokens
    g["logits/lse"][last * S:last * S + 4] = 1.0  # a second, later problem: still found
    assert inspect_main([str(store), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM unit 0: features/hidden unreadable" in out
    assert f"PROBLEM unit {last}: logits/lse checksum" in out and "problem(s)" in out


def test_verify_agrees_with_training_on_an_unfinalized_store(tiny, tmp_path, capsys):
    from extract.inspect import main as inspect_main
    store = tmp_path / "s"
    run(extract_cfg(tiny, store))
    g = zarr.open_group(str(store), mode="r+")  # killed after the last marker, before finalizing
    g.attrs["dflash"] = {**g.attrs["dflash"], "complete": False}
    with pytest.raises(st.StoreError, match="not complete"):
        st.Store(store)
    assert inspect_main([str(store), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "every unit written, the store not finalized" in out and "rerun the same extract command" in out
    assert "verify: OK" not in out
    run(extract_cfg(tiny, store))  # the rerun finishes it
    assert inspect_main([str(store), "--verify"]) == 0


# --- careless options (issue 28) -------------------------------------------------------------

def test_overwrite_refuses_a_folder_that_is_not_a_store_and_deletes_nothing(tiny, tmp_path):
    u = tmp_path / "U"
    u.mkdir()
    (u / "notes.txt").write_text("x")
    with pytest.raises(ExtractError, match="not a feature store: --overwrite deletes only a store"):
        run(extract_cfg(tiny, u, overwrite=True))
    assert (u / "notes.txt").read_text() == "x"


@pytest.mark.parametrize("opts, says", [
    (dict(max_len=-5), "--max-len must be at least 1, not -5"),
    (dict(max_len=1), "--max-len 1: a sample needs a context token"),
    (dict(chunk_tokens=0), "--chunk-tokens must be at least 1"),
    (dict(cpu_workers=0), "--cpu-workers must be at least 1"),
    (dict(layer_ids=[1, 1, 2]), "--layers names layer 1 more than once"),
    (dict(topk=5000), "--topk 5000 exceeds the target's vocabulary"),
])
def test_nonsense_extraction_options_are_refused_before_anything_is_written(tiny, tmp_path, opts, says):
    store = tmp_path / "s"
    with pytest.raises((ValueError, ExtractError), match=re_escape(says)):
        run(extract_cfg(tiny, store, **opts))
    assert not store.exists()


@pytest.fixture(scope="module")
def small_store(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("careless") / "store"
    run(extract_cfg(tiny, path))
    return path


@pytest.mark.parametrize("opts, says", [
    (dict(epochs=0), "--epochs must be at least 1, not 0"),
    (dict(max_steps=-5), "--max-steps must be at least 1, not -5"),
    (dict(max_steps=0), "--max-steps must be at least 1, not 0"),
    (dict(seq_len=8), "--seq-len 8: a row must hold a context and a block"),
    (dict(seq_len=0), "--seq-len 0: a row must hold"),
    (dict(draft_layers=0), "--draft-layers must be at least 1, not 0"),
    (dict(gamma=0.0), "--gamma must be positive, not 0.0"),
])
def test_nonsense_training_options_are_refused_before_training(small_store, draft, tmp_path, opts, says):
    from train.config import ConfigError
    from train.loop import train
    from conftest import tcfg
    with pytest.raises(ConfigError, match=re_escape(says)):
        train(tcfg(small_store, draft, tmp_path / "run", **opts))
    assert not (tmp_path / "run" / "export").exists()


def test_resume_with_other_options_is_refused_with_every_difference(small_store, draft, tmp_path):
    from train.config import ConfigError
    from train.loop import train
    from conftest import tcfg
    out = tmp_path / "run"
    train(tcfg(small_store, draft, out, max_steps=6, save_every=2, stop_after=4))
    before = (out / "train_config.json").read_text()
    with pytest.raises(ConfigError, match=r"--max-steps 6 -> 8; --lr 0.003 -> 0.01") as e:
        train(tcfg(small_store, draft, out, max_steps=8, save_every=2, lr=1e-2, resume=True))
    assert "--labels" not in str(e.value)
    assert (out / "train_config.json").read_text() == before  # nothing recorded for a refused run
    # what may change on a resume (where it stops, logging, loader processes) is accepted
    res = train(tcfg(small_store, draft, out, max_steps=6, save_every=2, log_every=3, resume=True))
    assert res["step"] == 6


def test_eval_refuses_zero_new_tokens_before_loading_anything(tmp_path, capsys):
    from eval.speculative import main as spec_main
    assert spec_main(["--drafter", str(tmp_path), "--target", str(tmp_path), "--prompt-set", "mt-bench",
                      "--max-new", "0"]) == 2
    assert "--max-new must be at least 1, not 0" in capsys.readouterr().err


def re_escape(s: str) -> str:
    import re
    return re.escape(s)


def test_eval_refuses_a_drafter_trained_for_another_target(small_store, draft, tiny, tmp_path):
    """The export records the store target's embed/lm_head fingerprint; a same-shaped other target
    (a fine-tune, a retrain) is refused by name, --allow-other-target evaluates anyway."""
    from safetensors.torch import load_file, save_file
    from eval.speculative import check_drafter_target
    from shared.target import exported_target
    from train.loop import train
    from conftest import tcfg
    train(tcfg(small_store, draft, tmp_path / "run", max_steps=2))
    export = tmp_path / "run" / "export"
    assert exported_target(export) == st.Store(small_store).manifest.target.tensors_fingerprint
    check_drafter_target(str(export), str(tiny["target"]), allow=False)  # its own target: accepted
    other = tmp_path / "other"
    shutil.copytree(tiny["target"], other)
    for f in other.glob("*.safetensors"):
        t = load_file(str(f))
        t = {k: (v + 1e-3 if "embed_tokens" in k else v) for k, v in t.items()}
        save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="was trained for another target"):
        check_drafter_target(str(export), str(other), allow=False)
    check_drafter_target(str(export), str(other), allow=True)
    with pytest.raises(ValueError, match="no such folder"):
        check_drafter_target(str(tmp_path / "nowhere"), str(tiny["target"]), allow=False)
    cfg = json.loads((export / "config.json").read_text())
    wide = tmp_path / "wide"
    shutil.copytree(export, wide)
    (wide / "config.json").write_text(json.dumps({**cfg, "hidden_size": 2 * cfg["hidden_size"]}))
    with pytest.raises(ValueError, match="has hidden_size 128, TARGET .* 64"):
        check_drafter_target(str(wide), str(tiny["target"]), allow=False)


def test_object_storage_failures_are_one_line(tiny, draft, s3, tmp_path, capsys, monkeypatch):
    """A bucket that does not exist and an endpoint nobody answers: one line naming the STORE and
    the server's own code, from every stage that opens a store (no traceback)."""
    from extract.inspect import main as inspect_main

    def train_main(argv):
        from train.__main__ import main
        return main(argv)

    url = "s3://no-such-bucket/stores/x"
    calls = [lambda: main(["--data", str(tiny["corpus"]), "--target", str(tiny["target"]), "--store", url,
                           "--no-progress"]),
             lambda: inspect_main([url]), lambda: inspect_main([url, "--verify"]),
             lambda: train_main(["--store", url, "--out", str(tmp_path / "run"), "--draft", str(draft),
                                 "--no-progress"])]
    for call in calls:
        assert call() == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1] == f"error: STORE {url}: NoSuchBucket: The specified bucket does not exist", err
        assert not any("Traceback" in l for l in err)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the discard port: refused at once
    monkeypatch.setenv("AWS_MAX_RETRIES", "0")
    assert inspect_main([s3.url("stores/y")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the object store http://127.0.0.1:9 cannot be reached" in err[0], err


def test_a_read_only_store_is_one_line_and_nothing_is_written(tiny, tmp_path, monkeypatch, capsys):
    """A folder on a read-only mount exists but refuses its first file (root ignores chmod, so the
    mount is simulated at the probe file the store's folder must accept)."""
    import os as _os
    real_open = _os.open
    store = tmp_path / "ro"
    store.mkdir()

    def ro(path, flags, *a, **kw):
        if str(path).startswith(str(store)) and flags & _os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(_os, "open", ro)
    assert main(["--data", str(tiny["corpus"]), "--target", str(tiny["target"]), "--store", str(store),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: STORE {store} is not writable (Read-only file system: {store}/.probe-"), err
    assert list(store.iterdir()) == []


def test_damaged_units_are_repaired_by_rerunning_the_extraction(tiny, tmp_path, capsys):
    """verify finds a truncated shard and a same-size corruption; --repair forgets those units;
    the same extraction command then rewrites just them, and the store equals an undamaged one."""
    from extract.inspect import main as inspect_main
    ref, store = tmp_path / "ref", tmp_path / "s"
    run(extract_cfg(tiny, ref))
    run(extract_cfg(tiny, store))
    shard = next(p for p in (store / "features" / "hidden" / "c" / "0").rglob("*") if p.is_file())
    shard.write_bytes(shard.read_bytes()[:300])
    last = st.Store(store).layout.n_units - 1
    S = st.Store(store).layout.shard_tokens
    zarr.open_group(str(store), mode="r+")["logits/lse"][last * S:last * S + 4] = 1.0
    assert inspect_main([str(store), "--verify", "--repair"]) == 1
    out = capsys.readouterr().out
    assert f"repair: units [0, {last}] forgotten" in out
    assert not st.Store(store, require_complete=False).manifest.complete  # training refuses it meanwhile
    run(extract_cfg(tiny, store))
    assert inspect_main([str(store), "--verify"]) == 0
    a, b = read_all(ref), read_all(store)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_a_failed_write_leaves_no_temporary_file_and_finalizing_sweeps_old_ones(tiny, tmp_path):
    """A write that fails (a full disk) removes its temporary file; one a killed process left is
    removed when the store is finalized."""
    loc = as_location(str(tmp_path / "loc"))
    loc.prepare()

    def pieces():
        yield b"x" * 1000
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        loc.write("features/a/c/0", pieces())
    assert [p.name for p in (tmp_path / "loc").rglob("*") if p.is_file()] == []
    store = tmp_path / "s"
    run(extract_cfg(tiny, store))
    st.forget_units(store, [0])  # a unit to write again, as after a kill
    stray = store / "features" / "hidden" / "c" / "0" / "0.tmp4242-0123abcd"
    stray.write_bytes(b"half a shard")
    run(extract_cfg(tiny, store))
    assert not stray.exists()
    assert not [p for p in store.rglob("*.tmp*")]


def test_ctrl_c_is_one_line_and_the_rerun_resumes(tiny, tmp_path):
    """Ctrl-C reaches the whole process group (the CLI, its writer processes): one line, exit code
    130, no traceback from any process; the same command then finishes a store equal to an
    uninterrupted one."""
    import os
    import signal
    import subprocess
    import sys
    ref, store = tmp_path / "ref", tmp_path / "s"
    run(extract_cfg(tiny, ref, max_batch=1))
    cmd = [sys.executable, "-m", "extract", "--data", str(tiny["corpus"]), "--target", str(tiny["target"]),
           "--store", str(store), "--layers", "0,1,3", "--max-len", "256", "--shard-tokens", "1024",
           "--chunk-tokens", "64", "--batch-tokens", "1024", "--topk", "8", "--max-batch", "1",
           "--writers", "1", "--no-progress"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    t0 = time.time()
    while not list((store / "_progress").glob("unit-*.json")) and time.time() - t0 < 120 and p.poll() is None:
        time.sleep(0.05)
    assert p.poll() is None, "finished before it could be interrupted"
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=120)
    lines = [l for l in err.splitlines() if l.strip() and not l.startswith("[transformers]")]
    assert p.returncode == 130, err[-2000:]
    assert not any("Traceback" in l or "terminate called" in l for l in lines), err[-2000:]
    assert lines[-1] == "interrupted: the units finished so far are kept; rerun the same command to resume"
    assert sum("interrupted" in l for l in lines) == 1
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    a, b = read_all(ref), read_all(store)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_verify_compares_a_target_with_the_stores_fingerprints(tiny, tmp_path, capsys):
    """The manifest's fingerprints are the check that a target is the store's: a same-size change
    of lm_head (what safetensors cannot see) is reported."""
    from safetensors.torch import load_file, save_file
    from extract.inspect import main as inspect_main
    store = tmp_path / "s"
    run(extract_cfg(tiny, store))
    assert inspect_main([str(store), "--verify", "--target", str(tiny["target"])]) == 0
    other = tmp_path / "other"
    shutil.copytree(tiny["target"], other)
    f = next(other.glob("*.safetensors"))
    w = load_file(str(f))
    name = next(k for k in w if "embed_tokens" in k)
    w[name] = w[name].clone()
    w[name][3, 5] += 1.0
    save_file(w, str(f), metadata={"format": "pt"})
    capsys.readouterr()
    assert inspect_main([str(store), "--verify", "--target", str(other)]) == 1
    out = capsys.readouterr().out
    assert f"PROBLEM target {other}: embed_tokens/lm_head fingerprint" in out


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 0), ("hidden_size", -4), ("intermediate_size", 0)])
def test_a_draft_config_with_no_layers_or_sizes_is_refused_by_name(draft, tmp_path, field, value):
    from train.config import ConfigError, DrafterConfig
    cfg = json.loads(draft.read_text())
    cfg[field] = value
    if field == "num_hidden_layers":
        cfg.pop("layer_types", None)
    bad = tmp_path / "draft.json"
    bad.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=f"{bad}: {field} must be a whole number of at least 1, not {value}"):
        DrafterConfig.load(bad)
