"""What a long job tells its user: tqdm progress bars that stay readable in logs (redrawn every
30 s when stderr is not a terminal) and one-line messages on stderr."""

from __future__ import annotations

import sys


def progress_bar(iterable=None, **kw):
    from tqdm import tqdm
    kw.setdefault("mininterval", 0.5 if sys.stderr.isatty() else 30.0)
    kw.setdefault("dynamic_ncols", True)
    return tqdm(iterable, **kw)


def log(msg: str):
    print(msg, file=sys.stderr, flush=True)
