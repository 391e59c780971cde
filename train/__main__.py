"""Train a DFlash drafter from a feature store.

    python -m train --store stores/x --out runs/x --gpus 0,1,2,3 [--draft drafter_config.json]

With several GPUs the command relaunches itself under torchrun (one process per GPU, NCCL);
without GPUs it runs one CPU process (gloo). `--resume` continues the run in --out exactly.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields

from shared.config import parse_gpus
from shared.store import StoreError
from shared.target import TargetError
from train.config import ConfigError, TrainConfig


def parse_args(argv=None) -> TrainConfig:
    d = TrainConfig(store="", out="")
    ap = argparse.ArgumentParser(prog="python -m train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True, help="run folder: checkpoints, metrics.jsonl, export/")
    ap.add_argument("--gpus", default="", help="e.g. 0,1,2,3; empty: CPU")
    ap.add_argument("--draft", default=None, help="drafter config.json (public DFlash format); default: "
                                                  "derived from the store's target")
    ap.add_argument("--target", default=None, help="where embed_tokens/lm_head are read (default: the "
                                                   "manifest's target path)")
    simple = {f.name: f for f in fields(TrainConfig)
              if f.name not in ("store", "out", "gpus", "draft", "target", "resume", "progress", "online")}
    for name, f in simple.items():
        default = getattr(d, name)
        typ = {"int": int, "float": float, "str": str}.get(str(f.type).split(" ")[0], None)
        if typ is None:
            typ = int if "int" in str(f.type) else str
        ap.add_argument("--" + name.replace("_", "-"), type=typ, default=default)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--online", action="store_true", help="baseline: target forward in every step (needs the "
                                                          "whole target; features from the store are ignored)")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    kw = {name: getattr(a, name) for name in simple}
    return TrainConfig(store=a.store, out=a.out, gpus=parse_gpus(a.gpus), draft=a.draft, target=a.target,
                       resume=a.resume, progress=not a.no_progress, online=a.online, **kw)


def _replace_gpus(argv: list[str], value: str) -> list[str]:
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--gpus":
            skip = True
            continue
        if a.startswith("--gpus="):
            continue
        out.append(a)
    return out + ["--gpus", value]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse_args(argv).validate()
        if len(cfg.gpus) > 1 and "WORLD_SIZE" not in os.environ:
            # One process per GPU under torchrun. CUDA_VISIBLE_DEVICES renumbers the chosen GPUs
            # 0..n-1, so each process uses GPU LOCAL_RANK and the children get --gpus 0..n-1.
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, cfg.gpus))}
            child = _replace_gpus(argv, ",".join(str(i) for i in range(len(cfg.gpus))))
            args = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={len(cfg.gpus)}", "-m", "train", *child]
            os.execvpe(sys.executable, args, env)
        from train.loop import train
        result = train(cfg)
        h = result["history"]
        if h:
            last = h[-1]
            print(f"step {result['step']}  loss {last['loss']:.4f}  tau {last['tau']:.3f}  "
                  f"acc {last['acc'][:4]}  -> {result['out']}/export")
        return 0
    except (ValueError, ConfigError, StoreError, TargetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
