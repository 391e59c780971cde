"""Regeneration through the whole command path (regenerate.run: shards, groups of shards, the
local engine, the shard files) on a random SmolLM2-shaped llama: shard by shard (one engine call
per shard, as regenerate ran until 2026-12-07) against groups of shards, in the same run, on the
same prompts. bench/regen_bench.py times the decoder alone; this is what `python -m regenerate`
makes of it.

    python bench/regen_cli_bench.py --rows 2048 --max-new 256 --batch 512 --shard-rows 256
    python bench/regen_cli_bench.py --data sharegpt-first.jsonl.gz --rows 4096 --max-new 512 --max-prompt-len 2048

The tokenizer is the built-in tiny one (shared/tiny.py) and the prompts its stdlib chat pairs
(1,639 with Python 3.11), repeated where --rows asks for more. The head keeps SmolLM2's 49,152
rows, but those past the tokenizer's ids and the end of turn are zero, so the argmax stays on ids
the tokenizer decodes and every row runs to --max-new: the same work for both ways. --data takes
any DATA file instead (e.g. ShareGPT's first pairs: prompts of every length, tokenized by the tiny
tokenizer, so longer in tokens than SmolLM2's own would make them).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import regenerate.run as R
from regenerate.config import RegenConfig
from shared.tiny import build_tokenizer, stdlib_chat_pairs


def build(out: Path, rows: int, device: str, data: str | None) -> tuple[Path, Path | str]:
    from transformers import LlamaConfig, LlamaForCausalLM
    pairs = stdlib_chat_pairs()
    tok = build_tokenizer([m["content"] for r in pairs for m in r["messages"]], out / "target")
    cfg = LlamaConfig(vocab_size=49_152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100_000.0, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight[len(tok):] = 0
        model.lm_head.weight[tok.eos_token_id] = 0
    model.to(torch.bfloat16 if device != "cpu" else torch.float32).save_pretrained(out / "target")
    if data:
        return out / "target", data
    path = out / "data.jsonl"  # the pairs over again where --rows asks for more than there are
    path.write_text("".join(json.dumps(pairs[i % len(pairs)]) + "\n" for i in range(rows)))
    return out / "target", path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--shard-rows", type=int, default=256)
    ap.add_argument("--max-prompt-len", type=int, default=4096)
    ap.add_argument("--data", default=None, help="prompts from this DATA instead of the stdlib pairs")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    gpus = [0] if torch.cuda.is_available() else []
    tmp = Path(tempfile.mkdtemp(prefix="regen-cli-"))
    target, data = build(tmp, a.rows, "cuda" if gpus else "cpu", a.data)

    def once(name: str, rows: int, grouped: bool) -> dict:
        cfg = RegenConfig(data=str(data), target=str(target), out=str(tmp / name), gpus=gpus, max_rows=rows,
                          max_new_tokens=a.max_new, batch_size=a.batch, shard_rows=a.shard_rows, progress=False,
                          max_prompt_len=a.max_prompt_len)
        group_of = R.group_of
        if not grouped:
            R.group_of = lambda cfg, k, world=1: (k % world, k // world)  # one shard per engine call
        try:
            t = time.perf_counter()
            s = R.run(cfg)
            s["wall_s"] = round(time.perf_counter() - t, 2)
        finally:
            R.group_of = group_of
        print(f"{name:>14}: {s['rows']:>5} rows, {s['new_tokens']:>9,} tokens in {s['wall_s']:7.2f} s "
              f"(model load included) = {s['new_tokens'] / s['wall_s']:9,.0f} tok/s", flush=True)
        return s

    once("warm-up", min(64, a.rows), True)  # kernels, allocator, the target's first load
    res = {"shard by shard": once("shard-by-shard", a.rows, False), "grouped": once("grouped", a.rows, True)}
    r = res["shard by shard"]["wall_s"] / res["grouped"]["wall_s"]
    files = [sorted((tmp / d).glob("part-*.jsonl")) for d in ("shard-by-shard", "grouped")]
    same = sum(x.read_text() == y.read_text() for x, y in zip(*files))
    print(f"grouped is {r:.2f}x faster; {same} shard file(s) identical between the two")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "runs": res, "speedup": r}, indent=2))


if __name__ == "__main__":
    main()
