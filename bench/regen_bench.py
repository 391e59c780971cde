"""Regeneration throughput of the local engine (transformers generate with the hybrid cache)
at several batch sizes, through regenerate.engines.LocalEngine.generate_ids.

    python bench/regen_bench.py --tiny build/tiny-target --data build/corpus/chat.jsonl   # trained tiny target
    python bench/regen_bench.py --shape 27b                                             # random 27B-shaped target

Generated tokens/s counts every new token of every prompt (the end of turn included); the 27B
shape's random weights almost never produce the end-of-turn id, so its prompts run to --max-new.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from shapes import random_target, target_27b_config  # noqa: E402

from regenerate.config import RegenConfig
from regenerate.engines import LocalEngine


def measure(engine: LocalEngine, prompts: list[list[int]], batches: list[int], device) -> list[dict]:
    rows = []
    for bs in batches:
        engine.cfg.batch_size = bs
        engine.generate_ids(prompts[:bs], 0)  # warm-up: kernels and autotuning for these shapes
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        out = engine.generate_ids(prompts[:bs], 0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        s = time.perf_counter() - t
        tokens = sum(len(n) + stop for n, stop in out)
        rows.append({"batch": bs, "prompts": bs, "tokens": tokens, "seconds": round(s, 3),
                     "tok_s": round(tokens / s, 1), "ms_per_step": round(1000 * s / max(len(n) + stop for n, stop in out), 2)})
        print(f"batch {bs:>3}: {tokens:>6} tokens in {s:6.2f} s = {tokens / s:9,.1f} tok/s", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", default=None)
    ap.add_argument("--data", default="build/corpus/chat.jsonl")
    ap.add_argument("--shape", choices=("27b",), default=None)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256, help="27b: random prompt length")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches = [int(x) for x in a.batches.split(",")]
    res = {}
    if a.tiny:
        cfg = RegenConfig(data=a.data, out="-", target=a.tiny, max_new_tokens=a.max_new, progress=False)
        eng = LocalEngine(cfg, str(device))
        rows = [json.loads(l) for l in open(a.data)][:max(batches)]
        prompts = [eng.tok(eng.enc.prompt(r["messages"][:1]), add_special_tokens=False)["input_ids"] for r in rows]
        print(f"tiny target on {device}, {a.max_new} new tokens at most")
        res["tiny"] = measure(eng, prompts, batches, device)
    if a.shape:
        model = random_target(target_27b_config(), device, torch.bfloat16)
        cfg = RegenConfig(data="-", out="-", target="in-memory", max_new_tokens=a.max_new, progress=False)
        eng = LocalEngine.__new__(LocalEngine)  # the engine's generate path, a model built in memory
        eng.torch, eng.cfg, eng.device, eng.model = torch, cfg, device, model
        eng.eot, eng.pad = 248_319, 0  # random weights: an end of turn is as likely as any token (rare)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 248_000, (a.prompt_len,), generator=g).tolist() for _ in range(max(batches))]
        print(f"random 27B-shaped target ({sum(p.numel() for p in model.parameters()) / 1e9:.1f}B), prompts of "
              f"{a.prompt_len}, {a.max_new} new tokens")
        res["27b"] = measure(eng, prompts, batches, device)
        del tok
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
