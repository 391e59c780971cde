"""What a run reports: per-window loss, slot accuracy and tau reduced over ranks, written to
metrics.jsonl, TensorBoard (if installed) and the tqdm bar on rank 0."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shared.progress import progress_bar
from train.loss import metrics_from_stats

_SUMMED = ("loss_sum", "weight", "stats", "tokens")


class Metrics:
    def __init__(self, out: Path, rank: int, device: torch.device, total: int, step: int,
                 history: list[dict], resumed: bool, progress: bool):
        self.rank, self.device, self.history = rank, device, history
        self.window: dict | None = None
        self.skipped = 0  # steps skipped for a non-finite gradient (--skip-nonfinite), this window
        self.t_last = time.time()
        self.file = self.tb = None
        if rank == 0:
            if resumed:  # drop what a killed run logged after its last checkpoint
                (out / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
            self.file = open(out / "metrics.jsonl", "a")
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(out / "tb"))
            except Exception:
                self.tb = None
        self.bar = progress_bar(total=total, initial=step, desc="train", unit=" steps",
                                disable=rank != 0 or not progress)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def add(self, r: dict):
        """One step's device tensors (no host sync here)."""
        self.window = r if self.window is None else {k: self.window[k] + r[k] for k in _SUMMED}
        self.bar.update(1)

    def record(self, step: int, epoch: int, lr: float, grad_norm: float) -> dict:
        """Reduce the window over ranks into one record (the weight is already global)."""
        w = self.window
        reduce = torch.cat([w["stats"].flatten().double(), w["loss_sum"].reshape(1),
                            w["tokens"].double().reshape(1)])
        dist.all_reduce(reduce)
        reduce = reduce.cpu()
        m = metrics_from_stats(reduce[:-2].reshape(w["stats"].shape).float())
        now = time.time()
        cuda = self.device.type == "cuda"
        rec = {"step": step, "epoch": epoch, "loss": float(reduce[-2]) / max(float(w["weight"]), 1e-9),
               "lr": lr, "grad_norm": grad_norm, **m,
               "tok_s": float(reduce[-1]) / max(now - self.t_last, 1e-9),
               "peak_mem_gib": (torch.cuda.max_memory_allocated(self.device) if cuda else
                                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2 ** 30}
        if self.skipped:
            rec["skipped_nonfinite"] = self.skipped
        self.t_last, self.window, self.skipped = now, None, 0
        return rec

    def write(self, rec: dict):
        self.history.append(rec)
        if self.rank != 0:
            return
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, rec["step"])
        self.bar.set_postfix(loss=f"{rec['loss']:.3f}", acc1=f"{rec['acc'][0]:.2f}", tau=f"{rec['tau']:.2f}",
                             tok_s=f"{rec['tok_s']:,.0f}", mem=f"{rec['peak_mem_gib']:.1f}G")

    def close(self):
        self.bar.close()
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
