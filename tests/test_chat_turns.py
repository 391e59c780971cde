"""Every assistant turn is trained exactly as serving shows it (docs/DESIGN.md, "Chat turns").

The project cannot ship Qwen's chat templates, so QWENLIKE (templates/qwenlike.jinja) is a
template of our own, written from the behaviours of the public Qwen3.5/3.6 templates
(huggingface/trl, trl/chat_templates/qwen3_5_think.jinja, qwen3_6.jinja) that decide what a
drafter must learn:
- an assistant turn after the last user query shows its reasoning as '<think>\\n R \\n</think>\\n\\n C';
  one before it shows only its content (history reasoning dropped), unless preserve_thinking;
- reasoning comes from `reasoning_content`, else from an inline '...</think>' in the content;
  reasoning and content are trimmed;
- the generation prompt opens '<think>\\n' with thinking on, and is an empty think block with
  enable_thinking false;
- tool calls are <tool_call><function=NAME><parameter=K> blocks after the content; tool results
  are grouped into one user turn of <tool_response> blocks, which do not count as user queries.

The oracle (`served`) is the rule itself: for assistant turn i, the serving prompt is the render of
messages[:i] with the generation prompt, tokenized as one string; the output is the render of
messages[:i+1] past that prompt, through <|im_end|>. Every test also states the texts by hand.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from shared.data import Encoder, RowError, encode_all

QWENLIKE = (Path(__file__).parent / "templates" / "qwenlike.jinja").read_text()

U, A, E = "<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]


@pytest.fixture(scope="module")
def qtok(tiny):
    tok = copy.deepcopy(tiny["tokenizer"])
    tok.chat_template = QWENLIKE
    return tok


def runs(mask) -> list[tuple[int, int]]:
    m = np.concatenate([[0], np.asarray(mask, dtype=np.int8), [0]])
    d = np.diff(m)
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist()))


def trained(tok, row, **kw) -> list[tuple[str, str]]:
    """(text before the loss run, loss run) for every loss run of every sample of the row, checked
    against the serving tokenization: the tokens before a run are the serving prompt's own tokens."""
    samples, _ = Encoder(tok, 4096, "truncate", **kw).encode(row, "row")
    out = []
    for ids, mask, _ in samples:
        for a, b in runs(mask):
            prompt = tok.decode(ids[:a].tolist())
            assert ids[:a].tolist() == tok(prompt, add_special_tokens=False)["input_ids"], "not the serving tokens"
            out.append((prompt, tok.decode(ids[a:b].tolist())))
    return out


def served(tok, row, template_kwargs=None, skip_empty=True) -> list[tuple[str, str]]:
    """The oracle, from the rule: (serving prompt, serving output) of each assistant turn."""
    from shared.data import normalize_chat
    kw = dict(template_kwargs or {}, **({"tools": row["tools"]} if row.get("tools") else {}))
    msgs = normalize_chat(row, "row")
    out = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True, **kw)
        full = tok.apply_chat_template(msgs[:i + 1], tokenize=False, **kw)
        assert full.startswith(prompt)
        output = full[len(prompt):]
        out.append((prompt, output[:output.rindex(E) + len(E)]))
    return out


def chat(*turns, **extra) -> dict:
    roles = {"u": "user", "a": "assistant", "t": "tool", "s": "system"}
    msgs = []
    for t in turns:
        role, content = t[0], t[1]
        msgs.append({"role": roles[role], "content": content, **(t[2] if len(t) > 2 else {})})
    return {"messages": msgs, **extra}


# 1. earlier turns' reasoning: the template drops it from history, serving showed it -------------------

REASONED = chat(("u", "What is 2+3?"), ("a", "The answer is 5.", {"reasoning_content": "Add 2 and 3."}),
                ("u", "And 4+4?"), ("a", "8.", {"reasoning_content": "Four and four."}))


def test_reasoning_turns_before_the_last_query_get_their_serving_context(qtok):
    got = trained(qtok, REASONED)
    first_prompt = U + "What is 2+3?" + E + "\n" + A + "<think>\n"
    assert got == [
        (first_prompt, "Add 2 and 3.\n</think>\n\nThe answer is 5." + E),
        # the second turn's context holds the first as serving history holds it: no reasoning
        (U + "What is 2+3?" + E + "\n" + A + "The answer is 5." + E + "\n" + U + "And 4+4?" + E + "\n" + A
         + "<think>\n", "Four and four.\n</think>\n\n8." + E),
    ]
    assert got == served(qtok, REASONED)


