"""Drafter training step: compile modes, flex-vs-dense correctness, loader throughput, offline vs
online (target forward in the step), each measured in one run.

    python bench/train_bench.py --sections check,step,loader,online     # H200 (device tool)
    python bench/train_bench.py --small --sections check,step,loader    # CPU smoke run

Sections:
  check   flex_attention (compiled) against SDPA with the dense mask from the same mask
          definition: loss and every gradient, forward and backward, on the device.
  step    step time, peak memory and compiled-graph counts for --compile blocks (the GPU
          default) / attention / full / none at one shape, each against full; recompilations in
          the timed steps (after warm-up) must be 0.
  loader  the real loader (store -> packed rows, parallel decode, pinned prefetch): sustained
          rows/s and feature GB/s, against what one training step consumes.
  online  the same drafter step with the target forward in the loop (online training) against
          the offline step fed from memory, same GPU, same drafter.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from shapes import drafter_27b_config, random_target, target_27b_config  # noqa: E402

from train.config import DrafterConfig
from train.mask import sample_anchors
from train.model import DFlashDrafter, attention_backend, compile_drafter, compiled_graphs, param_count
from train.step import StepConfig, forward_loss, train_step

RESULTS: dict = {}


def synth_batch(S, A, n_layers, H, V, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    lm = torch.ones(S, dtype=torch.bool)
    lm[: S // 16] = False  # a prompt
    doc = torch.zeros(S, dtype=torch.long)
    anchors, valid = sample_anchors(lm, doc, A, g)
    b = {"hidden": torch.randn(1, S, n_layers * H, generator=g).to(torch.bfloat16),
         "input_ids": torch.randint(0, V, (1, S), generator=g), "loss_mask": lm[None], "doc": doc[None],
         "argmax": torch.randint(0, V, (1, S), generator=g), "anchors": anchors[None], "anchor_valid": valid[None]}
    return {k: v.to(device) for k, v in b.items()}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def section(name):
    print(f"\n== {name} ==", flush=True)


# --- check ----------------------------------------------------------------------------------

def check(device):
    section("check: flex (compiled) vs SDPA dense mask, forward + backward, fp32")
    cfg = DrafterConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                        intermediate_size=512, num_hidden_layers=2, vocab_size=1000, num_target_layers=8,
                        target_layer_ids=[1, 4, 6], mask_token_id=999, block_size=16,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    b = synth_batch(512, 32, 3, 256, 1000, device, seed=1)
    b["hidden"] = b["hidden"].float()
    embed = torch.randn(1000, 256, device=device) * 0.5
    head = torch.randn(1000, 256, device=device) * 0.5
    out = {}
    for backend in ("sdpa", "flex_compiled"):
        torch.manual_seed(0)
        m = DFlashDrafter(cfg, backend=backend).to(device)
        loss, stats, tg = forward_loss(m, embed, head, b, StepConfig.of(m))
        (loss / tg["weight"].sum()).backward()
        out[backend] = (loss.detach(), {k: p.grad.detach().clone() for k, p in m.named_parameters()})
    (l0, g0), (l1, g1) = out["sdpa"], out["flex_compiled"]
    worst = max(float((g0[k] - g1[k]).norm() / g0[k].norm().clamp(min=1e-30)) for k in g0)
    rel = float((l0 - l1).abs() / l0.abs())
    ok = rel < 1e-4 and worst < 1e-3
    print(f"loss rel err {rel:.2e}; worst gradient rel err {worst:.2e} over {len(g0)} tensors -> "
          f"{'OK' if ok else 'MISMATCH'}")
    RESULTS["check"] = {"loss_rel_err": rel, "grad_rel_err": worst, "ok": ok}


# --- step -----------------------------------------------------------------------------------

def make_model(dcfg, mode, device):
    """The drafter as train/run.py builds it for `--compile mode`."""
    torch.manual_seed(0)
    m = DFlashDrafter(dcfg, backend=attention_backend("auto", mode, device.type == "cuda")).to(device)
    run = compile_drafter(m, mode)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    return m, run, opt


def time_steps(run, opt, embed, head, batch, steps, autocast, device, warmup=2):
    for _ in range(warmup):
        train_step(run, opt, None, embed, head, [batch], StepConfig.of(run), autocast)
    sync(device)
    graphs = compiled_graphs()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    for _ in range(steps):
        r = train_step(run, opt, None, embed, head, [batch], StepConfig.of(run), autocast)
    sync(device)
    dt = (time.perf_counter() - t) / steps
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else float("nan")
    return dt, peak, float(r["loss_sum"] / r["weight"]), graphs, compiled_graphs() - graphs


def step(device, dcfg, S, A, modes, steps):
    section(f"step: seq {S}, {A} anchors, block {dcfg.block_size}, {dcfg.num_hidden_layers} layers, "
            f"hidden {dcfg.hidden_size}, vocab {dcfg.vocab_size}")
    V, H = dcfg.vocab_size, dcfg.hidden_size
    embed = (torch.randn(V, H, device=device) * 0.02).to(torch.bfloat16)
    head = (torch.randn(V, H, device=device) * 0.02).to(torch.bfloat16)
    batch = synth_batch(S, A, len(dcfg.target_layer_ids), H, V, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    rows = {}
    for mode in modes:
        torch._dynamo.reset()
        free()
        m = run = opt = None
        try:
            m, run, opt = make_model(dcfg, mode, device)
            t0 = time.perf_counter()
            dt, peak, loss, graphs, recompiles = time_steps(run, opt, embed, head, batch, steps, autocast, device)
            rows[mode] = {"ms": dt * 1e3, "peak_gib": peak, "loss": loss, "graphs": graphs, "recompiles": recompiles}
            print(f"compile {mode:9s}: {dt * 1e3:8.1f} ms/step  peak {peak:6.1f} GiB  {graphs} graphs, "
                  f"{recompiles} recompiled in the timed steps ({param_count(m) / 1e9:.2f}B params, "
                  f"{time.perf_counter() - t0:.0f}s incl. compile)", flush=True)
        except torch.OutOfMemoryError as e:
            rows[mode] = {"ms": None, "peak_gib": None, "error": "out of memory"}
            print(f"compile {mode:9s}: OUT OF MEMORY ({str(e).splitlines()[0][:120]})", flush=True)
        finally:
            del m, run, opt
            free()
    ref = rows.get("full", {}).get("ms")
    if ref:
        for mode, r in rows.items():
            if r.get("ms"):
                print(f"  {mode:9s} vs full compile: time {r['ms'] / ref:.3f}x, peak memory "
                      f"{r['peak_gib'] / rows['full']['peak_gib']:.3f}x")
    base = rows.get(modes[0], {}).get("ms")
    tokens_s = S / (base / 1e3) if base else None
    RESULTS["step"] = {"shape": {"seq": S, "anchors": A, "block": dcfg.block_size}, "modes": rows,
                       "context_tok_s": tokens_s}
    return base


# --- loader ---------------------------------------------------------------------------------

def loader(device, dcfg, S, A, n_samples, workers, step_ms, tmpdir, precision="bf16", codec="zstd1", s3=None,
           chunk_tokens=64):
    """s3: a running shared.s3local.S3Server: the same store written to and read from it."""
    where = "local disk" if s3 is None else f"S3 ({s3.endpoint})"
    section(f"loader: {n_samples} samples x 4 passes of {S} tokens, {len(dcfg.target_layer_ids)} layers x "
            f"{dcfg.hidden_size}, {workers} workers, {precision}/{codec}, chunks of {chunk_tokens} tokens, store on {where}")
    from extract.plan import write_plan
    from extract.run import finalize
    from shapes import synthetic_manifest
    from shared.data import Encoded
    from shared import schema as sc
    from shared import store as st
    from extract.config import ExtractConfig
    from shared.location import as_location
    from train.loader import EpochPlan, RowDataset, RowSpec, make_loader
    store = str(Path(tmpdir) / "loader-store") if s3 is None else s3.url("bench/loader-store")
    as_location(store).delete_all()
    L, H = len(dcfg.target_layer_ids), dcfg.hidden_size
    cfg = ExtractConfig(data="synthetic", target="none", store=str(store), layer_ids=dcfg.target_layer_ids,
                        max_len=S, shard_tokens=S, batch_tokens=S, progress=False, precision=precision, codec=codec,
                        chunk_tokens=chunk_tokens)
    g = torch.Generator().manual_seed(0)
    enc = [Encoded(np.random.default_rng(i).integers(0, 1000, S).astype(np.int32), np.ones(S, np.uint8), 0, i)
           for i in range(n_samples)]
    man = synthetic_manifest(cfg, H, dcfg.num_target_layers, dcfg.vocab_size, dcfg.target_layer_ids, n_samples)
    write_plan(cfg, man, enc, L, H)
    w = st.StoreWriter(store)
    lay = w.layout
    t = time.perf_counter()
    for u in range(lay.n_units):
        # hidden-state-like values: random normals (compress worse than real features, see notes)
        h = (torch.randn(S, L, H, generator=g) * 2).bfloat16()
        z = torch.zeros(S, 16)
        arrays = {k: v.numpy().view(np.uint16) if v.dtype == torch.int16 else v.numpy()
                  for k, v in sc.encode_features(precision, h, z.long(), z, z[:, 0]).items()}
        st.write_unit(w, u, arrays, {"samples": 1, "tokens": S, "dropped": [], "rank": 0})
    write_s = time.perf_counter() - t
    finalize(cfg, write_s)
    raw = n_samples * S * L * H * 2
    print(f"wrote {raw / 1e9:.1f} GB raw in {write_s:.1f}s ({raw / write_s / 1e9:.2f} GB/s: one writer thread, "
          f"zarr's codec threads)")
    s = st.Store(store)
    raw_get = None
    if s3 is not None:  # the server's own rate: every hidden-state shard fetched whole, 16 at a time
        from concurrent.futures import ThreadPoolExecutor
        loc = as_location(store)
        keys = loc.list("features/hidden/")
        t = time.perf_counter()
        with ThreadPoolExecutor(16) as ex:
            got = sum(len(b) for b in ex.map(loc.read, keys))
        raw_get = got / (time.perf_counter() - t) / 1e9
        print(f"raw GETs of {len(keys)} hidden-state shards ({got / 1e9:.2f} GB compressed), 16 at a time: "
              f"{raw_get:.2f} GB/s", flush=True)
    rows = EpochPlan(s, S, 0, 0, 1).rows(0) * 4  # 4 passes: worker start-up amortised (page cache warm)
    out = {}
    for w in sorted({0, workers // 4, workers // 2, workers}):
        ds = RowDataset(str(store), rows, RowSpec(tuple(dcfg.target_layer_ids), S, A, 0), 0)
        dl = make_loader(ds, 1, w, 4, device.type == "cuda")
        t = time.perf_counter()
        n = 0
        for b in dl:
            b["hidden"].to(device, non_blocking=True)
            n += 1
        sync(device)
        dt = time.perf_counter() - t
        rate = n / dt
        out[w] = {"rows_s": rate, "gb_s": rate * S * L * H * 2 / 1e9}
        print(f"workers {w:3d}: {rate:6.2f} rows/s  {out[w]['gb_s']:6.2f} GB/s of bf16 features", flush=True)
    need = 1e3 / step_ms if step_ms else None
    if need:
        best = max(v["rows_s"] for v in out.values())
        print(f"one GPU's step consumes {need:.2f} rows/s ({need * S * L * H * 2 / 1e9:.2f} GB/s): "
              f"loader headroom {best / need:.2f}x")
    RESULTS[f"loader_{precision}_{codec}_{'local' if s3 is None else 's3'}"] = {
        "by_workers": out, "step_rows_s": need, "write_gb_s": raw / write_s / 1e9, "raw_get_gb_s": raw_get}
    as_location(store).delete_all()


# --- online vs offline ----------------------------------------------------------------------

def online(device, dcfg, S, A, steps, target_layers):
    section("online vs offline: the same drafter step, with and without the target forward")
    from shared.features import capture_layers
    free()
    tcfg = target_27b_config(target_layers) if dcfg.hidden_size == 5120 else None
    if tcfg is None:
        from shared.tiny import tiny_config
        tcfg = tiny_config(dcfg.vocab_size, hidden_size=dcfg.hidden_size)
    target = random_target(tcfg, device, torch.bfloat16)
    layer_ids = [l for l in dcfg.target_layer_ids if l < tcfg.num_hidden_layers]
    dcfg = DrafterConfig(**{**dcfg.__dict__, "target_layer_ids": layer_ids})
    embed = target.model.embed_tokens.weight
    head = target.lm_head.weight
    batch = synth_batch(S, A, len(layer_ids), dcfg.hidden_size, dcfg.vocab_size, device)
    host_hidden = batch["hidden"].cpu().pin_memory() if device.type == "cuda" else batch["hidden"].cpu()
    torch._dynamo.reset()
    m, run, opt = make_model(dcfg, "blocks", device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def target_features():
        with torch.no_grad(), capture_layers(target, layer_ids) as got:
            target.model(input_ids=batch["input_ids"], use_cache=False)
        return torch.cat([got[i] for i in layer_ids], dim=-1)

    def offline_step():
        b = dict(batch, hidden=host_hidden.to(device, non_blocking=True))
        train_step(run, opt, None, embed, head, [b], StepConfig.of(run), autocast)

    def online_step():
        b = dict(batch, hidden=target_features())
        train_step(run, opt, None, embed, head, [b], StepConfig.of(run), autocast)

    times = {}
    for name, fn in (("offline", offline_step), ("online", online_step), ("target forward only", target_features),
                     ("offline (again)", offline_step)):
        for _ in range(2):
            fn()
        sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        sync(device)
        times[name] = (time.perf_counter() - t) / steps * 1e3
        print(f"{name:22s} {times[name]:8.1f} ms/sequence", flush=True)
    off = min(times["offline"], times["offline (again)"])
    print(f"offline training is {times['online'] / off:.2f}x faster per GPU than online "
          f"(target forward in the step), before counting epochs and ablations it saves")
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else float("nan")
    RESULTS["online"] = {**times, "speedup": times["online"] / off, "peak_gib": peak,
                         "target_layers": tcfg.num_hidden_layers}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="check,step,loader,online")
    ap.add_argument("--small", action="store_true", help="CPU-sized shapes")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--modes", default="blocks,attention,full")
    ap.add_argument("--loader-samples", type=int, default=12)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--target-layers", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=None, help="step time the loader must keep up with "
                                                                "(default: measured by the step section)")
    ap.add_argument("--loader-stores", default="bf16/zstd1", help="precision/codec list, e.g. bf16/zstd1,fp8/zstd1")
    ap.add_argument("--loader-where", default="local", help="local,s3: also put the store on a local S3 server "
                    "(SeaweedFS, shared/s3local.py) and read it from there")
    ap.add_argument("--loader-chunk-tokens", type=int, default=64, help="the store's --chunk-tokens")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.small:
        dcfg = DrafterConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             intermediate_size=384, num_hidden_layers=2, vocab_size=2048, num_target_layers=8,
                             target_layer_ids=[1, 3, 5], mask_token_id=3, block_size=16)
        S, A = min(a.seq_len, 1024), min(a.anchors, 64)
    else:
        dcfg, S, A = drafter_27b_config(), a.seq_len, a.anchors
    secs = a.sections.split(",")
    step_ms = a.step_ms
    tmp = tempfile.mkdtemp(prefix="tbench-")
    for name in secs:
        try:
            if name == "check":
                check(device)
            elif name == "step":
                modes = a.modes.split(",") if device.type == "cuda" else ["none"]
                step_ms = step(device, dcfg, S, A, modes, a.steps)
            elif name == "loader":
                wheres = a.loader_where.split(",")
                server = None
                if "s3" in wheres:
                    from shared.s3local import S3Server
                    server = S3Server(Path(tmp) / "s3").start()
                    os.environ.update(server.env)
                try:
                    for spec in a.loader_stores.split(","):
                        prec, codec = spec.split("/")
                        for where in wheres:
                            loader(device, dcfg, S, A, a.loader_samples, a.workers, step_ms, tmp, prec, codec,
                                   server if where == "s3" else None, a.loader_chunk_tokens)
                        if len(wheres) > 1:
                            loc, obj = (RESULTS[f"loader_{prec}_{codec}_{w}"] for w in ("local", "s3"))
                            print(f"\n{'workers':>8s}{'local rows/s':>14s}{'S3 rows/s':>11s}{'S3 / local':>12s}")
                            for w in loc["by_workers"]:
                                l, o = loc["by_workers"][w]["rows_s"], obj["by_workers"][w]["rows_s"]
                                print(f"{w:8d}{l:14.2f}{o:11.2f}{o / l:12.3f}")
                            print(f"writes: local {loc['write_gb_s']:.2f} GB/s, S3 {obj['write_gb_s']:.2f} GB/s "
                                  f"(S3 / local {obj['write_gb_s'] / loc['write_gb_s']:.3f})", flush=True)
                finally:
                    if server is not None:
                        server.stop()
            elif name == "online":
                online(device, dcfg, S, A, a.steps, a.target_layers)
        except Exception as e:  # a section that could not run says so; the others still run
            import traceback
            traceback.print_exc()
            print(f"SECTION {name} FAILED: {type(e).__name__}: {e}", flush=True)
            RESULTS[name] = {"error": f"{type(e).__name__}: {e}"}
        free()
    shutil.rmtree(tmp, ignore_errors=True)
    print("\nRESULTS " + json.dumps(RESULTS, default=str))
    if a.json:
        Path(a.json).write_text(json.dumps(RESULTS, indent=2, default=str))


if __name__ == "__main__":
    main()
