"""Regeneration: the target writes the assistant turns of DATA's rows, so that the drafter
trains on text its target would write (docs/DESIGN.md, "Regeneration").

Output: a DATA folder `make extract` reads (OUT/part-00000.jsonl, ...), the same chat schema,
each row with its provenance under "meta". Rows are cut into shards of `shard_rows` consecutive
source rows; a shard is written through a temporary name and renamed when all its rows are done,
so a kill at any moment loses only unfinished shards and a rerun of the same command writes
every source row exactly once (greedy runs identically to an uninterrupted run).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from shared.chat import THINK_END, split_reasoning
from shared.cli import opt, parse_gpus, parse_json_object
from shared.data import DataError, Encoder, RowError, describe, iter_rows, normalize_chat, resolve
from shared.progress import log, progress_bar
from shared.store import atomic_write_text

STATE = "_regenerate.state"  # not a DATA suffix: extraction never reads it as rows


class RegenError(RuntimeError):
    pass


@dataclass
class RegenConfig:
    data: str = opt(help="rows whose prompts are kept (every format `make extract` reads)")
    out: str = opt(help="output DATA folder (sharded jsonl); rerun the same command to resume")
    target: str | None = opt(None, "local HF checkpoint that writes the answers (engine local), recorded "
                                   "in the provenance")
    engine: Literal["local", "openai"] = opt("local", "local: transformers generate on the target's device; "
                                                      "openai: a running OpenAI-compatible server (vLLM, SGLang)")
    gpus: list[int] = opt(help="e.g. 0,1: one worker per GPU; empty: CPU", parse=parse_gpus, default_factory=list)
    base_url: str | None = opt(None, "openai engine: the server, e.g. http://127.0.0.1:8000/v1")
    model: str | None = opt(None, "openai engine: the served model name (default: the target folder's name)")
    api_key_env: str = opt("OPENAI_API_KEY", "openai engine: environment variable holding the API key, if any")
    concurrency: int = opt(16, "openai engine: requests in flight")
    retries: int = opt(5, "openai engine: attempts per request on errors, 429 and 5xx (exponential backoff)")
    request_timeout: float = opt(600.0, "openai engine: seconds per request")
    turns: Literal["last", "all"] = opt("last", "regenerate the last assistant turn, or every one in order "
                                                "(each conditioned on the regenerated earlier ones)")
    max_new_tokens: int = opt(512, "tokens per generated turn; a turn that hits it is kept, its finish "
                                   "reason 'length' recorded")
    temperature: float = opt(0.0, "0: greedy")
    top_p: float = opt(1.0, "nucleus sampling when temperature > 0")
    seed: int = opt(0, "sampling seed (per shard and batch locally, per row for the openai engine)")
    chat_template_kwargs: dict = opt(help="JSON object for the chat template, as serving passes it, e.g. "
                                          "'{\"enable_thinking\": false}'", parse=parse_json_object,
                                     default_factory=dict)
    drop_length: bool = opt(False, "drop rows whose generation hit --max-new-tokens instead of keeping them")
    batch_size: int = opt(32, "local engine: prompts per generate call (batched by prompt length)")
    max_prompt_len: int = opt(4096, "prompts longer than this (tokens) are skipped as too_long")
    shard_rows: int = opt(256, "source rows per output shard (the unit of resume)")
    dtype: Literal["auto", "bf16", "fp32"] = opt("auto", "local engine: auto = bf16 on GPU, fp32 on CPU")
    progress: bool = opt(True, "tqdm progress bar")

    def validate(self):
        if self.engine == "local" and not self.target:
            raise RegenError("--engine local needs --target")
        if self.engine == "openai" and not self.base_url:
            raise RegenError("--engine openai needs --base-url (e.g. http://127.0.0.1:8000/v1)")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise RegenError("--temperature must be >= 0 and --top-p in (0, 1]")
        for name in ("max_new_tokens", "batch_size", "shard_rows", "concurrency", "retries"):
            if getattr(self, name) < 1:
                raise RegenError(f"--{name.replace('_', '-')} must be at least 1")
        return self

    def generation(self) -> dict:
        """The settings that decide what is generated: a resumed run must repeat them."""
        keys = ("engine", "model", "turns", "max_new_tokens", "temperature", "top_p", "seed",
                "chat_template_kwargs", "drop_length", "max_prompt_len", "shard_rows", "batch_size", "dtype")
        return {k: getattr(self, k) for k in keys}


# --- rows and turns -----------------------------------------------------------------------------

@dataclass
class Reply:
    text: str
    finish_reason: str            # "stop" | "length" | "error" (the row is skipped, `error` says why)
    tokens: int
    tool_calls: list | None = None
    error: tuple[str, str] | None = None  # (reason, message) when the row cannot be answered
    reasoning: str | None = None  # the turn's thinking, apart from its content (as templates take it back)

    @classmethod
    def of_text(cls, text: str, finish_reason: str, tokens: int) -> "Reply":
        """A locally generated turn: thinking the model closed with </think> (after a generation
        prompt that opened it) becomes reasoning_content, as a server's reasoning parser returns it."""
        reasoning, content = split_reasoning(text)
        return cls(content, finish_reason, tokens, reasoning=reasoning if THINK_END in text else None)


