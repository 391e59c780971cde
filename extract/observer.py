"""What a benchmark may watch of an extraction worker. The worker and its writers call these hooks
at the named moments and keep nothing for them; the default watches nothing (bench/extract_bench.py
and bench/host_bench.py pass their own)."""

from __future__ import annotations

import contextlib


class Observer:
    def forward(self, sequences: int, padded: int):
        """A context around one batch's forward and feature encoding, as queued on the device."""
        return contextlib.nullcontext()

    def features_on_host(self):
        """A batch's features have reached its unit buffer."""

    def unit_written(self, queued_s: float, writing_s: float):
        """A unit was written: seconds it waited for a writer, seconds its write took."""
