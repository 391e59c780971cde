"""Train a DFlash drafter from a feature store.

    python -m train --store stores/x --out runs/x --gpus 0,1,2,3 [--draft drafter_config.json]

With several GPUs the command relaunches itself under torchrun (one process per GPU, NCCL);
without GPUs it runs one CPU process (gloo). `--resume` continues the run in --out exactly.
"""

from __future__ import annotations

import os
import sys

from shared.cli import from_args, parser_for
from shared.location import object_store_error
from shared.store import StoreError
from shared.target import TargetError
from train.checkpoint import TrainingError
from train.config import ConfigError, TrainConfig


def parse_args(argv=None) -> TrainConfig:
    ap = parser_for(TrainConfig, "python -m train", __doc__)
    return from_args(TrainConfig, ap.parse_args(argv))


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
        try:
            cfg = parse_args(argv).validate()
        except SystemExit as e:  # argparse has printed why
            return int(e.code or 0)
        # Expandable segments: the step's changing tensor sizes (loss chunks, attention buffers)
        # otherwise fragment the caching allocator in long runs. Set before CUDA starts, inherited
        # by torchrun's ranks; a user's own setting wins.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
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
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ValueError, ConfigError, StoreError, TargetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if (msg := object_store_error(e)) is None:
            raise
        print(f"error: STORE {cfg.store}: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: rerun the same command with --resume to continue from the last checkpoint",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
