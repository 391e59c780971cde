"""Our C kernels' build (shared/native.py): once per source into a cache, shared by processes,
and a failed build is the numpy code, said once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


@pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
                    reason="no C compiler on this machine")
def test_the_compiled_code_is_built_once_and_shared(tmp_path):
    """shared/native.py builds shared/window.c into the cache once; a new process loads that file
    (no second build); a cache that cannot be made falls back to the temporary folder;
    DFLASH_NATIVE=0 and a compiler that fails give None and the numpy code."""
    env = {**os.environ, "DFLASH_CACHE": str(tmp_path)}
    probe = "from shared.native import load; print(load('window') is not None)"
    run = lambda extra: subprocess.run([sys.executable, "-c", probe], env={**env, **extra}, capture_output=True,
                                       text=True, check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert run({}).stdout.strip() == "True"
    built = list((tmp_path / "native").glob("window-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert run({}).stdout.strip() == "True" and built[0].stat().st_mtime_ns == stamp
    assert run({"DFLASH_NATIVE": "0"}).stdout.strip() == "False"
    (tmp_path / "a-file").write_text("")  # a cache that cannot be made: the temporary folder instead
    (tmp_path / "tmp").mkdir()
    assert run({"DFLASH_CACHE": str(tmp_path / "a-file"), "TMPDIR": str(tmp_path / "tmp")}).stdout.strip() == "True"
    assert len(list((tmp_path / "tmp").glob("dflash-native-*/window-*.so"))) == 1
    failed = run({"DFLASH_CACHE": str(tmp_path / "other"), "CC": "false"})
    assert failed.stdout.strip() == "False" and "did not build" in failed.stderr and "numpy path" in failed.stderr
    assert not list((tmp_path / "other" / "native").glob("*"))  # no half-built file left behind