@dataclass
class Job:
    """One source row being regenerated: prompt turns kept, assistant turns written in order."""
    g: int                         # row ordinal over all sources
    file: int
    row: int
    source: dict                   # the row as read (tools and other fields are kept)
    todo: list[list[dict]]         # per turn to write: the source messages up to it (exclusive)
    tail: list[dict]               # messages after the last written turn
    done: list[dict] = field(default_factory=list)   # the conversation so far, regenerated turns in
    reasons: list[str] = field(default_factory=list)
    tokens: int = 0
    error: tuple[str, str] | None = None  # why the row cannot be regenerated (it is skipped)

    @classmethod
    def of(cls, g, fi, ri, row, msgs, turns: str) -> "Job":
        asst = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if not asst:  # a prompt-only row: the answer is appended
            return cls(g, fi, ri, row, [msgs], [])
        if turns == "last":
            return cls(g, fi, ri, row, [msgs[:asst[-1]]], msgs[asst[-1] + 1:])
        cuts = [msgs[(asst[k - 1] + 1 if k else 0):i] for k, i in enumerate(asst)]
        return cls(g, fi, ri, row, cuts, msgs[asst[-1] + 1:])

    def pending(self) -> bool:
        return self.error is None and len(self.reasons) < len(self.todo)

    def prompt(self) -> list[dict]:
        return self.done + self.todo[len(self.reasons)]

    def accept(self, r: Reply):
        if r.error is not None:
            self.error = r.error
            return
        self.done = self.prompt() + [{"role": "assistant", "content": r.text,
                                      **({"reasoning_content": r.reasoning} if r.reasoning is not None else {}),
                                      **({"tool_calls": r.tool_calls} if r.tool_calls else {})}]
        self.reasons.append(r.finish_reason)
        self.tokens += r.tokens


def read_jobs(cfg: RegenConfig) -> tuple[list[dict], list[Job], Counter, dict]:
    """Every row of DATA as a job, in source order; bad rows counted by reason and named."""
    sources = describe(resolve(cfg.data))
    jobs, skipped, examples = [], Counter(), {}
    files = [Path(s["path"]) for s in sources]
    for g, (fi, ri, where, row) in enumerate(iter_rows(files)):
        try:
            if isinstance(row, RowError):
                raise row
            if not isinstance(row, dict):
                raise RowError("bad_field", where, f"row is a {type(row).__name__}, not an object")
            msgs = normalize_chat(row, where, require_assistant=False)
            if msgs is None:
                raise RowError("bad_field", where, "a plain 'text' row has no prompt to answer")
            jobs.append(Job.of(g, fi, ri, row, msgs, cfg.turns))
        except RowError as e:
            skipped[e.reason] += 1
            examples.setdefault(e.reason, str(e))
    if not jobs:
        raise DataError(f"DATA {cfg.data}: no usable rows ({dict(skipped)})")
    return sources, jobs, skipped, examples


# --- engines -----------------------------------------------------------------------------------

