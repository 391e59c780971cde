"""The real-target table (issue 25) from the files `bash bench/real_gpu.sh eval` writes under $OUT:
`python bench/real_table.py OUT` (the folder, or its results.tgz). One row per drafter: its store and training, the step it reached
and which export was evaluated, the offline tau, and per prompt set the real tau beside prompt
lookup's on the same prompts (the drafter / lookup ratio is the number the goals are set in).
A curve of held-out offline tau against steps follows, per run.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

def parse_run(name: str) -> dict:
    """A run's name says how it trains: {data|regen}-{draft layers}[-fp8][-argmax|-distill][-init],
    e.g. regen-3-fp8-init. data: the dataset answers' store; regen: the regenerated answers'; both
    hold target layers 1, 8, 14, 15, 20, 27 (those of 1, 3 and 5 draft layers); fp8: the fp8 twin
    of either (1, 14, 27); init: --init-from-target. `bash bench/real_gpu.sh` trains from this, and
    the table reads it back."""
    m = re.fullmatch(r"(data|regen)-([135])(-fp8)?(-argmax|-distill)?(-init)?", name)
    if m is None or (m[3] and m[2] != "3"):
        raise ValueError(f"run name {name!r}: expected {{data|regen}}-{{1|3|5}}[-fp8][-argmax|-distill][-init] "
                         f"(fp8 stores hold the layers of 3 draft layers)")
    labels = (m[4] or "-data")[1:]
    store = f"/tmp/s/{m[1]}" + ("-fp8" if m[3] else "")
    args = f"--draft-layers {m[2]} --labels {labels}" + (" --init-from-target" if m[5] else "")
    return {"answers": "dataset" if m[1] == "data" else "regenerated", "labels": labels,
            "layers": m[2] + (" +init" if m[5] else ""), "precision": "fp8" if m[3] else "bf16",
            "store": store, "args": args}


SETS = ("mt-bench", "humaneval")


def records(out: Path, name: str) -> list[dict]:
    f = out / f"metrics-{name}.jsonl"
    return [json.loads(l) for l in f.read_text().splitlines() if l.strip()] if f.is_file() else []


def evaluations(out: Path) -> dict:
    """(run name, set) -> that set's figures, from every eval JSON (one or several drafters each)."""
    got = {}
    for f in sorted(out.glob("eval-*.json")):
        s = json.loads(f.read_text())
        per = s.get("drafters") or {s["drafter"]: s}
        for path, r in per.items():
            name = Path(path).parent.name  # /tmp/r/NAME/export or .../best
            for set_name, fig in r["sets"].items():
                got[(name, set_name)] = {**fig, "export": Path(path).name}
    return got


def main():
    if sys.argv[1] == "--train-args":  # for real_gpu.sh: "STORE ARGS" of a run name
        try:
            r = parse_run(sys.argv[2])
        except ValueError as e:
            sys.exit(f"real_table.py: {e}")
        print(r["store"], r["args"])
        return
    out = Path(sys.argv[1])
    if out.is_file():  # results.tgz, as real_gpu.sh bundles them for the device tool
        import tarfile
        import tempfile
        tmp = Path(tempfile.mkdtemp())
        with tarfile.open(out) as t:
            t.extractall(tmp, filter="data")
        out = tmp
    ev = evaluations(out)
    print("| drafter | answers | labels | draft layers | store | steps | export | offline tau (train window / held-out) | "
          + " | ".join(f"{s} tau | {s} lookup tau | {s} ratio | {s} speedup (drafter / lookup)" for s in SETS) + " |")
    print("| --- " * (8 + 4 * len(SETS)) + "|")
    names = sorted({f.stem[len("metrics-"):] for f in out.glob("metrics-*.jsonl")} | {k[0] for k in ev})
    for name in names:
        try:
            r = parse_run(name)
            answers, labels, layers, prec = r["answers"], r["labels"], r["layers"], r["precision"]
        except ValueError:  # a drafter from elsewhere: its figures, without the run's description
            answers = labels = layers = prec = "?"
        recs = records(out, name)
        if not recs and not any(k[0] == name for k in ev):
            continue
        last = next((r for r in reversed(recs) if "loss" in r), {})
        held = [r for r in recs if "eval_tau" in r]
        offline = f"{last.get('tau', float('nan')):.3f} / " + (f"{held[-1]['eval_tau']:.3f}" if held else "-")
        cells = []
        for s in SETS:
            r = ev.get((name, s))
            if r is None:
                cells += ["-"] * 4
                continue
            pl = r.get("prompt_lookup", {})
            cut = r.get("prompts_asked", r["prompts"]) > r["prompts"]  # an evaluation cut off mid-set
            cells += [f"{r['tau']:.3f}" + (f" ({r['prompts']} of {r['prompts_asked']} prompts)" if cut else ""),
                      f"{pl.get('tau', float('nan')):.3f}",
                      f"{r['tau'] / max(pl.get('tau', 1e-9), 1e-9):.2f}x",
                      f"{r['speedup']:.2f}x / {pl.get('speedup', float('nan')):.2f}x"]
        export = next((ev[(name, s)]["export"] for s in SETS if (name, s) in ev), "-")
        print(f"| {name} | {answers} | {labels} | {layers} | {prec} | {last.get('step', '-')} | {export} | {offline} | "
              + " | ".join(cells) + " |")
    print()
    for name in names:
        held = [r for r in records(out, name) if "eval_tau" in r]
        if held:
            print(f"{name}: held-out offline tau by step: " + ", ".join(f"{r['step']}: {r['eval_tau']:.3f}" for r in held))


if __name__ == "__main__":
    main()
