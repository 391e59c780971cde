"""Real speculative decoding at temperature 0 with the target and a DFlash drafter: acceptance
length (tau, docs/DESIGN.md, "Acceptance length") and wall-clock speedup over plain greedy decoding.

    python -m eval.speculative --drafter runs/x/export --target build/tiny-target \\
        --data build/corpus/chat.jsonl --prompts 16 --max-new 64

Per block: slot 0 = the last committed token; the drafter fills slots 1..block-1; the target
verifies all of them in one forward; the longest prefix matching the target's own choices is
accepted and the target's correction token committed after it. The hybrid target's cache holds
DeltaNet recurrent/conv states that cannot be cropped: after a partial accept the cache is
restored from a snapshot taken before verification and advanced over the accepted tokens only.
The output must equal plain greedy decoding token for token; any difference is an error.
"""

from __future__ import annotations

import copy
import inspect
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eval.config import SpecConfig
from shared.cli import from_args, parser_for, refuse_below
from shared.dflash import DFlashDraftModel
from shared.features import capture_layers
from shared.families import family_of
from shared.location import atomic_write_text
from shared.target import compute_dtype


@dataclass
class Result:
    tokens: list[int]
    forwards: int                      # target forwards (greedy: one per token; spec: verifications)
    seconds: float
    blocks: list[int] = field(default_factory=list)   # tokens committed per verification (tau samples)
    recomputes: int = 0                # re-advances after a partial accept
    anchors: list[int] = field(default_factory=list)  # position of each block's slot 0


def accept_length(drafted: list[int], target_choice: list[int]) -> int:
    """Accepted draft tokens: the longest prefix where draft i equals the target's choice i."""
    k = 0
    while k < len(drafted) and drafted[k] == target_choice[k]:
        k += 1
    return k


def acceptance_summary(blocks: list[int], block_size: int) -> dict:
    hist = [0] * (block_size + 1)
    for b in blocks:
        hist[b] += 1
    n = max(len(blocks), 1)
    return {"tau": sum(blocks) / n, "blocks": len(blocks), "histogram": hist}


class Target:
    """A causal LM with a cache, returning logits and the selected layers' hidden states."""

    def __init__(self, model, layer_ids: list[int]):
        self.model, self.layer_ids = model, layer_ids
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        # An attention-only cache drops rejected drafts by cropping; DeltaNet/conv states cannot
        # be cropped (they are restored from a snapshot and re-advanced instead).
        family = family_of(getattr(model.config, "model_type", None))
        self.croppable = family is not None and not family.fla

    def new_cache(self):
        from transformers import DynamicCache
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:
            return None

    @torch.no_grad()
    def __call__(self, ids: list[int], cache):
        x = torch.tensor([ids], device=self.model.device)
        with capture_layers(self.model, self.layer_ids) as got:
            out = self.model(input_ids=x, use_cache=True, **{self.cache_kw: cache})
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None) or cache
        feats = torch.cat([got[i][0] for i in self.layer_ids], dim=-1) if self.layer_ids else None
        return out.logits[0].float(), feats, cache


def _stop(tokens: list[int], n_prompt: int, max_new: int, eos: int | None) -> bool:
    new = tokens[n_prompt:]
    return len(new) >= max_new or (eos is not None and eos in new)


def _trim(tokens: list[int], n_prompt: int, max_new: int, eos: int | None) -> list[int]:
    new = tokens[n_prompt:n_prompt + max_new]
    if eos is not None and eos in new:
        new = new[:new.index(eos) + 1]
    return new


@torch.no_grad()
def greedy(target: Target, prompt: list[int], max_new: int, eos: int | None) -> Result:
    t0 = time.perf_counter()
    cache = target.new_cache()
    logits, _, cache = target(prompt, cache)
    tokens = prompt + [int(logits[-1].argmax())]
    forwards = 1
    while not _stop(tokens, len(prompt), max_new, eos):
        logits, _, cache = target([tokens[-1]], cache)
        tokens.append(int(logits[-1].argmax()))
        forwards += 1
    return Result(_trim(tokens, len(prompt), max_new, eos), forwards, time.perf_counter() - t0)