class LocalEngine:
    """transformers generate on the target's device, batched by prompt length, with the hybrid
    (DeltaNet + attention) cache the model's own generate builds."""

    def __init__(self, cfg: RegenConfig, device: str, model=None, tokenizer=None):
        import torch

        from shared.target import compute_dtype, end_of_turn, load_target, load_tokenizer
        self.torch, self.cfg = torch, cfg
        self.device = torch.device(device)
        dtype = compute_dtype(cfg.dtype, self.device)
        # benchmarks pass a model built in memory; otherwise loaded from cfg.target
        self.model = model if model is not None else load_target(cfg.target, self.device, dtype)
        self.tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.target)
        self.enc = Encoder(self.tok, cfg.max_prompt_len, "skip", cfg.chat_template_kwargs)
        self.eot = end_of_turn(self.tok)[1]
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eot

    def generate(self, prompts: list[tuple[list[dict], list | None]], seed: int) -> list[Reply]:
        out: list[Reply | None] = [None] * len(prompts)
        ids, where = [], []
        for i, (m, t) in enumerate(prompts):
            try:
                x = self.tok(self.enc.prompt(m, t), add_special_tokens=False)["input_ids"]
            except RowError as e:
                out[i] = Reply("", "error", 0, error=(e.reason, str(e)))
                continue
            if len(x) > self.cfg.max_prompt_len:
                out[i] = Reply("", "error", 0, error=("too_long", f"prompt of {len(x)} tokens > --max-prompt-len "
                                                                  f"{self.cfg.max_prompt_len}"))
                continue
            ids.append(x)
            where.append(i)
        for i, (new, stop) in zip(where, self.generate_ids(ids, seed) if ids else []):
            out[i] = Reply.of_text(self.tok.decode(new, skip_special_tokens=False), "stop" if stop else "length",
                                   len(new) + stop)
        return out  # type: ignore[return-value]

    def generate_ids(self, ids: list[list[int]], seed: int) -> list[tuple[list[int], bool]]:
        """(new tokens before the end of turn, whether it stopped) per prompt, in prompt order."""
        torch = self.torch
        order = sorted(range(len(ids)), key=lambda i: (-len(ids[i]), i))
        out: list[tuple[list[int], bool] | None] = [None] * len(ids)
        for b, lo in enumerate(range(0, len(order), self.cfg.batch_size)):
            batch = order[lo:lo + self.cfg.batch_size]
            S = max(len(ids[i]) for i in batch)
            x = torch.full((len(batch), S), self.pad, dtype=torch.long)
            att = torch.zeros((len(batch), S), dtype=torch.long)
            for r, i in enumerate(batch):  # left padding: every prompt ends where generation starts
                x[r, S - len(ids[i]):] = torch.tensor(ids[i])
                att[r, S - len(ids[i]):] = 1
            sample = self.cfg.temperature > 0
            if sample:
                torch.manual_seed(seed * 1_000_003 + b)
            kw = dict(do_sample=True, temperature=self.cfg.temperature, top_p=self.cfg.top_p) if sample else \
                dict(do_sample=False)
            with torch.no_grad():
                gen = self.model.generate(input_ids=x.to(self.device), attention_mask=att.to(self.device),
                                          max_new_tokens=self.cfg.max_new_tokens, eos_token_id=self.eot,
                                          pad_token_id=self.pad, **kw)
            for r, i in enumerate(batch):
                new = gen[r, S:].tolist()
                stop = self.eot in new
                out[i] = (new[:new.index(self.eot)] if stop else new, stop)
        return out  # type: ignore[return-value]


class OpenAIEngine:
    """A running OpenAI-compatible server (vllm serve, SGLang): /chat/completions with bounded
    concurrency and retries with exponential backoff on connection errors, 429 and 5xx."""

    def __init__(self, cfg: RegenConfig):
        self.cfg = cfg
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"
        self.model = cfg.model or (Path(cfg.target).name if cfg.target else "default")
        key = os.environ.get(cfg.api_key_env)
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        self.pool = ThreadPoolExecutor(cfg.concurrency)

    def _one(self, messages, tools, seed: int) -> Reply:
        body = {"model": self.model, "messages": messages, "max_tokens": self.cfg.max_new_tokens,
                "temperature": self.cfg.temperature, "top_p": self.cfg.top_p, "seed": seed}
        if tools:
            body["tools"] = tools
        if self.cfg.chat_template_kwargs:  # vLLM and SGLang pass it to the chat template
            body["chat_template_kwargs"] = self.cfg.chat_template_kwargs
        data = json.dumps(body).encode()
        err = None
        for attempt in range(self.cfg.retries):
            try:
                req = urllib.request.Request(self.url, data=data, headers=self.headers, method="POST")
                with urllib.request.urlopen(req, timeout=self.cfg.request_timeout) as resp:
                    ans = json.loads(resp.read())
                choice = ans["choices"][0]
                msg = choice.get("message") or {}
                reason = "length" if choice.get("finish_reason") == "length" else "stop"
                tokens = (ans.get("usage") or {}).get("completion_tokens", 0)
                # a server with a reasoning parser returns the thinking apart (reasoning_content, or
                # reasoning in newer vLLM): kept, or the turn would be trained without it
                reasoning = next((msg[k] for k in ("reasoning_content", "reasoning") if isinstance(msg.get(k), str)),
                                 None)
                return Reply(msg.get("content") or "", reason, int(tokens), msg.get("tool_calls") or None,
                             reasoning=reasoning)
            except urllib.error.HTTPError as e:
                err = f"HTTP {e.code}: {e.read()[:200]!r}"
                if e.code != 429 and e.code < 500:  # this row refused (too long, bad tools): retrying changes nothing
                    return Reply("", "error", 0, error=("server_refused", f"{self.url}: {err}"))
            except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError, KeyError) as e:
                err = f"{type(e).__name__}: {e}"
            time.sleep(min(30.0, 0.2 * 2 ** attempt))
        raise RegenError(f"{self.url}: request failed after {self.cfg.retries} attempt(s): {err}")

    def generate(self, prompts, seed: int) -> list[Reply]:
        return list(self.pool.map(lambda p: self._one(p[1][0], p[1][1], seed + p[0]), enumerate(prompts)))


