"""Train a grid of drafter configs from ONE store (no re-extraction) and compare them.

    python -m eval.ablate --store stores/default --out runs/ablate \\
        --grid draft_layers=1,2,3 [--grid gamma=4,7] [--target T --data D] [any python -m train option]

Each combination is an ordinary `python -m train` run in OUT/<name>/ (its own metrics.jsonl,
export/, resumable; several GPUs relaunch under torchrun as any training run does). With
--target and --data, every export is also decoded for real (eval.speculative). At the end
OUT/ablation.md holds the table (final loss, offline tau on held-out samples, real tau) and
OUT/ablation.png the curves of loss and offline tau against steps.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

from eval.config import AblateConfig, SpecConfig
from shared.cli import from_args, parser_for


def grid(specs: list[str]) -> list[dict[str, str]]:
    """["draft_layers=1,2", "gamma=4,7"] -> every combination, values as given."""
    keys, values = [], []
    for spec in specs:
        k, sep, v = spec.partition("=")
        if not sep or not k or not v:
            raise SystemExit(f"--grid {spec!r}: expected NAME=V1,V2,... (a python -m train option)")
        keys.append(k.replace("-", "_"))
        values.append(v.split(","))
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def train_args(combo: dict[str, str]) -> list[str]:
    out = []
    for k, v in combo.items():
        flag = "--" + k.replace("_", "-")
        if v.lower() in ("true", "false"):
            out.append(flag if v.lower() == "true" else "--no-" + flag[2:])
        else:
            out += [flag, v]
    return out


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
    try:
        ns, rest = parser_for(AblateConfig, "python -m eval.ablate", __doc__).parse_known_args(argv)
    except SystemExit as e:  # argparse has printed why
        return int(e.code or 0)
    a = from_args(AblateConfig, ns)
    out = Path(a.out)
    runs, rows = {}, []
    for combo in grid(a.grid or ["draft_layers=1,2,3"]):
        name = "-".join(f"{k}{v}" for k, v in combo.items())
        run_dir = out / name
        print(f"== {name} ==", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "train", "--store", a.store, "--out", str(run_dir), "--resume",
               *rest, *train_args(combo)]
        res = subprocess.run(cmd, env=os.environ.copy())
        if res.returncode != 0:
            print(f"error: run {name} failed (exit {res.returncode}): {' '.join(cmd)}", file=sys.stderr)
            return res.returncode
        hist = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
        runs[name] = hist
        last = hist[-1] if hist else {}
        ev = [h for h in hist if "eval_tau" in h]
        real = None
        if a.target and a.data:
            from eval.speculative import evaluate_drafter
            s = evaluate_drafter(SpecConfig(drafter=str(run_dir / "export"), target=a.target, data=a.data,
                                            prompts=a.prompts, max_new=a.max_new, progress=False,
                                            chat_template_kwargs=a.chat_template_kwargs))
            if s["mismatches"]:
                print(f"error: {name}: speculative output differs from greedy: {s['mismatches'][:3]}", file=sys.stderr)
                return 1
            real = s["tau"]
        rows.append((name, last.get("step"), last.get("loss"), last.get("tau"),
                     ev[-1]["eval_tau"] if ev else None, ev[-1]["eval_loss"] if ev else None, real))
    lines = ["| run | steps | train loss | train tau | held-out tau (offline) | held-out loss | real tau |",
             "|---|---|---|---|---|---|---|"]
    fmt = lambda x: "-" if x is None else (f"{x:.4f}" if isinstance(x, float) else str(x))  # noqa: E731
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    table = "\n".join(lines)
    (out / "ablation.md").write_text(f"# Ablation from {a.store}\n\n{table}\n")
    (out / "ablation.json").write_text(json.dumps(runs))
    plotted = plot(runs, out / "ablation.png")
    print(table)
    print(f"-> {out / 'ablation.md'}" + (f", {out / 'ablation.png'}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