def test_reasoning_inline_or_in_the_reasoning_field_trains_the_same(qtok):
    inline = copy.deepcopy(REASONED)
    for m in inline["messages"]:
        if "reasoning_content" in m:
            m["content"] = "<think>\n" + m.pop("reasoning_content") + "\n</think>\n\n" + m["content"]
    vllm = copy.deepcopy(REASONED)  # newer vLLM returns the thinking as `reasoning`
    for m in vllm["messages"]:
        if "reasoning_content" in m:
            m["reasoning"] = m.pop("reasoning_content")
    assert trained(qtok, inline) == trained(qtok, vllm) == trained(qtok, REASONED)


def test_preserve_thinking_trains_every_turn_in_one_sample(qtok):
    samples, chat_ = Encoder(qtok, 4096, "truncate", {"preserve_thinking": True}).encode(REASONED, "r")
    assert len(samples) == 1 and (chat_.turns, chat_.split) == (2, 0)
    assert trained(qtok, REASONED, template_kwargs={"preserve_thinking": True}) == \
        served(qtok, REASONED, {"preserve_thinking": True})


def test_inexact_turns_as_context_train_only_what_the_row_shows_as_served(qtok):
    samples, c = Encoder(qtok, 4096, "truncate", inexact="context").encode(REASONED, "r")
    assert len(samples) == 1 and (c.turns, c.context, c.split) == (1, 1, 0)
    assert trained(qtok, REASONED, inexact="context") == served(qtok, REASONED)[1:]
    samples, c = Encoder(qtok, 4096, "truncate").encode(REASONED, "r")
    assert len(samples) == 2 and (c.turns, c.split, c.context) == (2, 1, 0)
    assert c.split_tokens == len(samples[0][0])


# 2. a turn's text is never looked for outside its own region ------------------------------------------

REPLY4 = chat(("u", "Reply 4 if you agree."), ("a", "4"), ("u", "Thanks."), ("a", "You are welcome."))


@pytest.mark.parametrize("template", ["chatml", "qwenlike"])
def test_an_earlier_answer_found_in_the_users_text_is_not_trained_there(tiny, qtok, template):
    tok = tiny["tokenizer"] if template == "chatml" else qtok
    got = trained(tok, REPLY4)
    assert got == served(tok, REPLY4)
    assert got[0][0].endswith("Reply 4 if you agree." + E + "\n" + A + ("<think>\n" if template == "qwenlike" else ""))
    assert got[0][1] == ("\n</think>\n\n" if template == "qwenlike" else "") + "4" + E


# 3. tool calls in an earlier turn: the call's text and the end of turn are what the model writes ------

@pytest.mark.parametrize("content", ["", "Let me check."])
def test_an_earlier_tool_call_turn_trains_its_call_and_end_of_turn(qtok, content):
    row = chat(("u", "Weather in Paris?"), ("a", content, {"tool_calls": CALL}), ("t", "sunny, 21C"),
               ("t", "no rain"), ("a", "Sunny, 21C, no rain."), ("u", "Thanks!"), ("a", "Anytime."), tools=TOOLS)
    got = trained(qtok, row)
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    assert got[0][1] == "\n</think>\n\n" + (content + "\n\n" if content else "") + call + E
    # the two tool results are one user turn, and the answer after them sees the call as served
    assert got[1][0].endswith(call + E + "\n" + U[:-1] + "\n<tool_response>\nsunny, 21C\n</tool_response>\n"
                              "<tool_response>\nno rain\n</tool_response>" + E + "\n" + A + "<think>\n")
    assert got[1][1] == "\n</think>\n\nSunny, 21C, no rain." + E
    assert got == served(qtok, row)
    samples, c = Encoder(qtok, 4096, "truncate").encode(row, "r")
    assert len(samples) == 2 and c.turns == 3 and c.split == 2  # call and answer share their serving sample


# 4. content the template rewrites (inline reasoning, surrounding white space) -------------------------

def test_content_the_template_rewrites_is_trained_as_rendered(qtok):
    # what `make regenerate --turns all` writes with an engine that returns the thinking inline
    row = chat(("u", "Name a prime."), ("a", "reasoning here\n</think>\n\n2 is prime.\n"),
               ("u", "Another?"), ("a", "  3.\n", {"reasoning_content": "\nnext one\n"}))
    got = trained(qtok, row)
    assert got == [(U + "Name a prime." + E + "\n" + A + "<think>\n", "reasoning here\n</think>\n\n2 is prime." + E),
                   (U + "Name a prime." + E + "\n" + A + "2 is prime." + E + "\n" + U + "Another?" + E + "\n" + A
                    + "<think>\n", "next one\n</think>\n\n3." + E)]
    assert got == served(qtok, row)


