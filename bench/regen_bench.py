"""Regeneration throughput of the local engine, through regenerate.engines.LocalEngine.generate_ids:
transformers' generate against our static-cache greedy decoder (regenerate/decode.py), in the same
run, on the same prompts.

    python bench/regen_bench.py --target SmolLM2-135M-Instruct.Q4_1.gguf --data sharegpt.jsonl \\
        --decoders generate:256:256,static:256:2048,static:512:2048 --max-new 512    # the real target
    python bench/regen_bench.py --target build/tiny-target --data build/corpus/chat.jsonl \\
        --decoders generate:16:64,generate:64:64                                    # tiny hybrid target
    python bench/regen_bench.py --shape 27b --decoders generate:16:16              # random 27B-shaped target

Each --decoders item is DECODER:BATCH:PROMPTS: PROMPTS first-turn prompts of DATA decoded at BATCH
(sorted by length as regeneration does), after a warm-up on 8 of them. Generated tokens/s counts the
tokens each turn keeps, its end of turn included (not the static decoder's steps past it). Where
both decoders ran, the greedy turns they share are compared: identical turns and the mean agreeing
prefix; every run is also compared with the first (e.g. generate at two batch sizes: what the
batch's kernels alone change in bf16, the baseline for the static decoder's agreement). The 27B shape's random weights
almost never produce the end-of-turn id, so its prompts run to --max-new.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from shapes import random_target, target_27b_config  # noqa: E402

from regenerate.config import RegenConfig
from regenerate.decode import StaticGreedy
from regenerate.engines import LocalEngine


def measure(engine: LocalEngine, prompts: list[list[int]], decoder: str, bs: int, n: int, device) -> tuple[dict, list]:
    engine.cfg.batch_size = bs
    engine.static = StaticGreedy(engine.model, bs) if decoder == "static" else None
    engine.generate_ids(prompts[:8], 0)  # warm-up: kernels, the first captured step (padded to the batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    out = engine.generate_ids(prompts[:n], 0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    s = time.perf_counter() - t
    tokens = sum(len(new) + stop for new, stop in out)
    row = {"decoder": decoder, "batch": bs, "prompts": n, "tokens": tokens, "seconds": round(s, 2),
           "tok_s": round(tokens / s, 1), "stopped": sum(stop for _, stop in out)}
    print(f"{decoder:>8} batch {bs:>4}: {n:>5} prompts, {tokens:>8,} tokens in {s:7.2f} s = {tokens / s:10,.1f} tok/s"
          + (f", peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else ""),
          flush=True)
    return row, out


def agreement(a: list, b: list) -> dict:
    same, prefix = 0, []
    for (x, _), (y, _) in zip(a, b):
        same += x == y
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        prefix.append(k / max(len(x), len(y), 1))
    return {"turns": len(prefix), "identical": same, "mean_prefix": round(sum(prefix) / max(len(prefix), 1), 4)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="checkpoint folder or .gguf")
    ap.add_argument("--data", default="build/corpus/chat.jsonl")
    ap.add_argument("--shape", choices=("27b",), default=None)
    ap.add_argument("--decoders", default="generate:16:64")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--max-prompt-len", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=256, help="27b: random prompt length")
    ap.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                    help="the target's dtype (auto: bf16 on a GPU, fp32 on the CPU)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    runs = [(d, int(b), int(n)) for d, b, n in (x.split(":") for x in a.decoders.split(","))]
    if a.target:
        from shared.data import RowError, iter_rows, normalize_chat, resolve
        cfg = RegenConfig(data=a.data, out="-", target=a.target, max_new_tokens=a.max_new, decoder="generate",
                          dtype=a.dtype, progress=False)
        eng = LocalEngine(cfg, str(device))
        prompts = []
        for _, _, label, row in iter_rows(resolve(a.data)):
            try:
                if isinstance(row, RowError):
                    continue
                x = eng.tok(eng.enc.prompt(normalize_chat(row, label)[:1]), add_special_tokens=False)["input_ids"]
            except (RowError, ValueError):
                continue
            if len(x) <= a.max_prompt_len:
                prompts.append(x)
            if len(prompts) >= max(n for _, _, n in runs):
                break
        print(f"{a.target} on {device}: {len(prompts)} first-turn prompts of {a.data} (<= {a.max_prompt_len} tokens), "
              f"{a.max_new} new tokens at most")
    else:
        model = random_target(target_27b_config(), device, torch.bfloat16)
        cfg = RegenConfig(data="-", out="-", target="in-memory", max_new_tokens=a.max_new, progress=False)
        eng = LocalEngine.__new__(LocalEngine)  # the engine's generate path, a model built in memory
        eng.torch, eng.cfg, eng.device, eng.model, eng.static = torch, cfg, device, model, None
        eng.eot, eng.pad = 248_319, 0  # random weights: an end of turn is as likely as any token (rare)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 248_000, (a.prompt_len,), generator=g).tolist()
                   for _ in range(max(n for _, _, n in runs))]
        print(f"random 27B-shaped target, prompts of {a.prompt_len}, {a.max_new} new tokens")
    rows, outs = [], {}
    first = None
    for d, b, n in runs:
        row, out = measure(eng, prompts, d, b, min(n, len(prompts)), device)
        if first is None:
            first = out
        else:  # every run against the first on the prompts both decoded: what batch size alone changes
            row["agrees_with_first"] = agreement(out, first)
            print(f"  against the first run: {row['agrees_with_first']}", flush=True)
        rows.append(row)
        outs.setdefault(d, out)
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "runs": rows}
    base = next((r for r in rows if r["decoder"] == "generate"), None)
    if base:
        for r in rows:
            r["vs_generate"] = round(r["tok_s"] / base["tok_s"], 2)
    if "generate" in outs and "static" in outs:
        res["agreement"] = agreement(outs["static"], outs["generate"])
        print(f"static vs generate on the same prompts: {res['agreement']}")
    print(json.dumps(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