def load_served_drafter(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """A DFlash export (ours, or any checkpoint in the public layout) through this project's
    modeling file, the one every export ships: evaluation runs what serving loads, not the trainer."""
    return DFlashDraftModel.from_pretrained(str(path), dtype=dtype).to(device).eval()


def drafter_info(drafter) -> tuple[list[int], int, int]:
    """(target_layer_ids, block_size, mask_token_id) from a DFlashDraftModel's config."""
    d = drafter.config.dflash_config
    return list(d["target_layer_ids"]), int(drafter.block_size), int(d["mask_token_id"])


def drafter_proposal(drafter, embed: torch.Tensor, head: torch.Tensor):
    """propose(tokens, ctx) -> block_size - 1 draft tokens for the block anchored at the last
    committed token, from the target features of every earlier position (ctx)."""
    _, block, mask_id = drafter_info(drafter)
    dev = embed.device

    def propose(tokens: list[int], ctx: list[torch.Tensor]) -> list[int]:
        a = len(tokens) - 1                          # the anchor: its own features are not visible
        hidden = torch.cat(ctx, dim=0)[None, :a]     # positions 0..a-1
        noise = embed[torch.tensor([tokens[-1]] + [mask_id] * (block - 1), device=dev)][None]
        out = drafter(target_hidden=hidden.to(noise.dtype), noise_embedding=noise,
                      position_ids=torch.arange(a + block, device=dev)[None])[0]
        return (out[1:].to(head.dtype) @ head.T).argmax(-1).tolist()

    return propose


@torch.no_grad()
def speculative(target: Target, propose, prompt: list[int], max_new: int, eos: int | None) -> Result:
    """`propose` is drafter_proposal(...) (tests also pass oracles to force partial accepts)."""
    t0 = time.perf_counter()
    cache = target.new_cache()
    logits, feats, cache = target(prompt, cache)
    tokens = prompt + [int(logits[-1].argmax())]
    ctx = [feats]                                   # target features of every processed position
    res = Result([], 1, 0.0)
    while not _stop(tokens, len(prompt), max_new, eos):
        res.anchors.append(len(tokens) - 1)          # the anchor: last committed, not yet processed
        drafted = propose(tokens, ctx)
        snapshot = None if target.croppable else copy.deepcopy(cache)
        verify = [tokens[-1]] + drafted
        logits, feats, cache = target(verify, cache)
        choice = logits.argmax(-1).tolist()          # choice[i] = target's token for position a+1+i
        k = accept_length(drafted, choice)
        tokens += drafted[:k] + [choice[k]]
        if feats is not None:                        # prompt lookup reads no features
            ctx.append(feats[:k + 1])
        res.blocks.append(k + 1)
        res.forwards += 1
        if k < len(drafted):
            if target.croppable:  # keep the processed positions: every committed token but the last
                # a negative count removes that many (transformers 5.2x refuses an absolute size)
                cache.crop(-(cache.get_seq_length() - (len(tokens) - 1)))
            else:  # restore and advance over the accepted tokens only
                cache = snapshot
                _, _, cache = target(verify[:k + 1], cache)
                res.recomputes += 1
    res.tokens = _trim(tokens, len(prompt), max_new, eos)
    res.seconds = time.perf_counter() - t0
    return res


def prompts_from(data: str, tokenizer, n: int, max_prompt: int, template_kwargs: dict | None = None) -> list[list[int]]:
    """The last n usable chat rows of DATA, each cut before its last assistant turn and rendered
    as serving renders that turn's prompt (the earlier turns as the template shows history, with
    the chat template options the store was extracted with: serving must use the same)."""
    from shared.data import Encoder, RowError, iter_rows, normalize_chat, resolve
    enc = Encoder(tokenizer, max_prompt, "truncate", template_kwargs)
    rows = []
    for _, _, where, row in iter_rows(resolve(data)):
        if isinstance(row, RowError) or not isinstance(row, dict):
            continue
        try:
            msgs = normalize_chat(row, where)
            if msgs is None:
                continue
            last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
            text = enc.prompt(msgs[:last], row.get("tools"))
        except RowError:
            continue
        rows.append(tokenizer(text, add_special_tokens=False)["input_ids"][-max_prompt:])
    return rows[-n:]


class Dialogues:
    """A prompt set as decoding needs it: each row's user turns asked in order, each after the
    target's own greedy answers to the ones before (MT-Bench's second turn follows the target's
    first answer, as when it is served); a row that holds assistant turns is asked once, before
    its last one (its history as the row has it). Iterating yields prompt ids; answer(tokens)
    gives the greedy answer to the prompt just yielded."""

    def __init__(self, spec: str, tokenizer, n: int, max_prompt: int, template_kwargs: dict | None = None):
        from shared.data import Encoder, RowError, iter_rows, normalize_chat, resolve
        from shared.target import end_of_turn
        self.tok, self.max_prompt = tokenizer, max_prompt
        self.enc = Encoder(tokenizer, max_prompt, "truncate", template_kwargs)
        self.eos = end_of_turn(tokenizer)[1]
        self.rows: list[tuple[list[dict], list[str], object]] = []  # (history, questions, tools)
        for _, _, where, row in iter_rows(resolve(spec)):
            if isinstance(row, RowError) or not isinstance(row, dict):
                continue
            try:
                msgs = normalize_chat(row, where, require_assistant=False)
            except RowError:
                continue
            if not msgs:
                continue
            asst = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
            if asst:
                self.rows.append((msgs[:asst[-1]], [], row.get("tools")))
            else:
                first = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
                if first is not None:
                    self.rows.append((msgs[:first], [m["content"] for m in msgs[first:] if m["role"] == "user"],
                                      row.get("tools")))
            if n and len(self.rows) == n:
                break
        self._answer: list[int] | None = None

    def __len__(self) -> int:
        return sum(max(len(q), 1) for _, q, _ in self.rows)

    def answer(self, tokens: list[int]):
        self._answer = tokens

    def __iter__(self):
        for history, questions, tools in self.rows:
            history = list(history)
            for q in questions or [None]:
                if q is not None:
                    history.append({"role": "user", "content": q})
                text = self.enc.prompt(history, tools)
                self._answer = None
                yield self.tok(text, add_special_tokens=False)["input_ids"][-self.max_prompt:]
                ans = list(self._answer or [])
                if ans and ans[-1] == self.eos:
                    ans = ans[:-1]
                history.append({"role": "assistant", "content": self.tok.decode(ans)})


PROMPT_LOOKUP = object()  # decode_many's key for the baseline (with a block size): no drafter's name


def resolve_device(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    return dev, compute_dtype(dtype, dev)


def decode_all(target_model, drafter, prompts, max_new: int, eos: int | None, progress: bool = True,
               prompt_lookup: bool = True) -> dict:
    """Greedy and speculative decoding of every prompt (a list of ids, or Dialogues, told each
    greedy answer); tau, tokens per target forward, timings; beside the drafter, prompt lookup
    (eval/lookup.py) drafting as many tokens per block, on the same prompts."""
    return decode_many(target_model, {"drafter": drafter}, prompts, max_new, eos, progress, prompt_lookup)["drafter"]


def decode_many(target_model, drafters: dict, prompts, max_new: int, eos: int | None, progress: bool = True,
                prompt_lookup: bool = True, on_prompt=None) -> dict:
    """decode_all for several drafters of one target: each prompt is decoded greedily once and with
    prompt lookup once per block size, then with every drafter, so that N drafters cost N drafter
    decodings and not N times the baselines too. {name: decode_all's result for that drafter}.
    on_prompt(the same for the prompts done so far) after each prompt but the last."""
    from eval.lookup import prompt_lookup_proposal
    from shared.progress import progress_bar
    plain = Target(target_model, [])
    embed, head = target_model.get_input_embeddings().weight, target_model.lm_head.weight
    methods = {}
    for name, drafter in drafters.items():
        layer_ids, block, _ = drafter_info(drafter)
        methods[name] = (Target(target_model, layer_ids), drafter_proposal(drafter, embed, head), block)
    if prompt_lookup:  # as many tokens per block as a drafter drafts: once per block size among them
        for block in sorted({b for _, _, b in methods.values()}):
            methods[(PROMPT_LOOKUP, block)] = (plain, prompt_lookup_proposal(block - 1), block)
    runs = {m: {"blocks": [], "seconds": 0.0, "forwards": 0, "tokens": 0, "mismatches": []} for m in methods}
    t_greedy, g_forwards, n = 0.0, 0, 0

    def summary(m):
        r = runs[m]
        out = acceptance_summary(r["blocks"], methods[m][2])
        out.update({"new_tokens": r["tokens"], "tokens_per_target_forward": r["tokens"] / max(r["forwards"], 1),
                    "speculative_seconds": round(r["seconds"], 3), "speedup": t_greedy / max(r["seconds"], 1e-9),
                    "mismatches": r["mismatches"]})
        return out

    def collect() -> dict:
        results = {}
        for name in drafters:
            out = summary(name)
            out.update({"prompts": n, "prompts_asked": len(prompts), "greedy_seconds": round(t_greedy, 3),
                        "greedy_ms_per_token": round(1000 * t_greedy / max(g_forwards, 1), 3)})
            if prompt_lookup:
                out["prompt_lookup"] = summary((PROMPT_LOOKUP, methods[name][2]))
                out["mismatches"] = out["mismatches"] + [{"method": "prompt_lookup", **x}
                                                         for x in out["prompt_lookup"]["mismatches"]]
            results[name] = out
        return results

    for i, p in enumerate(progress_bar(prompts, total=len(prompts), desc="speculative decoding",
                                       disable=not progress)):
        g = greedy(plain, list(p), max_new, eos)
        t_greedy, g_forwards, n = t_greedy + g.seconds, g_forwards + g.forwards, n + 1
        if hasattr(prompts, "answer"):
            prompts.answer(g.tokens)
        for m, (tgt, propose, _) in methods.items():
            s = speculative(tgt, propose, list(p), max_new, eos)
            r = runs[m]
            if s.tokens != g.tokens:
                first = next((j for j, (x, y) in enumerate(zip(s.tokens, g.tokens)) if x != y),
                             min(len(s.tokens), len(g.tokens)))
                r["mismatches"].append({"prompt": i, "first_difference_at": first})
            r["blocks"] += s.blocks
            r["seconds"] += s.seconds
            r["forwards"] += s.forwards
            r["tokens"] += len(s.tokens)
        if on_prompt is not None and n < len(prompts):
            on_prompt(collect())
    return collect()


def check_drafter_target(drafter: str, target: str, allow: bool):
    """A drafter is judged with the target it was trained for: its export records the fingerprint
    of that target's embed_tokens/lm_head (a same-shaped other target runs, and measures nothing)."""
    from shared.target import exported_target, load_embed_and_head, read_config, tensors_fingerprint
    d = Path(drafter)
    if not (d / "model.safetensors").is_file() or not (d / "config.json").is_file():
        raise ValueError(f"DRAFTER {drafter}: no {'model.safetensors' if d.is_dir() else 'such folder'} (give an "
                         f"export folder of `python -m train`: RUN/export or RUN/best)")
    dc, tc = json.loads((d / "config.json").read_text()), read_config(target)
    for key in ("hidden_size", "vocab_size"):
        if dc.get(key) != tc[key]:
            raise ValueError(f"DRAFTER {drafter} has {key} {dc.get(key)}, TARGET {target} {tc[key]}: the drafter "
                             f"was made for another target")
    want = exported_target(drafter)
    if want is None or allow:
        return
    got = tensors_fingerprint(*load_embed_and_head(target))
    if got != want:
        raise ValueError(f"DRAFTER {drafter} was trained for another target: its embed/lm_head fingerprint {want} "
                         f"differs from TARGET {target}'s {got}; --allow-other-target evaluates anyway")


def evaluate_drafter(cfg: SpecConfig, on_progress=None) -> dict:
    """Decode the prompts of cfg.data (its last cfg.prompts rows) and of each prompt set (their
    first cfg.prompts rows) greedily, with the drafter and with prompt lookup: tau, speedup,
    exactness per set. The first set's figures are also the result's own keys. Several drafters
    of one target (--drafter repeated) share the baselines' decodings; the first one's result is
    the top level, and "drafters" holds each one's. on_progress(result so far) after each prompt
    but the last: a long evaluation cut off keeps the sets it finished and the prompts it finished
    of the set it was in (each set's `prompts` of `prompts_asked`; `complete` false).
    """
    from shared.target import end_of_turn, load_target, load_tokenizer
    if not cfg.data and not cfg.prompt_set:
        raise ValueError("give --data and/or --prompt-set (mt-bench, humaneval, or a DATA file)")
    refuse_below(cfg, ("max_new", "max_prompt"), 1)  # 0 new tokens would report a speedup of nothing
    if cfg.prompts < 0:
        raise ValueError(f"--prompts must be 0 (all) or more, not {cfg.prompts}")
    if not cfg.drafter:
        raise ValueError("give --drafter (an export folder of `python -m train`; repeatable)")
    if len(set(cfg.drafter)) < len(cfg.drafter):
        raise ValueError(f"--drafter names one folder twice: {cfg.drafter}")
    for d in cfg.drafter:
        check_drafter_target(d, cfg.target, cfg.allow_other_target)
    dev, dt = resolve_device(cfg.device, cfg.dtype)
    model = load_target(cfg.target, dev, dt)
    tok = load_tokenizer(cfg.target)
    drafters = {d: load_served_drafter(d, dev, dt) for d in cfg.drafter}
    eos = end_of_turn(tok)[1]
    sets = {}
    if cfg.data:
        sets["data"] = prompts_from(cfg.data, tok, cfg.prompts, cfg.max_prompt, cfg.chat_template_kwargs)
    for spec in cfg.prompt_set:
        sets[spec] = Dialogues(spec, tok, cfg.prompts, cfg.max_prompt, cfg.chat_template_kwargs)
    results = {d: {} for d in drafters}  # drafter -> set -> figures

    def one(drafter: str, complete: bool) -> dict:
        per_set = results[drafter]
        first = next(iter(per_set.values()))
        return {**first, "drafter": drafter, "sets": dict(per_set), "complete": complete,
                "mismatches": [{"set": k, **m} for k, r in per_set.items() for m in r["mismatches"]],
                "device": str(dev), "dtype": str(dt).removeprefix("torch.")}

    def result(complete: bool) -> dict:
        out = one(cfg.drafter[0], complete)
        if len(drafters) > 1:
            out["drafters"] = {d: one(d, complete) for d in drafters}
            out["mismatches"] = [{"drafter": d, **m} for d in drafters for m in out["drafters"][d]["mismatches"]]
        return out

    def progress(name: str):
        def done_so_far(partial: dict):
            for d, r in partial.items():
                results[d][name] = r
            on_progress(result(False))
        return done_so_far if on_progress is not None else None

    for i, (name, prompts) in enumerate(sets.items()):
        final = decode_many(model, drafters, prompts, cfg.max_new, eos, cfg.progress, cfg.prompt_lookup,
                            on_prompt=progress(name))
        for d, r in final.items():
            results[d][name] = r
        if on_progress is not None and i + 1 < len(sets):
            on_progress(result(False))
    return result(True)


def print_result(s: dict):
    """One drafter's figures per prompt set, as the command prints them."""
    for name, r in s["sets"].items():
        print(f"[{name}] tau {r['tau']:.3f} over {r['blocks']} blocks ({r['prompts']} prompts, {r['new_tokens']} "
              f"tokens); tokens per target forward {r['tokens_per_target_forward']:.3f}")
        print(f"[{name}] accepted-length histogram (tokens committed per verification): "
              + " ".join(f"{i}:{c}" for i, c in enumerate(r["histogram"]) if c))
        print(f"[{name}] wall clock ({s['device']}, {s['dtype']}): greedy {r['greedy_seconds']:.2f}s, speculative "
              f"{r['speculative_seconds']:.2f}s, speedup {r['speedup']:.2f}x")
        if "prompt_lookup" in r:
            pl = r["prompt_lookup"]
            print(f"[{name}] prompt lookup: tau {pl['tau']:.3f}, tokens per target forward "
                  f"{pl['tokens_per_target_forward']:.3f}, speedup {pl['speedup']:.2f}x; the drafter's tau is "
                  f"{r['tau'] / max(pl['tau'], 1e-9):.2f}x prompt lookup's")


def main(argv=None) -> int:
    try:
        cfg = from_args(SpecConfig, parser_for(SpecConfig, "python -m eval.speculative", __doc__).parse_args(argv))
    except SystemExit as e:  # argparse has printed why
        return int(e.code or 0)

    def partial(r: dict):  # the prompts finished so far, in case the rest never finishes
        if cfg.json:
            atomic_write_text(Path(cfg.json), json.dumps(r, indent=2))

    try:
        s = evaluate_drafter(cfg, on_progress=partial)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    for d, one in (s["drafters"] if "drafters" in s else {cfg.drafter[0]: s}).items():
        if "drafters" in s:
            print(f"== drafter {d}")
        print_result(one)
    if cfg.json:
        atomic_write_text(Path(cfg.json), json.dumps(s, indent=2))
    if s["mismatches"]:
        print(f"ERROR: speculative output differs from greedy on {len(s['mismatches'])} prompt(s): "
              f"{s['mismatches'][:5]}", file=sys.stderr)
        return 1
    print("output equals plain greedy decoding on every prompt" + (", with the drafter and with prompt lookup"
                                                                  if cfg.prompt_lookup else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
