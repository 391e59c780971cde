"""The training loop: step, log, evaluate and checkpoint until the schedule ends. What a run
holds is built in train/run.py; metrics and checkpoints are components of their own."""

from __future__ import annotations

import gc
import sys
import traceback

import torch.distributed as dist

from shared.progress import log
from shared.store import Store, StoreError
from train.checkpoint import TrainingError
from train.config import TrainConfig
from train.export import export
from train.heldout import evaluate_held_out
from train.metrics import Metrics
from train.model import compiled_graphs
from train.run import Run, build_run
from train.setup import init_distributed
from train.step import train_step


def train(cfg: TrainConfig) -> dict:
    cfg.validate()
    rank, world, device, own_group = init_distributed(cfg)
    run = None
    try:
        run = build_run(cfg, rank, world, device)
        loop(run)
        return {"step": run.step, "history": run.history, "best": run.best, "out": cfg.out,
                "compiled_graphs": run.graphs, "recompiles": run.recompiles}
    finally:
        if own_group and dist.is_initialized():
            # DDP's reducer holds the process group. Left to be freed after the group is destroyed,
            # the reducer frees gloo's group holding the GIL, and gloo's destructor waits for its
            # worker thread, which may need the GIL to free the last barrier's work: a deadlock
            # (seen as a 2-rank run that never exited). Freed first, the group is released by
            # destroy_process_group, which lets go of the GIL. A failed run's traceback holds the
            # frames that hold the run: their locals are cleared (the traceback still prints).
            run = None
            if (e := sys.exc_info()[1]) is not None:
                traceback.clear_frames(e.__traceback__)
            gc.collect()
            dist.destroy_process_group()


def loop(run: Run):
    cfg, dev = run.cfg, run.device
    metrics = Metrics(run.out, run.rank, dev, run.total, run.step, run.history, cfg.resume, cfg.progress)
    first_step = True
    while run.step < run.total:
        epoch, in_epoch = run.schedule.locate(run.step)
        rows, it = run.loader(epoch, in_epoch)
        for _ in range(in_epoch, run.schedule.steps(epoch)):
            mbs = [{k: v.to(dev, non_blocking=True) for k, v in next_batch(it).items()} for _ in range(cfg.grad_accum)]
            if run.online is not None:
                mbs = [run.online(mb) for mb in mbs]  # baseline: features from the target, not the store
            graphs = compiled_graphs()
            r = train_step(run.model, run.opt, run.sched, run.embed, run.head, mbs, run.step_cfg, run.autocast,
                           run.master)
            if first_step:  # the first step compiles; any graph after it is a recompilation
                first_step, run.graphs = False, compiled_graphs() - graphs
            else:
                run.recompiles += compiled_graphs() - graphs
            run.step += 1
            if r["finite"]:
                metrics.add(r)
            else:
                non_finite(run, metrics, dict(rows), mbs, epoch, r)
            last = run.step == run.total
            if (run.step % cfg.log_every == 0 or last) and metrics.window is not None:
                rec = metrics.record(run.step, epoch, run.sched.get_last_lr()[0], float(r["grad_norm"]))
                if run.eval_loader is not None and cfg.eval_every and (run.step % cfg.eval_every == 0 or last):
                    rec.update(evaluate_held_out(run.model, run.embed, run.head, run.eval_loader, run.step_cfg, dev, run.autocast))
                    if run.best is None or rec["eval_tau"] > run.best["eval_tau"]:
                        run.best = {"step": run.step, "eval_tau": rec["eval_tau"]}
                        if run.rank == 0:
                            export(run.drafter, run.out / "best", target_tensors=run.target_tensors)
                metrics.write(rec)
            if run.step % cfg.save_every == 0 or last:
                run.save()
            if last or (cfg.stop_after and run.step >= cfg.stop_after):  # stop_after: a crash, no checkpoint
                break
        if cfg.stop_after and run.step >= cfg.stop_after:
            break
    metrics.close()
    if run.graphs:
        log(f"compiled graphs: {run.graphs} in the first step, {run.recompiles} recompiled after it")
    if run.rank == 0:
        export(run.drafter, run.out / "export", target_tensors=run.target_tensors)
    dist.barrier()


def next_batch(it):
    """The next batch; a loader worker's StoreError comes back as the worker's traceback text:
    keep only our message, which names the store, unit and sample."""
    try:
        return next(it)
    except StoreError as e:
        lines = [l for l in str(e).strip().splitlines() if l.strip()]
        raise TrainingError(lines[-1].removeprefix("shared.store.StoreError: ")) from None


def non_finite(run: Run, metrics: Metrics, row_samples: dict, mbs: list[dict], epoch: int, r: dict):
    """A step whose gradient was not finite (no weights were updated): stop, naming the step and
    the rows' samples, or with --skip-nonfinite count it and go on."""
    batch_rows = [int(x) for mb in mbs for x in mb["row"].tolist()]
    gathered = [None] * run.world
    dist.all_gather_object(gathered, batch_rows)
    where = _name_samples(run.store, row_samples, batch_rows)
    if not run.cfg.skip_nonfinite:
        raise TrainingError(
            f"step {run.step}: non-finite loss or gradient (grad norm {float(r['grad_norm'])}); no weights were "
            f"updated. Rows {sorted(x for g in gathered for x in g)} of epoch {epoch}; rank {run.rank}'s samples: "
            f"{where}. Check them with `python -m extract.inspect {run.cfg.store} --verify`; --skip-nonfinite "
            f"skips such steps instead (counted in metrics).")
    if run.rank == 0:
        log(f"step {run.step}: non-finite gradient, step skipped ({where})")
    metrics.skipped += 1
    metrics.bar.update(1)


def _name_samples(store: Store, rows: dict[int, list[int]], batch_rows: list[int]) -> str:
    samples = [i for r in batch_rows for i in rows.get(r, [])]
    names = [store.describe_sample(i, with_store=False) for i in samples[:8]]
    return "; ".join(names) + (f"; and {len(samples) - 8} more" if len(samples) > 8 else "")
