"""One extraction run: check the inputs, plan or resume the store, launch one worker per device,
finalize. Rerunning the same command resumes: finished units are kept, the rest recomputed.

Any number of runs may work on one store at once (on one host or many, under torchrun or not):
planning, each unit and finalizing are claimed (extract/claims.py), so each is done once."""

from __future__ import annotations

import errno
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from extract.claims import Claims, once
from extract.config import ExtractConfig
from extract.plan import plan
from shared import schema as sc
from shared import store as st
from shared.data import describe, resolve
from shared.launch import WorkerFailed, run_workers
from shared.location import Location, as_location
from shared.progress import log, progress_bar
from shared.target import (LAYER_CONVENTION, check_safetensors, default_layer_ids, load_embed_and_head,
                           load_tokenizer, read_config, tensors_fingerprint, tokenizer_fingerprint,
                           weights_fingerprint)


class ExtractError(RuntimeError):
    pass


# --- launching ------------------------------------------------------------------------------

def launcher_env() -> tuple[int, int, int] | None:
    """(rank, world, local rank) when started by torchrun (or any launcher setting its variables)."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def _devices(cfg: ExtractConfig) -> list[str]:
    """This run's worker devices: one per listed GPU, or CPU workers. Under torchrun each
    process is one worker: GPU LOCAL_RANK (of --gpus when given), or the CPU without a GPU."""
    env = launcher_env()
    if env is not None:
        _, _, local = env
        if cfg.gpus:
            return [f"cuda:{cfg.gpus[local % len(cfg.gpus)]}"]
        import torch
        return [f"cuda:{local}"] if torch.cuda.is_available() else ["cpu"]
    return [f"cuda:{g}" for g in cfg.gpus] if cfg.gpus else ["cpu"] * cfg.cpu_workers


def launch(cfg: ExtractConfig, layout: sc.Layout, done_samples: int = 0):
    """Run this run's workers until every unit of the store is done (by them or by any other run).
    done_samples: samples already in finished units (where the progress bar starts)."""
    from extract.worker import worker_main

    devices = _devices(cfg)
    world = len(devices)
    env = launcher_env()
    # which share of the units each worker starts claiming from: all processes of all nodes
    ranks = [(env[0], env[1])] if env else [(r, world) for r in range(world)]
    threads = max(1, len(os.sched_getaffinity(0)) // world)  # the cores this process may use, per worker
    n_samples = layout.n_samples
    bar = progress_bar(total=n_samples, initial=done_samples, unit=" samples",
                       disable=not cfg.progress or (env is not None and env[0] != 0),
                       desc=f"extract ({world} worker{'s' * (world > 1)})")
    t0, tokens = time.time(), 0

    def on_message(msg):
        nonlocal tokens
        kind, _u, n, t = msg
        if kind == "batch":
            tokens += t
            bar.update(n)
            bar.set_postfix(tok_s=f"{tokens / max(time.time() - t0, 1e-9):,.0f}")

    spawned = world > 1
    try:
        run_workers(worker_main, [(cfg, r, w, d, threads, spawned) for (r, w), d in zip(ranks, devices)], on_message)
    except WorkerFailed as e:
        if any(code == errno.ENOSPC for _, code in e.failed):
            raise OSError(errno.ENOSPC, "no space left on device") from None
        raise ExtractError(f"{e}; finished units are kept: rerun the same command to resume") from None
    finally:
        bar.close()
    return time.time() - t0, tokens


# --- finalize -------------------------------------------------------------------------------

def finalize(cfg: ExtractConfig, seconds: float) -> dict:
    """Mark dropped samples, write the summary and the complete manifest, remove the claims.
    Safe to repeat: a finalizer that dies is replaced by another, which does the same."""
    w = st.StoreWriter(cfg.store)
    man, layout = w.manifest, w.layout
    swept = w.loc.sweep_temporaries()  # every unit is written: no writer is at work
    if swept:
        log(f"removed {swept} temporary file(s) of writes a killed run left unfinished")
    done = st.done_units(cfg.store)
    missing = [u for u in range(layout.n_units) if u not in done]
    if missing:
        raise ExtractError(f"{cfg.store}: units {missing[:10]} not written; rerun to resume")
    dropped = [d for m in done.values() for d in m["dropped"]]
    if dropped:
        w.mark_dropped([d["sample"] for d in dropped])
        for d in dropped[:20]:
            log(f"dropped sample {d['sample']}: NaN/inf features ({man.data.files[d['file']]['path']} row {d['row']})")
    tokens = sum(m["tokens"] for m in done.values())
    lengths = st.Store(cfg.store, require_complete=False).lengths()
    kept_tokens = tokens - sum(int(lengths[d["sample"]]) for d in dropped)
    disk = st.disk_bytes(cfg.store)
    raw = tokens * layout.bf16_hidden_bytes_per_token()
    report = man.data.report
    summary = {
        "samples": layout.n_samples - len(dropped), "tokens": int(kept_tokens),
        "rows_read": report["rows"], "truncated": report["truncated"],
        # chats: turns trained, and what training each as served cost (stores older than these keys lack them)
        **{k: report[k] for k in ("turns", "turns_split", "turns_context", "split_tokens") if k in report},
        "skipped": {**report["skipped"], **({"nan_features": len(dropped)} if dropped else {})},
        "bytes_on_disk": disk, "bytes_per_token": round(disk / max(tokens, 1), 1),
        "compression_vs_raw_bf16": round(raw / max(disk, 1), 3),
        "last_run_seconds": round(seconds, 1),
    }
    w.finish(summary, datetime.now(timezone.utc).isoformat(timespec="seconds"))
    w.loc.delete_prefix(st.CLAIMS + "/")
    return summary


# --- the manifest and the resume check ------------------------------------------------------------

def make_manifest(cfg: ExtractConfig, tcfg: dict, tokenizer, layer_ids: list[int], sources: list[dict]) -> sc.Manifest:
    return sc.Manifest(
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        target=sc.TargetInfo(
            path=str(Path(cfg.target).resolve()), model_type=tcfg["model_type"],
            num_hidden_layers=tcfg["num_hidden_layers"], hidden_size=tcfg["hidden_size"],
            vocab_size=tcfg["vocab_size"], layer_types=tcfg.get("layer_types"),
            weights_fingerprint=weights_fingerprint(cfg.target),
            tensors_fingerprint=tensors_fingerprint(*load_embed_and_head(cfg.target)), config=tcfg),
        tokenizer=sc.TokenizerInfo(
            fingerprint=tokenizer_fingerprint(tokenizer), size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id, mask_token_id=tokenizer.mask_token_id),
        layer_ids=layer_ids, layer_convention=LAYER_CONVENTION,
        dtypes={"hidden": "bfloat16 as uint16 bits" if cfg.precision == "bf16"
                else "float8_e4m3fn as uint8 bits, times features/scale (float32 per token and layer)",
                "topk_logp": "float16 log-probabilities", "lse": "float32", "topk_idx": "int32"},
        precision=cfg.precision, codec=cfg.codec, topk=cfg.topk, max_len=cfg.max_len, too_long=cfg.too_long,
        # training and evaluation must render chats with the same options as serving
        chat_template_kwargs=dict(cfg.chat_template_kwargs),
        data=sc.DataInfo(spec=cfg.data, files=sources),
        run_key={**cfg.run_key(), "layer_ids": layer_ids},
    )


def check_resume(cfg: ExtractConfig, man: sc.Manifest, new: sc.Manifest):
    diffs = [f"{k}: store has {man.run_key.get(k)!r}, asked {v!r}" for k, v in new.run_key.items()
             if man.run_key.get(k) != v]
    if man.target.weights_fingerprint != new.target.weights_fingerprint:
        diffs.append("target weights differ")
    if man.tokenizer.fingerprint != new.tokenizer.fingerprint:
        diffs.append("tokenizer or chat template differs")
    old_files, new_files = man.data.files, new.data.files
    if [f["sha256"] for f in old_files] != [f["sha256"] for f in new_files]:
        changed = [f"{b['path']} (sha256 {a['sha256'][:16]}... in the store, now {b['sha256'][:16]}...)"
                   for a, b in zip(old_files, new_files) if a["sha256"] != b["sha256"]]
        if len(old_files) != len(new_files):
            changed.append(f"{len(old_files)} source(s) in the store, {len(new_files)} now: "
                           f"{[f['path'] for f in old_files]} vs {[f['path'] for f in new_files]}")
        diffs.append("DATA files differ: " + "; ".join(changed))
    if diffs:
        raise ExtractError(f"STORE {cfg.store} was made with other settings, so it cannot be resumed: "
                           + "; ".join(diffs) + ". Use another STORE, or --overwrite to start over.")


# --- the run ---------------------------------------------------------------------------------

def run(cfg: ExtractConfig) -> dict:
    cfg.validate()
    loc = as_location(cfg.store)
    if loc.is_file():
        raise ExtractError(f"STORE {loc} is an existing file, not a folder: give a new or an existing store path")
    tcfg = read_config(cfg.target)
    check_safetensors(cfg.target)
    tokenizer = load_tokenizer(cfg.target)
    L = tcfg["num_hidden_layers"]
    layer_ids = sorted(cfg.layer_ids) if cfg.layer_ids else default_layer_ids(L, cfg.draft_layers)
    bad = [i for i in layer_ids if not 0 <= i < L]
    if bad:
        raise ExtractError(f"--layers {bad} out of range: the target has {L} decoder layers (ids 0..{L - 1})")
    if cfg.topk > tcfg["vocab_size"]:
        raise ExtractError(f"--topk {cfg.topk} exceeds the target's vocabulary ({tcfg['vocab_size']:,} tokens)")
    sources = describe(resolve(cfg.data))
    manifest = make_manifest(cfg, tcfg, tokenizer, layer_ids, sources)
    env = launcher_env()
    if cfg.overwrite:
        if env is not None and env[1] > 1:
            raise ExtractError("--overwrite with several processes would let one delete what others write: "
                               "delete the store first (or run once with one process)")
        if st.store_state(loc)[0] == "foreign":  # a folder of something else: never deleted
            raise ExtractError(f"STORE {loc} exists and is not a feature store: --overwrite deletes only a "
                               f"store; choose another STORE or empty this one yourself")
        loc.delete_all()
    state, _ = st.store_state(loc)
    if state == "foreign":
        raise ExtractError(f"STORE {loc} exists and is not a feature store; refusing to write into it")
    try:
        loc.prepare()
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        raise ExtractError(f"STORE {loc} is not writable ({e.strerror or e}"
                           f"{': ' + str(e.filename) if e.filename else ''}): choose a STORE this user can write") from None
    with Claims(loc, cfg.lease_seconds) as claims:
        return _run_claimed(cfg, loc, claims, manifest, tokenizer, layer_ids, tcfg["hidden_size"], state)


def _run_claimed(cfg: ExtractConfig, loc: Location, claims: Claims, manifest: sc.Manifest, tokenizer, layer_ids,
                 hidden: int, state: str) -> dict:
    def planned():
        s = st.store_state(loc)[0]
        if s == "foreign":
            raise ExtractError(f"STORE {loc} exists and is not a feature store; refusing to write into it")
        return s == "store"

    planner = {"owner": claims.owner, "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    once(claims, "plan", planned, lambda: plan(cfg, manifest, tokenizer, len(layer_ids), hidden, planner),
         "planning the store")
    man = st.read_manifest(loc)
    check_resume(cfg, man, manifest)
    if man.complete:
        log(f"{loc}: already complete, nothing to do")
        return man.summary
    if state == "store":
        log(f"{loc}: resuming")
    layout = man.layout
    done = st.done_unit_ids(loc)
    todo = [u for u in range(layout.n_units) if u not in done]
    seconds = 0.0
    if todo:
        # from the index, not the markers: one read, whatever the number of units
        index = st.Store(loc, require_complete=False).index()
        in_todo = np.isin(index["offset"] // layout.shard_tokens, todo)
        check_free_space(cfg, loc, layout, int(index["length"][in_todo].sum()))
        try:
            seconds, _ = launch(cfg, layout, done_samples=int((~in_todo).sum()))
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise disk_full(loc, layout) from None

    def complete():
        m = st.read_manifest(loc)
        return m is not None and m.complete

    once(claims, "finalize", complete, lambda: finalize(cfg, seconds), "finalizing the store")
    return st.read_manifest(loc).summary


# --- disk space -------------------------------------------------------------------------------

def check_free_space(cfg: ExtractConfig, store: Location, layout: sc.Layout, tokens: int):
    """tokens: the tokens of the units still to write."""
    raw, est = layout.bytes_per_token(), layout.estimated_disk_bytes_per_token()
    need, free = tokens * est, store.free_bytes()
    log(f"estimated size of the features still to write: {need / 2**30:,.2f} GiB ({tokens:,.0f} tokens x "
         f"{est:,.0f} B/token: {layout.n_layers} layers x {layout.hidden} x {layout.precision}, codec "
         f"{layout.codec}; raw {raw:,.0f} B/token); " +
        (f"free on {store}: {free / 2**30:,.2f} GiB" if free is not None else "object storage: no free space to check"))
    if free is not None and need > free and not cfg.ignore_free_space:
        raise ExtractError(f"STORE {store}: about {need / 2**30:,.2f} GiB of features still to write, only "
                           f"{free / 2**30:,.2f} GiB free. Free space or use another STORE; --ignore-free-space "
                           f"starts anyway (the plan is kept: rerunning resumes)")


def disk_full(store: Location, layout: sc.Layout) -> ExtractError:
    done = len(st.done_units(store))
    on_disk = st.disk_bytes(store)
    return ExtractError(f"STORE {store}: the disk is full (errno 28, no space left on device) after {done} of "
                        f"{layout.n_units} units ({on_disk / 2**30:,.2f} GiB written). Finished units are kept; "
                        f"free space and rerun the same command to resume")


def print_summary(summary: dict, seconds: float):
    tok = summary["tokens"]
    print(f"samples {summary['samples']:,}  tokens {tok:,}  rows read {summary['rows_read']:,}  "
          f"truncated {summary['truncated']:,}")
    print("skipped rows: " + (", ".join(f"{k} {v}" for k, v in summary["skipped"].items()) or "none"))
    if summary.get("turns"):
        print(f"assistant turns trained {summary['turns']:,}: {summary['turns_split']:,} in samples of their own "
              f"serving context ({summary['split_tokens']:,} tokens), {summary['turns_context']:,} kept as context "
              f"only (docs/DESIGN.md, 'Chat turns')")
    print(f"on disk {summary['bytes_on_disk'] / 2**20:,.1f} MiB  {summary['bytes_per_token']:,.1f} B/token  "
          f"compression vs raw bf16 {summary['compression_vs_raw_bf16']:.2f}x")
    if seconds > 0:
        print(f"this run: {seconds:,.1f} s")


