"""Regenerate DATA's assistant turns with the target: the DFlash data recipe (a drafter trains on
text its target writes).

    python -m regenerate --data corpus.jsonl --target path/to/target --out data/regen --gpus 0,1
    python -m regenerate --data corpus.jsonl --engine openai --base-url http://127.0.0.1:8000/v1 \\
        --model served-name --out data/regen

The output folder is a DATA folder for `make extract`. Rerun the same command to resume.
"""

from __future__ import annotations

import json
import sys

from regenerate.config import RegenConfig, RegenError
from regenerate.run import run
from shared.cli import exit_interrupted, from_args, parser_for
from shared.data import DataError
from shared.progress import log
from shared.target import TargetError


def main(argv=None) -> int:
    try:
        try:
            cfg = from_args(RegenConfig, parser_for(RegenConfig, "python -m regenerate", __doc__).parse_args(argv))
        except SystemExit as e:  # argparse has printed why
            return int(e.code or 0)
        s = run(cfg)
        print(f"rows {s['rows']:,}  new tokens {s['new_tokens']:,}  finish reasons {json.dumps(s['finish_reasons'])}")
        print("skipped rows: " + (", ".join(f"{k} {v}" for k, v in s["skipped"].items()) or "none"))
        print(f"this run: {s['this_run_seconds']:,.1f} s, {s['this_run_tokens_per_s']:,.1f} generated tokens/s -> {cfg.out}")
        return 0
    except (ValueError, DataError, TargetError, RegenError) as e:
        log(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        exit_interrupted("interrupted: the rows written so far are kept; rerun the same command to resume")


if __name__ == "__main__":
    sys.exit(main())