# --- shards --------------------------------------------------------------------------------------

def shard_path(out: Path, k: int) -> Path:
    return out / f"part-{k:05d}.jsonl"


def run_shard(engine, cfg: RegenConfig, k: int, jobs: list[Job], sources: list[dict], target_id: str) -> dict:
    """Every turn of every job of shard k, round by round; then the shard file, atomically."""
    rnd = 0
    while any(j.pending() for j in jobs):
        active = [j for j in jobs if j.pending()]
        replies = engine.generate([(j.prompt(), j.source.get("tools")) for j in active],
                                  seed=cfg.seed * 100_003 + k * 101 + rnd if cfg.engine == "local" else
                                  cfg.seed + 1_000_000 * rnd + active[0].g)
        for j, r in zip(active, replies):
            j.accept(r)
        rnd += 1
    lines, stats, examples = [], Counter(), {}
    gen = {k2: v for k2, v in cfg.generation().items() if k2 not in ("shard_rows", "batch_size")}
    for j in jobs:
        if j.error is not None:
            reason, msg = j.error
            stats[f"skipped_{reason}"] += 1
            examples.setdefault(reason, f"{sources[j.file]['path']} row {j.row}: {msg}")
            continue
        stats["tokens"] += j.tokens
        for r in j.reasons:
            stats[f"finish_{r}"] += 1
        if cfg.drop_length and "length" in j.reasons:
            stats["skipped_length"] += 1
            examples.setdefault("length", f"{sources[j.file]['path']} row {j.row}: hit --max-new-tokens (--drop-length)")
            continue
        row = {k2: v for k2, v in j.source.items() if k2 not in ("messages", "conversations", "meta")}
        row["messages"] = j.done + j.tail
        row["meta"] = {"source": {"file": sources[j.file]["path"], "row": j.row, "sha256": sources[j.file]["sha256"]},
                       "target": target_id, "generation": gen, "finish_reason": j.reasons[-1],
                       "finish_reasons": j.reasons, "new_tokens": j.tokens}
        lines.append(json.dumps(row, ensure_ascii=False))
        stats["rows"] += 1
    # the shard's counts first (not a DATA suffix), then the shard: a shard file means both are whole
    atomic_write_text(shard_path(Path(cfg.out), k).with_suffix(".stats"),
                      json.dumps({"stats": dict(stats), "examples": examples}))
    atomic_write_text(shard_path(Path(cfg.out), k), "".join(line + "\n" for line in lines))
    return dict(stats)


def _target_id(cfg: RegenConfig) -> str:
    if cfg.engine == "openai":
        return f"openai:{cfg.base_url}#{cfg.model or (Path(cfg.target).name if cfg.target else 'default')}"
    from shared.target import weights_fingerprint
    return weights_fingerprint(cfg.target)


def _worker(cfg: RegenConfig, device: str, shards: dict[int, list[Job]], sources, target_id, progress_q):
    engine = LocalEngine(cfg, device) if cfg.engine == "local" else OpenAIEngine(cfg)
    for k, jobs in shards.items():
        stats = run_shard(engine, cfg, k, jobs, sources, target_id)
        progress_q.put((len(jobs), stats.get("tokens", 0)))


