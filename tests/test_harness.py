"""The test harness's own guard against hangs: what a hung multi-process run leaves behind."""

from __future__ import annotations

import sys
import time

import pytest

from conftest import finish_groups, proc_stat, process_tree, start_group


def test_a_hung_torchrun_reports_every_rank_and_leaves_nothing(tmp_path):
    """torchrun starts its ranks in sessions of their own: finish_groups must still reach them,
    print each one's stack and stop them all (a rank left running would hold the CPU for the rest
    of the suite)."""
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nopen(__file__ + '.' + __import__('os').environ['RANK'], 'w').close()\n"
                      "time.sleep(600)\n")
    p = start_group([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)])
    deadline = time.time() + 120
    while not all((tmp_path / f"sleeper.py.{r}").exists() for r in (0, 1)):  # both ranks started
        assert time.time() < deadline and p.poll() is None, "torchrun did not start its ranks"
        time.sleep(0.2)
    tree = process_tree(p.pid)
    assert len(tree) >= 3  # torchrun and its two ranks
    with pytest.raises(AssertionError, match="still running") as e:
        finish_groups([p], timeout=1)
    assert str(e.value).count(f"{script}") >= 2, str(e.value)  # both ranks' stacks, at the sleep
    deadline = time.time() + 10
    while any(_running(q) for q in tree):
        assert time.time() < deadline, [q for q in tree if _running(q)]
        time.sleep(0.1)


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its new parent to reap it."""
    return (fields := proc_stat(pid)) is not None and fields[0] != "Z"
