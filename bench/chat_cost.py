"""What training every chat turn as served costs: samples, tokens and loss tokens per row, for
`--inexact-turns split` (every turn in its own serving context where the render cannot hold it)
and `context` (one sample per row, earlier turns as context), against the row rendered once.

    python bench/chat_cost.py [--target build/tiny-target] [--chat-template FILE]
                              [--data DATA | --turns 1,2,4,8 --rows 200] [--reasoning]

Without --data, rows of K turns are made from consecutive pairs of the built-in corpus
(build/corpus/chat.jsonl, `make tiny`), each answer with a reasoning of about its own length
when --reasoning is given. --chat-template replaces the tokenizer's template (e.g.
tests/templates/qwenlike.jinja: Qwen3.5/3.6's behaviours, history reasoning dropped).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shared.data import Encoder, RowError, iter_rows, normalize_chat, resolve  # noqa: E402


def synthetic(corpus: Path, turns: int, rows: int, reasoning: bool) -> list[dict]:
    pairs = []
    for line in corpus.read_text().splitlines():
        m = normalize_chat(json.loads(line), "corpus")
        pairs.append((m[0]["content"], m[1]["content"]))
    out = []
    for r in range(rows):
        msgs = []
        for k in range(turns):
            q, a = pairs[(r * turns + k) % len(pairs)]
            msgs.append({"role": "user", "content": q})
            msgs.append({"role": "assistant", "content": a,
                         **({"reasoning_content": f"The user asks: {q} So: {a}"} if reasoning else {})})
        out.append({"messages": msgs})
    return out


def measure(tok, rows: list[dict], template_kwargs: dict) -> dict:
    """Totals over rows for split and context, and the row's one render (no exactness)."""
    res = {}
    for mode in ("split", "context"):
        enc = Encoder(tok, 1 << 30, "truncate", template_kwargs, inexact=mode)
        n = samples = tokens = loss = turns = split = context = skipped = 0
        for row in rows:
            try:
                encoded, chat = enc.encode(row, "row")
            except RowError:
                skipped += 1
                continue
            n += 1
            samples += len(encoded)
            tokens += sum(len(ids) for ids, _, _ in encoded)
            loss += sum(int(mask.sum()) for _, mask, _ in encoded)
            turns, split, context = turns + chat.turns, split + chat.split, context + chat.context
        res[mode] = dict(rows=n, samples=samples, tokens=tokens, loss_tokens=loss, turns=turns,
                         split=split, context=context, skipped=skipped)
    once = sum(len(tok(tok.apply_chat_template(r["messages"], tokenize=False, **template_kwargs),
                       add_special_tokens=False)["input_ids"]) for r in rows)
    res["once"] = dict(tokens=once)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="build/tiny-target")
    ap.add_argument("--chat-template", help="a Jinja file that replaces the tokenizer's chat template")
    ap.add_argument("--chat-template-kwargs", default="{}")
    ap.add_argument("--data", help="DATA to measure (otherwise synthetic K-turn rows)")
    ap.add_argument("--turns", default="1,2,4,8")
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--reasoning", action="store_true")
    a = ap.parse_args()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.target)
    if a.chat_template:
        tok.chat_template = Path(a.chat_template).read_text()
    kw = json.loads(a.chat_template_kwargs)
    if a.data:
        sets = {"DATA": [r for _, _, _, r in iter_rows(resolve(a.data)) if isinstance(r, dict)]}
    else:
        corpus = Path("build/corpus/chat.jsonl")
        sets = {f"{k} turns": synthetic(corpus, int(k), a.rows, a.reasoning) for k in a.turns.split(",")}
    print(f"template {a.chat_template or a.target}  kwargs {kw}  reasoning {a.reasoning}")
    print(f"{'rows':>10} {'mode':>8} {'samples/row':>12} {'tokens/row':>11} {'x once':>7} "
          f"{'loss tok/row':>13} {'turns split':>12} {'as context':>11}")
    for name, rows in sets.items():
        r = measure(tok, rows, kw)
        once = r["once"]["tokens"] / len(rows)
        for mode in ("split", "context"):
            m = r[mode]
            k = max(m["rows"], 1)
            print(f"{name:>10} {mode:>8} {m['samples'] / k:12.2f} {m['tokens'] / k:11.0f} "
                  f"{m['tokens'] / k / once:7.2f} {m['loss_tokens'] / k:13.0f} {m['split']:>12} {m['context']:>11}"
                  + (f"  ({m['skipped']} rows skipped)" if m["skipped"] else ""))


if __name__ == "__main__":
    main()
