"""Our C kernels (shared/<name>.c), built on first use with the system's C compiler and loaded
with ctypes, whose calls run without the interpreter lock. The built library is cached by the
source's hash (DFLASH_CACHE, else $XDG_CACHE_HOME/dflash or ~/.cache/dflash, then native/; the
temporary folder where that cannot be made); a
build goes to a temporary file renamed into place, so processes that build at once (extraction's
writer processes) never load half a file. Where nothing builds (no compiler, a read-only cache),
load() is None once per process and callers keep their numpy path, which gives the same bytes
(tests/test_planes.py); DFLASH_NATIVE=0 chooses that path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from shared.progress import log

FLAGS = ("-O3", "-shared", "-fPIC")  # no -march=native: a cache on a shared home may serve other CPUs
_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    if os.environ.get("DFLASH_CACHE"):
        return Path(os.environ["DFLASH_CACHE"]) / "native"
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "dflash" / "native"


def load(name: str) -> ctypes.CDLL | None:
    """shared/<name>.c as a loaded library, or None (say why once per process)."""
    if os.environ.get("DFLASH_NATIVE", "1") == "0":
        return None
    with _lock:
        if name not in _libs:
            try:
                _libs[name] = _build(name)
            except (OSError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", b"") or b""
                log(f"shared/{name}.c did not build ({type(e).__name__}: {e} {detail.decode(errors='replace')[:300]}); "
                    f"using its numpy path")
                _libs[name] = None
        return _libs[name]


def _build(name: str) -> ctypes.CDLL | None:
    src = Path(__file__).with_name(f"{name}.c")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log(f"no C compiler (cc, gcc or $CC) for shared/{name}.c; using its numpy path")
        return None
    key = hashlib.sha256(src.read_bytes() + " ".join((cc, *FLAGS, platform.machine())).encode()).hexdigest()[:16]
    out = cache_dir() / f"{name}-{key}.so"
    if not out.exists():
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError:  # a read-only home: the machine's temporary folder, per user
            out = Path(tempfile.gettempdir()) / f"dflash-native-{os.getuid()}" / out.name
            out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists():
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            subprocess.run([cc, *FLAGS, "-o", tmp, str(src)], check=True, capture_output=True, timeout=300)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(out))
