"""Checkpoints: atomic, never with non-finite weights, `latest` pointing at the newest whole one."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from shared.location import atomic_write_text


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss or weights, unreadable data): exit non-zero."""


def assert_finite(state: dict[str, torch.Tensor], what: str):
    bad = [k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise TrainingError(f"refusing to write {what}: non-finite values in {bad[:5]}"
                            f"{' and more' if len(bad) > 5 else ''}")


class Checkpointer:
    """Writes `OUT/checkpoints/step-N.pt` through a temporary name, then moves `latest` to it;
    keeps the newest `keep`. A crash at any moment leaves the previous checkpoint intact."""

    def __init__(self, out: Path, keep: int = 2):
        self.dir = Path(out) / "checkpoints"
        self.keep = keep

    def save(self, state: dict):
        assert_finite(state["model"], f"checkpoint at step {state['step']}")
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"step-{state['step']:08d}.pt"
        tmp = self.dir / (name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.dir / name)
        atomic_write_text(self.dir / "latest", name)
        for old in sorted(self.dir.glob("step-*.pt"))[:-self.keep]:
            old.unlink()

    def has_latest(self) -> bool:
        return (self.dir / "latest").exists()

    def load_latest(self) -> dict | None:
        p = self.dir / "latest"
        if not p.exists():
            return None
        return torch.load(self.dir / p.read_text().strip(), map_location="cpu", weights_only=False)
