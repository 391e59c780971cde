"""Extract: run the target once over DATA and write its features to a Zarr store.

    python -m extract --data corpus.jsonl --target path/to/qwen3.5 --store stores/x --gpus 0,1

Rerunning the same command resumes: finished units are kept, the rest are recomputed.
"""

from __future__ import annotations

import sys
import time

from extract.config import ExtractConfig
from extract.run import ExtractError, print_summary, run
from shared import store as st
from shared.cli import exit_interrupted, from_args, parser_for
from shared.data import DataError
from shared.location import object_store_error
from shared.progress import log
from shared.target import TargetError


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
        log(f"error: {e}")
        return 2
    except Exception as e:
        if (msg := object_store_error(e)) is None:
            raise
        log(f"error: STORE {cfg.store}: {msg}")
        return 2
    except KeyboardInterrupt:
        exit_interrupted("interrupted: the units finished so far are kept; rerun the same command to resume")


if __name__ == "__main__":
    sys.exit(main())
