"""Regeneration: the target writes the assistant turns of DATA's rows, so that the drafter
trains on text its target would write (docs/DESIGN.md, "Regeneration").

Output: a DATA folder `make extract` reads (OUT/part-00000.jsonl, ...), the same chat schema,
each row with its provenance under "meta". Rows are cut into shards of `shard_rows` consecutive
source rows; a shard is written through a temporary name and renamed when all its rows are done,
so a kill at any moment loses only unfinished shards and a rerun of the same command writes
every source row exactly once (greedy runs identically to an uninterrupted run).

Consecutive shards are decoded together, in groups of at least four batches (`group_of`): the
engine sorts a group's prompts by length and fills whole batches. One shard at a time gave the
engine 256 prompts for a batch of 512 (the static decoder pads the batch to full size) and a new
cache length, hence new captured graphs, for every shard.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from regenerate.config import RegenConfig, RegenError
from regenerate.engines import LocalEngine, OpenAIEngine
from regenerate.jobs import Job, read_jobs
from shared.data import CHAT_FIELDS
from shared.launch import WorkerFailed, run_workers
from shared.location import atomic_write_text
from shared.progress import log, progress_bar

STATE = "_regenerate.state"  # not a DATA suffix: extraction never reads it as rows


def shard_path(out: Path, k: int) -> Path:
    return out / f"part-{k:05d}.jsonl"


def read_shard(path: Path) -> list[dict]:
    """A written shard's rows. Rows end at LF only: str.splitlines() would also split inside a
    row at U+2028, U+2029 or U+0085, which json.dumps(ensure_ascii=False) leaves raw in the text."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n")[:-1]]


def group_of(cfg: RegenConfig, k: int, world: int = 1) -> tuple[int, int]:
    """(worker, group) of shard k: the shards are dealt to the workers in turn, and each worker
    decodes its consecutive shards in groups holding at least four batches of rows. Fixed by the
    command (its settings and --gpus), so a rerun decodes the same groups."""
    per = max(1, -(-4 * cfg.batch_size // cfg.shard_rows))
    return k % world, (k // world) // per


def deal(cfg: RegenConfig, shards: dict[int, list[Job]], world: int) -> list[dict[int, dict[int, list[Job]]]]:
    """Per worker, its groups of shards (group -> shard -> jobs), by `group_of`."""
    parts: list[dict[int, dict[int, list[Job]]]] = [{} for _ in range(world)]
    for k, v in sorted(shards.items()):
        r, g = group_of(cfg, k, world)
        parts[r].setdefault(g, {})[k] = v
    return parts


def run_group(engine, cfg: RegenConfig, shards: dict[int, list[Job]], sources: list[dict], target_id: str):
    """Every turn of every job of a group of shards, round by round, all the group's pending jobs
    in one engine call per round; then each shard's file, atomically. Yields (rows, stats) per shard."""
    jobs = [j for k in sorted(shards) for j in shards[k]]
    first = min(shards)
    rnd = 0
    while any(j.pending() for j in jobs):
        active = [j for j in jobs if j.pending()]
        replies = engine.generate([(j.prompt(), j.source.get("tools")) for j in active],
                                  seed=cfg.seed * 100_003 + first * 101 + rnd if cfg.engine == "local" else
                                  cfg.seed + 1_000_000 * rnd + active[0].g)
        for j, r in zip(active, replies):
            j.accept(r)
        rnd += 1
    for k in sorted(shards):
        yield len(shards[k]), write_shard(cfg, k, shards[k], sources, target_id)


def write_shard(cfg: RegenConfig, k: int, jobs: list[Job], sources: list[dict], target_id: str) -> dict:
    """Shard k's rows (its jobs answered) and its counts, each written atomically."""
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
        row = {k2: v for k2, v in j.source.items() if k2 not in (*CHAT_FIELDS, "meta")}
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


def _worker(cfg: RegenConfig, device: str, groups: dict[int, dict[int, list[Job]]], sources, target_id,
            progress_q):
    engine = LocalEngine(cfg, device) if cfg.engine == "local" else OpenAIEngine(cfg)
    for _, shards in sorted(groups.items()):
        for rows, stats in run_group(engine, cfg, shards, sources, target_id):
            progress_q.put((rows, stats.get("tokens", 0)))


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

    def on_message(msg):
        nonlocal tokens
        n, t = msg
        tokens += t
        bar.update(n)
        bar.set_postfix(tok_s=f"{tokens / max(time.time() - t0, 1e-9):,.0f}")

    parts = deal(cfg, todo, world)
    try:
        if todo:
            run_workers(_worker, [(cfg, d, parts[r], sources, target_id) for r, d in enumerate(devices)], on_message)
        else:  # nothing left: no target to load
            log(f"{out}: every shard already written, nothing to do")
    except WorkerFailed as e:
        raise RegenError(f"{e}; finished shards are kept: rerun the same command") from None
    finally:
        bar.close()
    return summarize_out(out, skipped, examples, time.time() - t0, tokens)


def summarize_out(out: Path, skipped: Counter, examples: dict, seconds: float, tokens: int) -> dict:
    rows, reasons, total_tokens = 0, Counter(), 0
    skipped, examples = Counter(skipped), dict(examples)
    for f in sorted(out.glob("part-*.jsonl")):
        for row in read_shard(f):
            meta = row["meta"]
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
