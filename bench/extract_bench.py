"""Extraction throughput against the bare target forward over the same batches, in one run.

    python bench/extract_bench.py --shape 27b --seq-len 8192 --seqs 24     # H200 (device tool)
    python bench/extract_bench.py --shape tiny --seq-len 1024 --seqs 64    # CPU

Rows:
  bare forward      model.model(ids, attention_mask) only, synchronised per batch
  forward+features  the same plus hook capture, LM head top-k/lse, pad removal (no copies out)
  pipeline          the real extraction worker: features, D2H, compression, zarr writes, markers
ratio = pipeline tok/s / bare forward tok/s (goal >= 0.9 on the GPU).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from shapes import random_target, synthetic_manifest, target_27b_config  # noqa: E402  (adds the repo to sys.path)

from extract.plan import write_plan
from shared.data import Encoded
from shared.features import forward_features, pad_batch
from extract.worker import Worker, plan_batches
from shared import store as st
from extract.config import ExtractConfig
from shared.target import default_layer_ids


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batches(lengths, cfg):
    items = [(i, 0, n) for i, n in enumerate(lengths)]
    return list(plan_batches(items, cfg.batch_tokens, cfg.max_batch))


def timed(fn, device):
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=("27b", "tiny"), default="tiny")
    ap.add_argument("--layers", type=int, default=64, help="target layers (27b shape)")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--codec", default="zstd1")
    ap.add_argument("--writers", type=int, default=3)
    ap.add_argument("--shard-tokens", type=int, default=16384)
    ap.add_argument("--dir", default=None, help="where the store is written (default: a temp dir)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if a.shape == "27b":
        tcfg = target_27b_config(a.layers)
    else:
        from shared.tiny import tiny_config
        tcfg = tiny_config(2048)
    t0 = time.time()
    model = random_target(tcfg, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"target {a.shape}: {n_params / 1e9:.2f}B params, built in {time.time() - t0:.0f}s on {device}", flush=True)
    L = tcfg.num_hidden_layers
    layer_ids = default_layer_ids(L, 5)
    g = torch.Generator().manual_seed(0)
    lengths = [a.seq_len] * a.seqs
    enc = [Encoded(torch.randint(0, tcfg.vocab_size, (n,), generator=g).numpy().astype(np.int32),
                   np.ones(n, dtype=np.uint8), 0, i) for i, n in enumerate(lengths)]
    tmp = Path(a.dir or tempfile.mkdtemp(prefix="xbench-"))
    store = tmp / "store"
    shutil.rmtree(store, ignore_errors=True)
    cfg = ExtractConfig(data="synthetic", target="in-memory", store=str(store), layer_ids=layer_ids,
                        max_len=a.seq_len, precision=a.precision, codec=a.codec, topk=16,
                        batch_tokens=a.batch_tokens, shard_tokens=max(a.shard_tokens, a.seq_len),
                        writers=a.writers, progress=False)
    manifest = synthetic_manifest(cfg, tcfg.hidden_size, L, tcfg.vocab_size, layer_ids, len(enc))
    write_plan(cfg, manifest, enc, len(layer_ids), tcfg.hidden_size)
    bs = batches(lengths, cfg)
    tensors = []
    for b in bs:
        ids, att = pad_batch([torch.from_numpy(enc[i].input_ids.astype(np.int64)) for i, _, _ in b], 0)
        tensors.append((ids.to(device), att.to(device), [n for _, _, n in b]))
    tokens = sum(lengths)

    # warm-up (kernel autotuning) outside every timing
    with torch.no_grad():
        ids, att, ns = tensors[0]
        model.model(input_ids=ids, attention_mask=att, use_cache=False)
        forward_features(model, ids, att, ns, layer_ids, 16)
    sync(device)

    def bare():
        with torch.no_grad():
            for ids, att, _ in tensors:
                model.model(input_ids=ids, attention_mask=att, use_cache=False)
                sync(device)

    def feats():
        with torch.no_grad():
            for ids, att, ns in tensors:
                forward_features(model, ids, att, ns, layer_ids, 16)
                sync(device)

    t_bare = timed(bare, device)
    t_feat = timed(feats, device)
    w = Worker(cfg, 0, 1, device, model=model)
    units = list(range(st.Store(store, require_complete=False).layout.n_units))
    t_start = time.time()
    t_pipe = timed(lambda: w.run(units), device)
    t_gpu = w.gpu_done_at - t_start  # every batch computed and on the host; the rest is the drain
    t_bare2 = timed(bare, device)  # again: drift between the first and last measurement
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else float("nan")
    disk = st.disk_bytes(store)
    raw = tokens * len(layer_ids) * tcfg.hidden_size * 2
    rows = [("bare forward", t_bare), ("bare forward (again)", t_bare2), ("forward+features", t_feat),
            ("pipeline, GPU side", t_gpu), ("pipeline, store written", t_pipe)]
    base = min(t_bare, t_bare2)
    print(f"\n{tokens:,} tokens in {len(bs)} batches of <= {a.batch_tokens} tokens, seq {a.seq_len}, "
          f"layers {layer_ids}, {a.precision}/{a.codec}, {a.writers} writer threads, units of {cfg.shard_tokens} "
          f"tokens ({len(units)} units; the last unit's write cannot overlap any forward)")
    print(f"{'':28s}{'seconds':>9s}{'tok/s':>11s}{'vs bare':>9s}")
    for name, t in rows:
        print(f"{name:28s}{t:9.2f}{tokens / t:11,.0f}{base / t:9.3f}")
    print(f"raw bf16 features {raw / 2**30:.2f} GiB -> {disk / 2**30:.2f} GiB on disk "
          f"({raw / disk:.3f}x), {disk / tokens:,.0f} B/token, raw feature rate at bare speed "
          f"{raw / base / 1e6:,.0f} MB/s; peak GPU memory {peak:.1f} GiB")
    res = {"shape": a.shape, "params_b": n_params / 1e9, "tokens": tokens, "seq_len": a.seq_len,
           "bare_tok_s": tokens / base, "features_tok_s": tokens / t_feat, "pipeline_tok_s": tokens / t_pipe, "pipeline_gpu_side_tok_s": tokens / t_gpu,
           "ratio": base / t_pipe, "disk_bytes": disk, "raw_bytes": raw, "peak_gib": peak,
           "precision": a.precision, "codec": a.codec}
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    if a.dir is None:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