def run(cfg: RegenConfig) -> dict:
    cfg.validate()
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise RegenError(f"OUT {out} is an existing file, not a folder")
    if cfg.engine == "local":  # a missing or broken target is refused before anything is written
        from shared.target import check_safetensors, read_config
        read_config(cfg.target)
        check_safetensors(cfg.target)
    sources, jobs, skipped, examples = read_jobs(cfg)
    target_id = _target_id(cfg)
    state = {"data": cfg.data, "sources": [s["sha256"] for s in sources], "target": target_id,
             "generation": cfg.generation()}
    out.mkdir(parents=True, exist_ok=True)
    if (out / STATE).exists():
        old = json.loads((out / STATE).read_text())
        diffs = [k for k in state if old.get(k) != state[k]]
        if diffs:
            raise RegenError(f"OUT {out} was written with other {', '.join(diffs)} ({old} vs {state}): "
                             f"use another OUT, or delete it to start over")
    else:
        atomic_write_text(out / STATE, json.dumps(state, indent=2))
    shards: dict[int, list[Job]] = {}
    for j in jobs:
        shards.setdefault(j.g // cfg.shard_rows, []).append(j)
    todo = {k: v for k, v in shards.items() if not shard_path(out, k).exists()}
    for tmp in out.glob("part-*.tmp*"):
        tmp.unlink()  # a shard a crash left half-written
    devices = [f"cuda:{g}" for g in cfg.gpus] if cfg.gpus else ["cpu"]
    if cfg.engine == "openai":
        devices = ["cpu"]  # one client process; concurrency is the server's
    world = len(devices)
    done_rows = sum(len(v) for k, v in shards.items() if k not in todo)
    bar = progress_bar(total=len(jobs), initial=done_rows, unit=" rows", disable=not cfg.progress,
                       desc=f"regenerate ({world} worker{'s' * (world > 1)})")
    t0, tokens = time.time(), 0
    ctx = mp.get_context("spawn")
    q = ctx.Queue() if world > 1 else queue.Queue()
    parts = [{k: v for k, v in todo.items() if k % world == r} for r in range(world)]
    errors: list[BaseException] = []
    if world == 1:  # in this process: errors come back as exceptions
        def guarded():
            try:
                _worker(cfg, devices[0], parts[0], sources, target_id, q)
            except BaseException as e:  # surfaced below
                errors.append(e)
        procs = [threading.Thread(target=guarded, daemon=True)]
    else:  # one process per GPU
        procs = [ctx.Process(target=_worker, args=(cfg, d, parts[r], sources, target_id, q))
                 for r, d in enumerate(devices)]
    remaining = sum(len(v) for v in todo.values())
    if not remaining:
        procs = []  # nothing left: no target to load
        log(f"{out}: every shard already written, nothing to do")
    for p in procs:
        p.start()
    while remaining > 0:
        try:
            n, t = q.get(timeout=0.5)
        except queue.Empty:
            alive = [p.is_alive() for p in procs]
            failed = errors or [p.exitcode for p in procs if hasattr(p, "exitcode") and p.exitcode not in (None, 0)]
            if failed or not any(alive):
                for p in procs:
                    if hasattr(p, "terminate"):
                        p.terminate()
                if errors:
                    raise errors[0]
                raise RegenError(f"worker(s) failed ({failed}); finished shards are kept: rerun the same command")
            continue
        remaining -= n
        tokens += t
        bar.update(n)
        bar.set_postfix(tok_s=f"{tokens / max(time.time() - t0, 1e-9):,.0f}")
    for p in procs:
        p.join()
    bar.close()
    if errors:
        raise errors[0]
    return summarize(out, skipped, examples, time.time() - t0, tokens)


def summarize(out: Path, skipped: Counter, examples: dict, seconds: float, tokens: int) -> dict:
    rows, reasons, total_tokens = 0, Counter(), 0
    skipped, examples = Counter(skipped), dict(examples)
    for f in sorted(out.glob("part-*.jsonl")):
        for line in f.read_text().splitlines():
            meta = json.loads(line)["meta"]
            rows += 1
            reasons.update(meta["finish_reasons"])
            total_tokens += meta["new_tokens"]
        st = json.loads(f.with_suffix(".stats").read_text())
        for key, n in st["stats"].items():
            if key.startswith("skipped_"):
                skipped[key[len("skipped_"):]] += n
        for reason, ex in st["examples"].items():
            examples.setdefault(reason, ex)
    for reason, n in sorted(skipped.items()):
        log(f"skipped {n} row(s): {reason}; first: {examples[reason]}")
    return {"rows": rows, "new_tokens": total_tokens, "finish_reasons": dict(reasons), "skipped": dict(skipped),
            "this_run_seconds": round(seconds, 1), "this_run_tokens_per_s": round(tokens / max(seconds, 1e-9), 1)}
