"""One launcher for the stages' workers (extraction, regeneration): one worker per device, in this
process when there is one (its errors come back as exceptions), else one spawned process each
(CUDA and threads rule out fork). Workers report progress on a queue, read here; the first
failure stops the others."""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import threading
from collections.abc import Callable


class WorkerFailed(RuntimeError):
    """Worker processes that exited with an error: [(rank, exit code)]."""

    def __init__(self, failed: list[tuple[int, int]]):
        super().__init__(f"worker(s) {failed} (rank, exit code) failed")
        self.failed = failed


def _child(fn: Callable, *args):
    """A spawned worker: Ctrl-C reaches the whole process group, and the parent alone answers it
    (one line, then it terminates its workers): a worker ignores it instead of printing a
    traceback of its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fn(*args)


def run_workers(fn: Callable, args: list[tuple], on_message: Callable[[object], None],
                poll_s: float = 0.2) -> None:
    """Run fn(*args[r], q) for every r and pass what the workers put on q to on_message, on this
    thread, until every worker has exited and the queue is drained. One worker runs on a thread of
    this process and its exception is raised here; several run as spawned processes, and the first
    non-zero exit code terminates the rest and raises WorkerFailed."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue() if len(args) > 1 else queue.Queue()
    errors: list[BaseException] = []
    if len(args) == 1:
        def guarded():
            try:
                fn(*args[0], q)
            except BaseException as e:  # raised below, on the caller's thread
                errors.append(e)
        workers = [threading.Thread(target=guarded, daemon=True)]
    else:
        workers = [ctx.Process(target=_child, args=(fn, *a, q)) for a in args]
    for w in workers:
        w.start()
    try:
        while True:
            try:
                on_message(q.get(timeout=poll_s))
                continue
            except queue.Empty:
                pass
            if errors:
                raise errors[0]
            failed = [(r, w.exitcode) for r, w in enumerate(workers) if getattr(w, "exitcode", None) not in (None, 0)]
            if failed:
                raise WorkerFailed(failed)
            if not any(w.is_alive() for w in workers):
                break
        while True:  # what the last workers put before they exited
            try:
                on_message(q.get_nowait())
            except queue.Empty:
                break
    finally:
        for w in workers:
            if isinstance(w, mp.process.BaseProcess) and w.is_alive():
                w.terminate()
        for w in workers:
            if isinstance(w, mp.process.BaseProcess):
                w.join()
    if errors:
        raise errors[0]
