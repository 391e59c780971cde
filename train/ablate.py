"""Train a small grid of drafter configs from ONE store (no re-extraction) and compare them.

    python -m train.ablate --store stores/default --out runs/ablate \\
        --grid draft_layers=1,2,3 [--grid gamma=4,7] [any python -m train option]

Each combination is an ordinary training run in OUT/<name>/ (its own metrics.jsonl, export/,
resumable). At the end OUT/ablation.md holds the table (final loss, offline tau on held-out
samples, steps) and OUT/ablation.png the curves of loss and offline tau against steps.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import fields, replace
from pathlib import Path

from train.__main__ import parse_args
from train.config import TrainConfig


def grid(specs: list[str]) -> list[dict]:
    keys, values = [], []
    names = {f.name: f for f in fields(TrainConfig)}
    for spec in specs:
        k, _, v = spec.partition("=")
        k = k.replace("-", "_")
        if k not in names:
            raise SystemExit(f"--grid {spec}: unknown setting {k!r}")
        default = getattr(TrainConfig(store="", out=""), k)
        cast = type(default) if default is not None else int
        keys.append(k)
        values.append([cast(x) for x in v.split(",")])
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def plot(runs: dict[str, list[dict]], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, hist in runs.items():
        ax1.plot([h["step"] for h in hist], [h["loss"] for h in hist], label=name)
        ev = [h for h in hist if "eval_tau" in h]
        ax2.plot([h["step"] for h in ev], [h["eval_tau"] for h in ev], marker="o", label=name)
    ax1.set(xlabel="step", ylabel="training loss", title="loss")
    ax2.set(xlabel="step", ylabel="expected acceptance length", title="offline tau (held-out)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--grid", action="append", default=[])
    a, rest = ap.parse_known_args(argv)
    if not a.grid:
        a.grid = ["draft_layers=1,2,3"]
    base = parse_args(rest)
    out = Path(base.out)
    from train.loop import train
    runs, rows = {}, []
    for combo in grid(a.grid):
        name = "-".join(f"{k}{v}" for k, v in combo.items())
        cfg = replace(base, out=str(out / name), resume=True, **combo)
        print(f"== {name} ==", file=sys.stderr, flush=True)
        res = train(cfg)
        hist = res["history"]
        runs[name] = hist
        last = hist[-1] if hist else {}
        ev = [h for h in hist if "eval_tau" in h]
        rows.append((name, last.get("step"), last.get("loss"), last.get("tau"), ev[-1]["eval_tau"] if ev else None,
                     ev[-1]["eval_loss"] if ev else None))
    lines = ["| run | steps | train loss | train tau | held-out tau | held-out loss |", "|---|---|---|---|---|---|"]
    fmt = lambda x: "-" if x is None else (f"{x:.4f}" if isinstance(x, float) else str(x))  # noqa: E731
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    table = "\n".join(lines)
    (out / "ablation.md").write_text(f"# Ablation from {base.store}\n\n{table}\n")
    (out / "ablation.json").write_text(json.dumps(runs))
    plotted = plot(runs, out / "ablation.png")
    print(table)
    print(f"-> {out / 'ablation.md'}" + (f", {out / 'ablation.png'}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
