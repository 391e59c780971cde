"""DATA reading, chat rendering, loss masks, and every bad-input case of the extract stage."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import mask_runs
from shared.data import DataError, Encoder, RowError, encode_all, resolve


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


CHAT = {"messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": "say hi"},
                     {"role": "assistant", "content": "hi there friend"},
                     {"role": "user", "content": "again"},
                     {"role": "assistant", "content": "hello again"}]}


def test_loss_mask_covers_assistant_turns_and_their_end_token(tiny):
    enc = Encoder(tiny["tokenizer"], max_len=512, too_long="truncate")
    [(ids, mask, truncated)], chat = enc.encode(CHAT, "row")
    tok = tiny["tokenizer"]
    assert not truncated
    # The masked tokens, decoded run by run, are exactly the assistant turns plus <|im_end|>.
    assert mask_runs(tok, ids, mask) == ["hi there friend<|im_end|>", "hello again<|im_end|>"]
    assert (chat.turns, chat.split) == (2, 0)  # this template renders history as served: one sample


def test_sharegpt_and_text_rows(tiny):
    enc = Encoder(tiny["tokenizer"], max_len=512, too_long="truncate")
    share = {"conversations": [{"from": "human", "value": "say hi"}, {"from": "gpt", "value": "hi there friend"}]}
    plain = {"messages": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi there friend"}]}
    [(a, ma, _)], _ = enc.encode(share, "r")
    [(b, mb, _)], _ = enc.encode(plain, "r")
    assert np.array_equal(a, b) and np.array_equal(ma, mb)
    [(ids, mask, _)], _ = enc.encode({"text": "def f(x):\n    return x"}, "r")
    assert mask.all() and len(ids) > 2


def test_too_long_truncate_and_skip(tiny):
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "word " * 200}]}
    [(ids, mask, truncated)], _ = Encoder(tiny["tokenizer"], 32, "truncate").encode(row, "r")
    assert truncated and len(ids) == 32 and mask.sum() > 2
    with pytest.raises(RowError) as e:
        Encoder(tiny["tokenizer"], 32, "skip").encode(row, "f.jsonl line 3")
    assert e.value.reason == "too_long" and "f.jsonl line 3" in str(e.value)


def test_bad_rows_are_counted_and_named(tiny, tmp_path):
    good = CHAT
    path = write_jsonl(tmp_path / "d.jsonl", [
        good,
        '{"messages": [ this is not json',
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"messages": []},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "   "}]},
        {"query": "no known field"},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a " * 300}]},
        good,
    ])
    files, rows, report = encode_all(str(path), tiny["tokenizer"], max_len=120, too_long="skip", progress=False)
    assert files == [path] and len(rows) == 2 and [r.row for r in rows] == [0, 7]
    assert dict(report.skipped) == {"malformed_json": 1, "no_assistant_turn": 1, "empty_conversation": 2,
                                    "bad_field": 1, "too_long": 1}
    assert f"{path} line 2" in report.examples["malformed_json"]
    assert f"{path} line 3" in report.examples["no_assistant_turn"]
    assert "field 'messages' is empty" in report.examples["empty_conversation"]
    assert "'query'" in report.examples["bad_field"]


def test_missing_or_empty_data_is_a_clear_error(tiny, tmp_path):
    with pytest.raises(DataError, match="no such file or folder"):
        resolve(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="glob matches no"):
        resolve(str(tmp_path / "*.jsonl"))
    with pytest.raises(DataError, match="unsupported file type"):
        (tmp_path / "x.csv").write_text("a,b\n")
        resolve(str(tmp_path / "x.csv"))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": []}])
    with pytest.raises(DataError, match="no usable rows out of 1"):
        encode_all(str(bad), tiny["tokenizer"], 64, "skip", progress=False)


def test_parquet_glob_and_save_to_disk(tiny, tmp_path):
    import datasets
    rows = tiny["rows"][:4]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "a.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    write_jsonl(tmp_path / "b.jsonl", rows)
    want = encode_all(str(tmp_path / "b.jsonl"), tiny["tokenizer"], 256, "truncate", progress=False)[1]
    for spec in (str(tmp_path / "a.parquet"), str(tmp_path / "saved"), str(tmp_path / "*.parquet")):
        got = encode_all(spec, tiny["tokenizer"], 256, "truncate", progress=False)[1]
        assert [g.input_ids.tolist() for g in got] == [w.input_ids.tolist() for w in want], spec


def test_cli_errors_before_any_work(tiny, tmp_path, capsys):
    from extract.__main__ import main
    store = tmp_path / "s"
    assert main(["--data", str(tmp_path / "none.jsonl"), "--target", str(tiny["target"]),
                 "--store", str(store), "--no-progress"]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    notarget = tmp_path / "notarget"
    notarget.mkdir()
    assert main(["--data", str(tiny["corpus"]), "--target", str(notarget), "--store", str(store)]) == 2
    assert "no config.json" in capsys.readouterr().err
    (notarget / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert main(["--data", str(tiny["corpus"]), "--target", str(notarget), "--store", str(store)]) == 2
    assert "model_type 'bert' is not supported" in capsys.readouterr().err
    assert main(["--data", str(tiny["corpus"]), "--target", str(tiny["target"]), "--store", str(store),
                 "--gpus", "7"]) == 2
    assert "GPU [7] does not exist" in capsys.readouterr().err
    assert main(["--data", str(tiny["corpus"]), "--target", str(tiny["target"]), "--store", str(store),
                 "--layers", "0,9"]) == 2
    assert "out of range" in capsys.readouterr().err
    assert not store.exists()


def test_default_layer_ids_match_design():
    from shared.target import default_layer_ids
    assert default_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_layer_ids(64, 1) == [32]
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
