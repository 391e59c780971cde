"""Drafter training step: compile modes, flex-vs-dense correctness, loader throughput, offline vs
online (target forward in the step), each measured in one run.

    python bench/train_bench.py --sections check,step,loader,online     # H200 (device tool)
    python bench/train_bench.py --small --sections check,step,loader    # CPU smoke run

Sections:
  check   flex_attention (compiled) against SDPA with the dense mask from the same mask
          definition: loss and every gradient, forward and backward, on the device.
  step    step time, peak memory and compiled-graph counts per --variants entry (compile mode,
          loss, weights, loss chunk), each against the first; recompilations in the timed steps
          (after warm-up) must be 0. --profile adds, per variant, the time and memory of each
          phase of the step and the kernels by GPU time (torch.profiler).
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
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as python -m train sets it
import torch  # noqa: E402

from shapes import drafter_27b_config, random_target, target_27b_config  # noqa: E402

from train.config import DrafterConfig
from train.loss import chunked_loss, fused_loss, slot_targets
from train.mask import sample_anchors
from train.model import DFlashDrafter, attention_backend, compile_drafter, compiled_graphs, param_count
from train.precision import MasterWeights
from train.step import StepConfig, clip_and_step, draft, forward_loss, train_step

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

@dataclass(frozen=True)
class Variant:
    """One way of running the step: `mode:loss:weights:chunk[:full][:PRESET]`, e.g.
    blocks:fused:bf16:4096 or blocks:fused:bf16:2048:bwd64. loss: fused | checkpointed (the step
    before issue 27); weights: bf16 (float32 masters) | fp32 (autocast over float32 weights, before
    issue 27); `full`: every layer full attention (the peer's layout) instead of the drafter's
    sliding-window layers; PRESET: flex kernel options from FLEX_PRESETS (`--flex-options`);
    `emask`: the BlockMasks built by the eager create_block_mask (before issue 27's fourth session;
    StepConfig.compile_mask False; the GPU default compiles it)."""
    mode: str
    loss: str = "fused"
    weights: str = "bf16"
    chunk: int = 4096
    full_attention: bool = False
    flex: str = ""
    emask: bool = False

    @classmethod
    def parse(cls, text: str) -> "Variant":
        p = text.split(":")
        rest = p[4:]
        flags = ("full", "emask")
        presets = [x for x in rest if x not in flags]
        if len(presets) > 1 or any(x not in FLEX_PRESETS for x in presets):
            raise SystemExit(f"variant {text}: after the chunk only {flags} and one of {sorted(FLEX_PRESETS)}")
        return cls(p[0], *(p[1:3]), *(int(x) for x in p[3:4]), "full" in rest, "".join(presets), "emask" in rest)

    def __str__(self):
        return f"{self.mode}:{self.loss}:{self.weights}:{self.chunk}" + (":full" if self.full_attention else "") + \
            (f":{self.flex}" if self.flex else "") + (":emask" if self.emask else "")


# flex_attention kernel options to try on the step (torch's Hopper default for the backward at
# head dim 128 is blocks 64/128/128/64, 3 stages, 8 warps). ROWS_GUARANTEED_SAFE is not among
# them: on the H100 it made the step's loss NaN (BENCHMARKS.md, issue 27).
FLEX_PRESETS = {
    "bwd64": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
              "bwd_num_stages": 3, "bwd_num_warps": 4},
    "bwd32": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
              "bwd_num_stages": 3, "bwd_num_warps": 4},
    "tma": {"USE_TMA": True},
}


def make_model(dcfg, v: Variant, device):
    """The drafter as train/run.py builds it for this variant."""
    torch.manual_seed(0)
    if v.full_attention:
        dcfg = replace(dcfg, layer_types=["full_attention"] * dcfg.num_hidden_layers)
    m = DFlashDrafter(dcfg, backend=attention_backend("auto", v.mode, device.type == "cuda"),
                      kernel_options=FLEX_PRESETS.get(v.flex)).to(device)
    master = MasterWeights(m) if v.weights == "bf16" else None
    run = compile_drafter(m, v.mode)
    opt = torch.optim.AdamW(master.masters if master else m.parameters(), lr=1e-4, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    return m, run, opt, master


def time_steps(run, opt, master, sc, embed, head, batch, steps, autocast, device, warmup=2):
    for _ in range(warmup):
        train_step(run, opt, None, embed, head, [batch], sc, autocast, master)
    sync(device)
    graphs = compiled_graphs()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    for _ in range(steps):
        r = train_step(run, opt, None, embed, head, [batch], sc, autocast, master)
    sync(device)
    dt = (time.perf_counter() - t) / steps
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else float("nan")
    reserved = torch.cuda.max_memory_reserved(device) / 2 ** 30 if device.type == "cuda" else float("nan")
    return dt, peak, reserved, float(r["loss_sum"] / r["weight"]), graphs, compiled_graphs() - graphs


def phases(run, opt, master, sc, embed, head, batch, autocast, device, n=3):
    """Where a step's time and memory go: the drafter's forward, the LM head + loss, the backward
    and the optimizer, each timed between device syncs over n steps; memory as allocated after
    each (GPU)."""
    cuda = device.type == "cuda"
    gib = lambda: torch.cuda.memory_allocated(device) / 2 ** 30 if cuda else float("nan")
    peak = lambda: torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else float("nan")
    tot = [0.0] * 4
    for _ in range(n):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        mem = {"states": gib()}
        tg = slot_targets(batch, sc.block, sc.gamma, sc.labels)
        sync(device)
        t = [time.perf_counter()]
        with autocast:
            out = draft(run, embed, batch, sc)
            sync(device)
            t.append(time.perf_counter())
            mem["after forward"] = gib()
            loss_sum, _ = (fused_loss if sc.loss == "fused" else chunked_loss)(out, head, tg, sc.loss_chunk)
        sync(device)
        t.append(time.perf_counter())
        mem["after loss"], mem["peak in forward + loss"] = gib(), peak()
        loss_sum.backward()
        if master is not None:
            master.take_grads()
        sync(device)
        t.append(time.perf_counter())
        mem["peak in backward"] = peak()
        clip_and_step(opt, sc.grad_clip, master)
        opt.zero_grad(set_to_none=True)
        sync(device)
        t.append(time.perf_counter())
        for i in range(4):
            tot[i] += (t[i + 1] - t[i]) * 1e3 / n
        del out, loss_sum
    names = ["drafter forward", "LM head + loss (fwd)", "backward", "clip + optimizer"]
    print("  phases: " + ", ".join(f"{k} {x:.1f} ms" for k, x in zip(names, tot)))
    print("  memory (GiB, allocated): " + ", ".join(f"{k} {v:.2f}" for k, v in mem.items()))
    return {"ms": dict(zip(names, tot)), "gib": mem}


def kernel_profile(run, opt, master, sc, embed, head, batch, autocast, device, rows=25):
    """torch.profiler over two steps: the kernels by total CUDA time."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(2):
            train_step(run, opt, None, embed, head, [batch], sc, autocast, master)
        sync(device)
    cuda = device.type == "cuda"
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    events = [e for e in prof.key_averages() if own(e) > 0 and (not cuda or e.device_type.name == "CUDA")]
    total = sum(own(e) for e in events) or 1
    events.sort(key=lambda e: -own(e))
    print(f"  {'kernels' if cuda else 'CPU ops'} over 2 steps: {total / 2e3:.1f} ms per step")
    top = []
    for e in events[:rows]:
        share = own(e) / total
        print(f"    {own(e) / 2e3:8.2f} ms/step {share:6.1%} x{e.count // 2:<5d} {e.key[:110]}")
        top.append({"kernel": e.key[:200], "ms_per_step": own(e) / 2e3, "share": share})
    return top


def step(device, dcfg, S, A, variants, steps, profile: set[str]):
    section(f"step: seq {S}, {A} anchors, block {dcfg.block_size}, {dcfg.num_hidden_layers} layers, "
            f"hidden {dcfg.hidden_size}, vocab {dcfg.vocab_size}")
    V, H = dcfg.vocab_size, dcfg.hidden_size
    embed = (torch.randn(V, H, device=device) * 0.02).to(torch.bfloat16)
    head = (torch.randn(V, H, device=device) * 0.02).to(torch.bfloat16)
    batch = synth_batch(S, A, len(dcfg.target_layer_ids), H, V, device)
    cuda = device.type == "cuda"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    rows = {}
    for v in variants:
        torch._dynamo.reset()
        free()
        m = run = opt = master = None
        name = str(v)
        try:
            m, run, opt, master = make_model(dcfg, v, device)
            sc = replace(StepConfig.of(run), loss=v.loss, loss_chunk=v.chunk,
                         compile_mask=False if v.emask else None)
            t0 = time.perf_counter()
            dt, peak, reserved, loss, graphs, recompiles = time_steps(run, opt, master, sc, embed, head, batch, steps,
                                                                      autocast, device)
            rows[name] = {"ms": dt * 1e3, "peak_gib": peak, "reserved_gib": reserved, "loss": loss, "graphs": graphs,
                          "recompiles": recompiles}
            print(f"{name:36s}: {dt * 1e3:8.1f} ms/step  peak {peak:6.1f} GiB (reserved {reserved:5.1f})  "
                  f"loss {loss:.4f}  {graphs} graphs, {recompiles} recompiled in the timed steps "
                  f"({param_count(m) / 1e9:.2f}B params, {time.perf_counter() - t0:.0f}s incl. compile)", flush=True)
            if name in profile or "all" in profile:
                rows[name]["phases"] = phases(run, opt, master, sc, embed, head, batch, autocast, device)
                rows[name]["kernels"] = kernel_profile(run, opt, master, sc, embed, head, batch, autocast, device)
        except torch.OutOfMemoryError as e:
            rows[name] = {"ms": None, "peak_gib": None, "error": "out of memory"}
            print(f"{name:36s}: OUT OF MEMORY ({str(e).splitlines()[0][:120]})", flush=True)
        finally:
            del m, run, opt, master
            free()
    base = rows.get(str(variants[0]), {})
    if base.get("ms"):
        for name, r in rows.items():
            if r.get("ms"):
                print(f"  {name:36s} vs {variants[0]}: time {r['ms'] / base['ms']:.3f}x, peak memory "
                      f"{r['peak_gib'] / base['peak_gib']:.3f}x")
    best = min((r["ms"] for r in rows.values() if r.get("ms")), default=None)
    RESULTS["step"] = {"shape": {"seq": S, "anchors": A, "block": dcfg.block_size}, "variants": rows,
                       "context_tok_s": S / (best / 1e3) if best else None}
    return best


# --- loader ---------------------------------------------------------------------------------

def loader(device, dcfg, S, A, n_samples, workers, step_ms, tmpdir, precision="bf16", codec="zstd1", s3=None,
           chunk_tokens=64, readers=("shards",)):
    """s3: a running shared.s3local.S3Server: the same store written to and read from it. readers:
    "shards" (the loader's reader) and/or "zarr" (every array through zarr, the baseline; local
    stores only: object-storage workers start from a forkserver, which does not see the switch)."""
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
    out, via_zarr = {}, {}
    for w in sorted({0, workers // 4, workers // 2, workers}):
        for reader in readers:  # the shard reader, then (with --loader-readers shards,zarr) zarr alone
            os.environ["DFLASH_SHARD_READER"] = "1" if reader == "shards" else "0"  # workers inherit it
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
            (out if reader == "shards" else via_zarr)[w] = {"rows_s": rate, "gb_s": rate * S * L * H * 2 / 1e9}
            print(f"workers {w:3d}, {reader:6s}: {rate:6.2f} rows/s  {rate * S * L * H * 2 / 1e9:6.2f} GB/s of bf16 "
                  f"features" + (f"  (shards / zarr {out[w]['rows_s'] / rate:.2f}x)" if reader == "zarr" else ""),
                  flush=True)
    os.environ.pop("DFLASH_SHARD_READER", None)
    need = 1e3 / step_ms if step_ms else None
    if need:
        best = max(v["rows_s"] for v in out.values())
        print(f"one GPU's step consumes {need:.2f} rows/s ({need * S * L * H * 2 / 1e9:.2f} GB/s): "
              f"loader headroom {best / need:.2f}x")
    RESULTS[f"loader_{precision}_{codec}_{'local' if s3 is None else 's3'}"] = {
        "by_workers": out, "by_workers_zarr": via_zarr, "step_rows_s": need, "write_gb_s": raw / write_s / 1e9,
        "raw_get_gb_s": raw_get}
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
    m, run, opt, master = make_model(dcfg, Variant("blocks" if device.type == "cuda" else "none",
                                                   weights="bf16" if device.type == "cuda" else "fp32"), device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def target_features():
        with torch.no_grad(), capture_layers(target, layer_ids) as got:
            target.model(input_ids=batch["input_ids"], use_cache=False)
        return torch.cat([got[i] for i in layer_ids], dim=-1)

    def offline_step():
        b = dict(batch, hidden=host_hidden.to(device, non_blocking=True))
        train_step(run, opt, None, embed, head, [b], StepConfig.of(run), autocast, master)

    def online_step():
        b = dict(batch, hidden=target_features())
        train_step(run, opt, None, embed, head, [b], StepConfig.of(run), autocast, master)

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
    ap.add_argument("--variants", default="blocks:checkpointed:fp32:4096,blocks:fused:fp32:4096,"
                    "blocks:fused:bf16:4096,blocks:fused:bf16:2048,attention:fused:bf16:4096",
                    help="mode:loss:weights:chunk[:full] list (Variant); the first is the baseline of the ratios")
    ap.add_argument("--profile", default="", help="variants (or all) whose phases and kernels are profiled")
    ap.add_argument("--loader-samples", type=int, default=12)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--target-layers", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=None, help="step time the loader must keep up with "
                                                                "(default: measured by the step section)")
    ap.add_argument("--loader-stores", default="bf16/zstd1", help="precision/codec list, e.g. bf16/zstd1,fp8/zstd1")
    ap.add_argument("--loader-where", default="local", help="local,s3: also put the store on a local S3 server "
                    "(SeaweedFS, shared/s3local.py) and read it from there")
    ap.add_argument("--loader-chunk-tokens", type=int, default=64, help="the store's --chunk-tokens")
    ap.add_argument("--loader-readers", default="shards", help="shards,zarr: also read every array through zarr "
                    "(DFLASH_SHARD_READER=0), the baseline of the shard reader, on local stores")
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
                variants = [Variant.parse(x) for x in a.variants.split(",")]
                if device.type != "cuda":  # no compile and no bf16 weights on the CPU
                    variants = [Variant("none", v.loss, "fp32", v.chunk, v.full_attention) for v in variants]
                    variants = list(dict.fromkeys(variants))
                step_ms = step(device, dcfg, S, A, variants, a.steps, set(a.profile.split(",")))
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
                            readers = a.loader_readers.split(",") if where == "local" else ["shards"]
                            loader(device, dcfg, S, A, a.loader_samples, a.workers, step_ms, tmp, prec, codec,
                                   server if where == "s3" else None, a.loader_chunk_tokens, readers)
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
