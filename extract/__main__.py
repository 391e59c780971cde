"""Extract: run the target once over DATA and write its features to a Zarr store.

    python -m extract --data corpus.jsonl --target path/to/qwen3.5 --store stores/x --gpus 0,1

Rerunning the same command resumes: finished units are kept, the rest are recomputed.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import queue
import shutil
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from extract.data import DataError, describe, encode_all, resolve
from shared import store as st
from shared.cli import from_args, parser_for
from shared.config import ExtractConfig
from shared.target import (LAYER_CONVENTION, TargetError, check_safetensors, default_layer_ids,
                           load_embed_and_head, load_tokenizer, read_config, tensors_fingerprint,
                           tokenizer_fingerprint, weights_fingerprint)


class ExtractError(RuntimeError):
    pass


def _log(msg: str):
    print(msg, file=sys.stderr, flush=True)


# --- planning -------------------------------------------------------------------------------

def assign_units(lengths: list[int], shard_tokens: int) -> tuple[np.ndarray, int]:
    """Token offsets that pack samples, in order, into units of shard_tokens without a sample
    straddling two units. Returns (offsets, number of units)."""
    offsets = np.zeros(len(lengths), dtype=np.int64)
    unit, used = 0, 0
    for i, n in enumerate(lengths):
        if used + n > shard_tokens:
            unit, used = unit + 1, 0
        offsets[i] = unit * shard_tokens + used
        used += n
    return offsets, unit + 1


def plan(cfg: ExtractConfig, manifest: dict, tokenizer, n_layers: int, hidden: int) -> Path:
    """Tokenize DATA and create the store with its tokens and index."""
    files, encoded, report = encode_all(cfg.data, tokenizer, cfg.max_len, cfg.too_long, cfg.progress,
                                        cfg.chat_template_kwargs)
    manifest["data"]["report"] = {"rows": report.rows, "kept": report.kept, "truncated": report.truncated,
                                  "skipped": dict(report.skipped), "examples": report.examples}
    store = write_plan(cfg, manifest, encoded, n_layers, hidden)
    for reason, n in sorted(report.skipped.items()):
        _log(f"skipped {n} row(s): {reason}; first: {report.examples[reason]}")
    return store


def write_plan(cfg: ExtractConfig, manifest: dict, encoded: list, n_layers: int, hidden: int) -> Path:
    """Create the store with its tokens and index in a side folder renamed into place at the end:
    a crash while planning leaves nothing that looks like a store."""
    store = Path(cfg.store)
    partial = store.with_name(store.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    lengths = [len(e.input_ids) for e in encoded]
    offsets, n_units = assign_units(lengths, cfg.shard_tokens)
    layout = st.Layout(n_layers=n_layers, hidden=hidden, topk=cfg.topk, precision=cfg.precision,
                       codec=cfg.codec, shard_tokens=cfg.shard_tokens, chunk_tokens=cfg.chunk_tokens,
                       n_units=n_units, n_samples=len(encoded))
    root = st.create(partial, layout, manifest)
    ids = np.zeros(cfg.shard_tokens, dtype=np.int32)
    mask = np.zeros(cfg.shard_tokens, dtype=np.uint8)
    i = 0
    for u in range(n_units):  # one whole shard per write
        ids[:], mask[:] = 0, 0
        while i < len(encoded) and offsets[i] // cfg.shard_tokens == u:
            lo = offsets[i] - u * cfg.shard_tokens
            ids[lo:lo + lengths[i]] = encoded[i].input_ids
            mask[lo:lo + lengths[i]] = encoded[i].loss_mask
            i += 1
        sl = slice(u * cfg.shard_tokens, (u + 1) * cfg.shard_tokens)
        root["tokens/input_ids"][sl] = ids
        root["tokens/loss_mask"][sl] = mask
    root["index/offset"][:] = offsets
    root["index/length"][:] = np.asarray(lengths, dtype=np.int32)
    root["index/row"][:] = np.asarray([e.row for e in encoded], dtype=np.int64)
    root["index/file"][:] = np.asarray([e.file for e in encoded], dtype=np.int32)
    root["index/ok"][:] = np.ones(len(encoded), dtype=np.uint8)
    os.replace(partial, store)
    return store


# --- launching ------------------------------------------------------------------------------

def _devices(cfg: ExtractConfig) -> list[str]:
    return [f"cuda:{g}" for g in cfg.gpus] if cfg.gpus else ["cpu"] * cfg.cpu_workers


def launch(cfg: ExtractConfig, todo: list[int], layout: st.Layout):
    from shared.progress import progress_bar
    from extract.worker import worker_main

    devices = _devices(cfg)
    world = len(devices)
    per_rank = [[u for u in todo if u % world == r] for r in range(world)]
    threads = max(1, (os.cpu_count() or 1) // world)
    n_samples = layout.n_samples
    done_samples = sum(m["samples"] for m in st.done_units(cfg.store).values())
    bar = progress_bar(total=n_samples, initial=done_samples, unit=" samples", disable=not cfg.progress,
                       desc=f"extract ({world} worker{'s' * (world > 1)})")
    t0, tokens = time.time(), 0
    ctx = mp.get_context("spawn")
    q = ctx.Queue() if world > 1 else queue.Queue()

    def monitor(stop):
        nonlocal tokens
        while not stop.is_set():
            try:
                kind, _u, n, t = q.get(timeout=0.2)
            except queue.Empty:
                continue
            if kind == "batch":
                tokens += t
                bar.update(n)
                bar.set_postfix(tok_s=f"{tokens / max(time.time() - t0, 1e-9):,.0f}")

    stop = threading.Event()
    mon = threading.Thread(target=monitor, args=(stop,), daemon=True)
    mon.start()
    try:
        if world == 1:
            worker_main(cfg, 0, 1, devices[0], per_rank[0], q, threads)
        else:
            procs = [ctx.Process(target=worker_main, args=(cfg, r, world, d, per_rank[r], q, threads))
                     for r, d in enumerate(devices)]
            for p in procs:
                p.start()
            while any(p.is_alive() for p in procs):
                failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:
                    for p in procs:
                        p.terminate()
                    if any(code == errno.ENOSPC for _, code in failed):
                        raise OSError(errno.ENOSPC, "no space left on device")
                    raise ExtractError(f"worker(s) {failed} (rank, exit code) failed; finished units are "
                                       f"kept: rerun the same command to resume")
                time.sleep(0.2)
            failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
            if failed:
                raise ExtractError(f"worker(s) {failed} (rank, exit code) failed; rerun the same command to resume")
    finally:
        time.sleep(0.3)
        stop.set()
        mon.join()
        bar.close()
    return time.time() - t0, tokens


# --- finalize -------------------------------------------------------------------------------

def finalize(cfg: ExtractConfig, seconds: float) -> dict:
    root = st.zarr.open_group(store=cfg.store, mode="r+")
    man = root.attrs["dflash"]
    layout = st.Layout(**man["layout"])
    done = st.done_units(cfg.store)
    missing = [u for u in range(layout.n_units) if u not in done]
    if missing:
        raise ExtractError(f"{cfg.store}: units {missing[:10]} not written; rerun to resume")
    dropped = [d for m in done.values() for d in m["dropped"]]
    if dropped:
        ok = root["index/ok"][:]
        for d in dropped:
            ok[d["sample"]] = 0
        root["index/ok"][:] = ok
        files = man["data"]["files"]
        for d in dropped[:20]:
            _log(f"dropped sample {d['sample']}: NaN/inf features ({files[d['file']]['path']} row {d['row']})")
    tokens = sum(m["tokens"] for m in done.values())
    lengths = root["index/length"]
    kept_tokens = tokens - sum(int(lengths[d["sample"]]) for d in dropped)
    disk = sum(f.stat().st_size for f in Path(cfg.store).rglob("*") if f.is_file())
    raw = tokens * layout.n_layers * layout.hidden * 2  # the same features as uncompressed bf16
    summary = {
        "samples": layout.n_samples - len(dropped), "tokens": int(kept_tokens),
        "rows_read": man["data"]["report"]["rows"], "truncated": man["data"]["report"]["truncated"],
        "skipped": {**man["data"]["report"]["skipped"], **({"nan_features": len(dropped)} if dropped else {})},
        "bytes_on_disk": disk, "bytes_per_token": round(disk / max(tokens, 1), 1),
        "compression_vs_raw_bf16": round(raw / max(disk, 1), 3),
        "last_run_seconds": round(seconds, 1),
    }
    man = {**man, "complete": True, "summary": summary,
           "completed_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    root.attrs["dflash"] = man
    return summary


# --- entry ----------------------------------------------------------------------------------

def _manifest(cfg: ExtractConfig, tcfg: dict, tokenizer, layer_ids: list[int], sources: list[dict]) -> dict:
    return {
        "kind": "dflash-target-features",
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "target": {"path": str(Path(cfg.target).resolve()), "model_type": tcfg["model_type"],
                   "num_hidden_layers": tcfg["num_hidden_layers"], "hidden_size": tcfg["hidden_size"],
                   "vocab_size": tcfg["vocab_size"], "layer_types": tcfg.get("layer_types"),
                   "weights_fingerprint": weights_fingerprint(cfg.target),
                   "tensors_fingerprint": tensors_fingerprint(*load_embed_and_head(cfg.target)), "config": tcfg},
        "tokenizer": {"fingerprint": tokenizer_fingerprint(tokenizer), "size": len(tokenizer),
                      "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
                      "mask_token_id": tokenizer.mask_token_id},
        "layer_ids": layer_ids, "layer_convention": LAYER_CONVENTION,
        "dtypes": {"hidden": "bfloat16 as uint16 bits" if cfg.precision == "bf16"
                   else "float8_e4m3fn as uint8 bits, times features/scale (float32 per token and layer)",
                   "topk_logp": "float16 log-probabilities", "lse": "float32", "topk_idx": "int32"},
        "precision": cfg.precision, "codec": cfg.codec, "topk": cfg.topk, "max_len": cfg.max_len,
        "too_long": cfg.too_long,
        # training and evaluation must render chats with the same options as serving
        "chat_template_kwargs": dict(cfg.chat_template_kwargs),
        "data": {"spec": cfg.data, "files": sources},
        "run_key": {**cfg.run_key(), "layer_ids": layer_ids},
    }


def _check_resume(cfg: ExtractConfig, man: dict, new: dict):
    old_key = man.get("run_key", {})
    diffs = [f"{k}: store has {old_key.get(k)!r}, asked {v!r}" for k, v in new["run_key"].items() if old_key.get(k) != v]
    if man["target"]["weights_fingerprint"] != new["target"]["weights_fingerprint"]:
        diffs.append("target weights differ")
    if man["tokenizer"]["fingerprint"] != new["tokenizer"]["fingerprint"]:
        diffs.append("tokenizer or chat template differs")
    old_files, new_files = man["data"]["files"], new["data"]["files"]
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


def run(cfg: ExtractConfig) -> dict:
    cfg.validate()
    store = Path(cfg.store)
    if store.exists() and not store.is_dir():
        raise ExtractError(f"STORE {store} is an existing file, not a folder: give a new or an existing store path")
    tcfg = read_config(cfg.target)
    check_safetensors(cfg.target)
    tokenizer = load_tokenizer(cfg.target)
    L = tcfg["num_hidden_layers"]
    layer_ids = sorted(cfg.layer_ids) if cfg.layer_ids else default_layer_ids(L, cfg.draft_layers)
    bad = [i for i in layer_ids if not 0 <= i < L]
    if bad:
        raise ExtractError(f"--layers {bad} out of range: the target has {L} decoder layers (ids 0..{L - 1})")
    sources = describe(resolve(cfg.data))
    manifest = _manifest(cfg, tcfg, tokenizer, layer_ids, sources)

    store.parent.mkdir(parents=True, exist_ok=True)
    with st.exclusive_lock(store):
        return _run_locked(cfg, store, manifest, tokenizer, layer_ids, tcfg["hidden_size"])


def _run_locked(cfg: ExtractConfig, store: Path, manifest: dict, tokenizer, layer_ids, hidden: int) -> dict:
    if store.exists() and cfg.overwrite:
        shutil.rmtree(store)
    if (store / "zarr.json").exists():
        man = st.zarr.open_group(store=str(store), mode="r").attrs.get("dflash")
        if man is None:
            raise ExtractError(f"STORE {store} exists and is not a feature store")
        _check_resume(cfg, man, manifest)
        if man.get("complete"):
            _log(f"{store}: already complete, nothing to do")
            return man["summary"]
        _log(f"{store}: resuming")
    elif store.exists() and any(store.iterdir()):
        raise ExtractError(f"STORE {store} exists and is not a feature store; refusing to write into it")
    else:
        plan(cfg, manifest, tokenizer, len(layer_ids), hidden)

    for tmp in (store / "_progress").glob("*.tmp*"):
        tmp.unlink()  # marker files a crash left half-written
    layout = st.Layout(**st.zarr.open_group(store=str(store), mode="r").attrs["dflash"]["layout"])
    done = st.done_units(store)
    todo = [u for u in range(layout.n_units) if u not in done]
    if todo:
        check_free_space(cfg, store, layout, todo)
    try:
        seconds, _ = launch(cfg, todo, layout) if todo else (0.0, 0)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise disk_full(store, layout) from None
    return finalize(cfg, seconds)


# --- disk space -------------------------------------------------------------------------------

# Compression of features seen so far (BENCHMARKS.md: 1.27-1.39x for bf16, 1.22x for fp8 bytes):
# the estimate takes the low end, so a store "clearly" too big for the disk is refused.
_RATIO = {"none": 1.0, "lz4": 1.1, "blosc-lz41": 1.1}


def bytes_per_token(layout: st.Layout) -> tuple[float, float]:
    """(raw, estimated on disk) bytes per token for a store's arrays."""
    feat = layout.n_layers * layout.hidden * (2 if layout.precision == "bf16" else 1)
    feat += 4 * layout.n_layers if layout.precision == "fp8" else 0
    other = layout.topk * (4 + 2) + 4 + 4 + 1  # top-k ids and log-probs, lse, input id, loss mask
    return feat + other, feat / _RATIO.get(layout.codec, 1.2) + other / 2