# 5. thinking off: reasoning in the rows is refused, or stripped on request --------------------------

def test_rows_with_reasoning_under_thinking_off_are_refused_or_stripped(qtok, tmp_path):
    off = {"enable_thinking": False}
    with pytest.raises(RowError, match=r"messages\[1\] carries reasoning.*--strip-reasoning") as e:
        Encoder(qtok, 4096, "truncate", off).encode(REASONED, "f line 1")
    assert e.value.reason == "thinking_mismatch"
    inline = chat(("u", "q"), ("a", "<think>\nhmm\n</think>\n\nyes"))
    with pytest.raises(RowError) as e:
        Encoder(qtok, 4096, "truncate", off).encode(inline, "r")
    assert e.value.reason == "thinking_mismatch"
    # an empty think block is no reasoning: the row is what thinking-off serving writes
    plain = chat(("u", "q"), ("a", "<think>\n\n</think>\n\nyes"))
    assert trained(qtok, plain, template_kwargs=off) == [(U + "q" + E + "\n" + A + "<think>\n\n</think>\n\n", "yes" + E)]
    stripped = trained(qtok, REASONED, template_kwargs=off, drop_reasoning=True)
    assert stripped == [(U + "What is 2+3?" + E + "\n" + A + "<think>\n\n</think>\n\n", "The answer is 5." + E),
                        (U + "What is 2+3?" + E + "\n" + A + "The answer is 5." + E + "\n" + U + "And 4+4?" + E + "\n"
                         + A + "<think>\n\n</think>\n\n", "8." + E)]
    # counted by reason, never half-kept
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (REASONED, plain, inline)))
    _, rows, report = encode_all(str(path), qtok, 4096, "truncate", progress=False, template_kwargs=off)
    assert [r.row for r in rows] == [1] and dict(report.skipped) == {"thinking_mismatch": 2}


def test_a_template_that_cannot_show_reasoning_refuses_the_row(tiny):
    row = chat(("u", "q"), ("a", "yes", {"reasoning_content": "because"}))
    with pytest.raises(RowError) as e:
        Encoder(tiny["tokenizer"], 4096, "truncate").encode(row, "r")  # ChatML: no reasoning_content
    assert e.value.reason == "reasoning_not_rendered"


# the report and the store ---------------------------------------------------------------------------

def test_report_counts_turns_samples_and_split_tokens(qtok, tmp_path):
    path = tmp_path / "d.jsonl"
    single = chat(("u", "hi"), ("a", "hello there"))
    path.write_text("".join(json.dumps(r) + "\n" for r in (REASONED, single, REPLY4)))
    _, rows, report = encode_all(str(path), qtok, 4096, "truncate", progress=False)
    assert report.rows == report.kept == 3 and report.samples == len(rows) == 5
    assert (report.turns, report.turns_split, report.turns_context) == (5, 2, 0)
    assert [r.row for r in rows] == [0, 0, 1, 2, 2]
    # the split samples come before each row's own sample (its last turn)
    assert report.split_tokens == len(rows[0].input_ids) + len(rows[3].input_ids)


def test_regenerated_reasoning_becomes_reasoning_content():
    from regenerate.jobs import Reply
    r = Reply.of_text("Add them.\n</think>\n\nThe answer is 5.", "stop", 9)
    assert (r.reasoning, r.text) == ("Add them.", "The answer is 5.")
    r = Reply.of_text("The answer is 5.", "stop", 5)
    assert (r.reasoning, r.text) == (None, "The answer is 5.")


def test_held_out_samples_are_whole_source_rows():
    """The samples a row was split into share their context: evaluation holds them out together."""
    from train.run import held_out

    class FakeStore:
        files = np.array([0, 0, 0, 0, 1, 1, 1])
        rows = np.array([0, 1, 1, 1, 0, 0, 1])

        def __len__(self):
            return len(self.rows)

        def sources(self, lo, hi):
            return self.files[lo:hi], self.rows[lo:hi]

    assert held_out(FakeStore(), 0) == []
    assert held_out(FakeStore(), 1) == [6]
    assert held_out(FakeStore(), 2) == [4, 5, 6]        # file 1 row 0 is two samples
    assert held_out(FakeStore(), 4) == [1, 2, 3, 4, 5, 6]  # file 0 row 1 is three
    assert held_out(FakeStore(), 9) == list(range(7))
