"""Real speculative decoding on the target's device: tau, tokens per target forward, timings.

    python bench/spec_bench.py --tiny build/tiny-target --drafter runs/default/export \\
        --data build/corpus/chat.jsonl --prompts 8 --max-new 48            # the demo's pair
    python bench/spec_bench.py --shape 27b --prompts 2 --max-new 64        # timing path, random weights

`--tiny`: the trained tiny target and an exported drafter through eval.speculative.evaluate_drafter,
on the GPU in bf16 and fp32 (and on the CPU for the same prompts when --cpu is given). `--shape
27b`: a random Qwen3.6-27B-shaped target and a random 27B drafter built in memory (no
checkpoint): tau means nothing there, the timings are the point (a verification forward of 16
tokens against one greedy step, the rollback's recompute, the drafter's proposal).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from shapes import drafter_27b_config, random_target, target_27b_config  # noqa: E402

from eval.config import SpecConfig
from eval.speculative import Target, decode_all, drafter_proposal, evaluate_drafter, greedy, speculative
from shared.dflash import DFlashDraftModel


def tiny(a) -> list[dict]:
    rows = []
    runs = [("cuda", "bf16"), ("cuda", "fp32")] if torch.cuda.is_available() else []
    runs += [("cpu", "fp32")] if a.cpu or not runs else []
    for device, dtype in runs:
        s = evaluate_drafter(SpecConfig(drafter=a.drafter, target=a.tiny, data=a.data, prompts=a.prompts,
                                        max_new=a.max_new, progress=False, device=device, dtype=dtype))
        rows.append({k: s[k] for k in ("device", "dtype", "tau", "blocks", "histogram", "tokens_per_target_forward",
                                       "greedy_seconds", "speculative_seconds", "speedup", "greedy_ms_per_token")}
                    | {"mismatches": len(s["mismatches"]), "prompts": s["prompts"]})
    return rows


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t


def shape_27b(a) -> dict:
    device = torch.device("cuda")
    dtype = torch.bfloat16
    model = random_target(target_27b_config(a.layers), device, dtype)
    dcfg = drafter_27b_config(layers=5)
    if a.layers != 64:  # fewer target layers: keep the drafter's layer ids inside them
        from shared.target import default_layer_ids
        dcfg.num_target_layers, dcfg.target_layer_ids = a.layers, default_layer_ids(a.layers, 5)
    torch.manual_seed(0)
    from transformers import Qwen3Config
    with torch.device(device):
        drafter = DFlashDraftModel(Qwen3Config.from_dict(dcfg.to_hf())).to(dtype).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 248_000, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)]
    # warm-up: kernels and autotuning for the shapes below
    greedy(Target(model, []), list(prompts[0]), 4, None)
    speculative(Target(model, dcfg.target_layer_ids), drafter_proposal(drafter, model.get_input_embeddings().weight,
                                                                        model.lm_head.weight), list(prompts[0]), 20, None)
    s = decode_all(model, drafter, prompts, a.max_new, None, progress=False)
    # one verification forward of a whole block vs one greedy step, with a cache of prompt_len
    tgt = Target(model, dcfg.target_layer_ids)
    cache = tgt.new_cache()
    _, _, cache = tgt(prompts[0], cache)
    import copy
    snap = copy.deepcopy(cache)
    def median(fn):
        fn()
        return sorted(timed(fn, device)[1] for _ in range(5))[2]
    t_block = median(lambda: tgt(prompts[0][:dcfg.block_size], copy.deepcopy(snap)))
    t_copy = median(lambda: copy.deepcopy(snap))
    t_one = median(lambda: Target(model, [])([prompts[0][0]], copy.deepcopy(snap)))
    embed, head = model.get_input_embeddings().weight, model.lm_head.weight
    ctx = [torch.randn(a.prompt_len, len(dcfg.target_layer_ids) * dcfg.hidden_size, device=device, dtype=dtype)]
    propose = drafter_proposal(drafter, embed, head)
    propose(list(prompts[0]), ctx)  # the first call at a new shape pays kernel selection: not timed
    t_draft = sorted(timed(lambda: propose(list(prompts[0]), ctx), device)[1] for _ in range(5))[2]
    return {"target_params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 2), "prompt_len": a.prompt_len,
            "tau": s["tau"], "tokens_per_target_forward": s["tokens_per_target_forward"],
            "greedy_ms_per_token": s["greedy_ms_per_token"],
            "speculative_seconds": s["speculative_seconds"], "greedy_seconds": s["greedy_seconds"],
            "verify_block_ms": round(1000 * (t_block - t_copy), 2), "one_token_ms": round(1000 * (t_one - t_copy), 2),
            "cache_copy_ms": round(1000 * t_copy, 2), "draft_ms": round(1000 * t_draft, 2),
            "mismatches": len(s["mismatches"]), "new_tokens": s["new_tokens"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", default=None, help="a trained target folder (the demo's build/tiny-target)")
    ap.add_argument("--drafter", default="runs/default/export")
    ap.add_argument("--data", default="build/corpus/chat.jsonl")
    ap.add_argument("--shape", choices=("27b",), default=None)
    ap.add_argument("--layers", type=int, default=64, help="target layers of the 27B shape")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--cpu", action="store_true", help="also decode on the CPU (tiny)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out = {}
    if a.tiny:
        out["tiny"] = tiny(a)
        print("| device | dtype | tau | tokens/target forward | greedy ms/token | speculative s | greedy s | "
              "speedup | mismatches |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in out["tiny"]:
            print(f"| {r['device']} | {r['dtype']} | {r['tau']:.3f} | {r['tokens_per_target_forward']:.3f} | "
                  f"{r['greedy_ms_per_token']:.2f} | {r['speculative_seconds']:.2f} | {r['greedy_seconds']:.2f} | "
                  f"{r['speedup']:.2f}x | {r['mismatches']}/{r['prompts']} |")
    if a.shape:
        r = out["27b"] = shape_27b(a)
        print(json.dumps(r, indent=2))
        print(f"verification of {16} tokens {r['verify_block_ms']} ms vs one greedy step {r['one_token_ms']} ms "
              f"(ratio {r['verify_block_ms'] / max(r['one_token_ms'], 1e-9):.2f}); cache snapshot {r['cache_copy_ms']} ms; "
              f"drafter proposal {r['draft_ms']} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