def check_free_space(cfg: ExtractConfig, store: Path, layout: st.Layout, todo: list[int]):
    root = st.zarr.open_group(store=str(store), mode="r")
    lengths, units = root["index/length"][:], root["index/offset"][:] // layout.shard_tokens
    tokens = int(lengths[np.isin(units, todo)].sum())
    raw, est = bytes_per_token(layout)
    need, free = tokens * est, shutil.disk_usage(store).free
    _log(f"estimated size of the features still to write: {need / 2**30:,.2f} GiB ({tokens:,.0f} tokens x "
         f"{est:,.0f} B/token: {layout.n_layers} layers x {layout.hidden} x {layout.precision}, codec "
         f"{layout.codec}; raw {raw:,.0f} B/token); free on {store}: {free / 2**30:,.2f} GiB")
    if need > free and not cfg.ignore_free_space:
        raise ExtractError(f"STORE {store}: about {need / 2**30:,.2f} GiB of features still to write, only "
                           f"{free / 2**30:,.2f} GiB free. Free space or use another STORE; --ignore-free-space "
                           f"starts anyway (the plan is kept: rerunning resumes)")


def disk_full(store: Path, layout: st.Layout) -> ExtractError:
    done = len(st.done_units(store))
    on_disk = sum(f.stat().st_size for f in store.rglob("*") if f.is_file())
    return ExtractError(f"STORE {store}: the disk is full (errno 28, no space left on device) after {done} of "
                        f"{layout.n_units} units ({on_disk / 2**30:,.2f} GiB written). Finished units are kept; "
                        f"free space and rerun the same command to resume")


def print_summary(summary: dict, seconds: float):
    tok = summary["tokens"]
    print(f"samples {summary['samples']:,}  tokens {tok:,}  rows read {summary['rows_read']:,}  "
          f"truncated {summary['truncated']:,}")
    print("skipped rows: " + (", ".join(f"{k} {v}" for k, v in summary["skipped"].items()) or "none"))
    print(f"on disk {summary['bytes_on_disk'] / 2**20:,.1f} MiB  {summary['bytes_per_token']:,.1f} B/token  "
          f"compression vs raw bf16 {summary['compression_vs_raw_bf16']:.2f}x")
    if seconds > 0:
        print(f"this run: {seconds:,.1f} s")


def parse_args(argv=None) -> ExtractConfig:
    return from_args(ExtractConfig, parser_for(ExtractConfig, "python -m extract", __doc__).parse_args(argv))


def main(argv=None) -> int:
    try:
        try:
            cfg = parse_args(argv)
        except SystemExit as e:  # argparse has printed why
            return int(e.code or 0)
        t0 = time.time()
        summary = run(cfg)
        print_summary(summary, time.time() - t0)
        return 0
    except (ValueError, DataError, TargetError, ExtractError, st.StoreError) as e:
        _log(f"error: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
