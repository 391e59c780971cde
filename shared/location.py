"""Where a store lives: a local (or shared POSIX) folder, or a prefix on object storage.

Everything the store's crash-safety and claiming rules need, and nothing more, with the same
meaning on both (docs/DESIGN.md, "Stores on object storage"):

    write(key, data)            the whole object or file appears at once, or not at all
    create(key, data) -> token  write only if the key does not exist (else None); exactly one
                                of several concurrent creators wins
    read_versioned(key)         (data, token); replace(key, data, token) writes only if the key
                                is unchanged since that read (compare-and-swap)

Local folders get them from rename(2), link(2) and an flock on the claims folder; object stores
from a PUT (atomic by definition), `If-None-Match: *` and `If-Match: <etag>` (S3 since 2024,
GCS, Azure; SeaweedFS and MinIO too). Object stores go through obstore, which zarr also reads
them with; credentials and endpoints come from the client's usual environment (AWS_* for S3,
GOOGLE_* for GCS, AZURE_* for Azure), never from our files.
"""

from __future__ import annotations

import abc
import contextlib
import fcntl
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path

TMP_MARK = ".tmp"                                   # <name>.tmp<pid>-<8 hex>: a write in progress
_TMP_NAME = re.compile(r"\.tmp\d+-[0-9a-f]{8}$")
PROBE = ".probe-"                                   # prepare()'s writability check, gone at once

_SCHEMES = ("s3://", "s3a://", "gs://", "gcs://", "az://", "abfs://", "azure://", "memory://", "http://",
            "https://")


def is_url(spec: str | Path) -> bool:
    return isinstance(spec, str) and spec.startswith(_SCHEMES)


class Location(abc.ABC):
    """A store's root. Keys are '/'-separated paths relative to it (e.g. '_progress/unit-0000001.json').
    Every member a store, its claims and its writers use is declared here (as zarr's own Store
    declares its interface); LocalLocation and ObjectLocation implement each with the same meaning."""

    url: str
    local: bool   # a POSIX folder: fcntl locks, pids and free space mean something

    def __str__(self) -> str:
        return self.url

    # -- objects --
    @abc.abstractmethod
    def read(self, key: str) -> bytes | None:
        """The object's bytes, None if absent."""

    @abc.abstractmethod
    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes start:end of an object that exists (the loader's chunks of a shard)."""

    @abc.abstractmethod
    def read_tail(self, key: str, n: int) -> bytes | None:
        """The object's last n bytes (all of it if shorter), None if absent (a shard's index)."""

    @abc.abstractmethod
    def write(self, key: str, data: "bytes | Iterable[bytes]"):
        """The whole object appears at once (pieces are written one after another), or not at all."""

    @abc.abstractmethod
    def create(self, key: str, data: bytes) -> object | None:
        """Write only if the key does not exist: a version token, or None if it existed. Exactly one
        of several concurrent creators wins."""

    @abc.abstractmethod
    def read_versioned(self, key: str) -> tuple[bytes, object] | None:
        """(bytes, version token) for replace(), None if absent."""

    @abc.abstractmethod
    def replace(self, key: str, data: bytes, token) -> object | None:
        """Write only if the key is unchanged since the read that gave `token` (compare-and-swap):
        the new token, or None."""

    @abc.abstractmethod
    def delete(self, key: str):
        """Remove one key (absent is fine)."""

    # -- listing and the whole root --
    @abc.abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Every key under the prefix, sorted."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str):
        """Remove every key under the prefix."""

    @abc.abstractmethod
    def names(self) -> set[str]:
        """The top-level names at the root (files, folders, key prefixes)."""

    @abc.abstractmethod
    def delete_all(self, keep: tuple[str, ...] = ()):
        """Remove everything at the root but the top-level names in `keep`."""

    @abc.abstractmethod
    def size(self) -> int:
        """Bytes of every file or object."""

    @abc.abstractmethod
    def free_bytes(self) -> int | None:
        """Free space where the store grows; None where there is none to check (object storage)."""

    @abc.abstractmethod
    def sweep_temporaries(self) -> int:
        """Deletes what writes that never finished left behind; returns how many. Called only
        when no writer is at work."""

    @abc.abstractmethod
    def prepare(self):
        """Make the root exist, where that means something."""

    @abc.abstractmethod
    def is_file(self) -> bool:
        """Whether the location is an existing plain file (refused as a store)."""

    @abc.abstractmethod
    def zarr_store(self, read_only: bool = False):
        """What zarr opens the group with."""


class LocalLocation(Location):
    local = True

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.url = str(path)

    def zarr_store(self, read_only: bool = False):
        return str(self.path)

    def _p(self, key: str) -> Path:
        return self.path / key

    def is_file(self) -> bool:
        return self.path.is_file()

    def read(self, key: str) -> bytes | None:
        try:
            return self._p(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def read_range(self, key: str, start: int, end: int) -> bytes:
        fd = os.open(self._p(key), os.O_RDONLY)
        try:
            return os.pread(fd, end - start, start)
        finally:
            os.close(fd)

    def read_tail(self, key: str, n: int) -> bytes | None:
        try:
            fd = os.open(self._p(key), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            size = os.fstat(fd).st_size
            return os.pread(fd, min(n, size), max(0, size - n))
        finally:
            os.close(fd)

    def _staged(self, key: str, data: "bytes | Iterable[bytes]") -> tuple[Path, Path]:
        """(the key's path, a temporary file beside it holding data): renamed or linked into place."""
        p = self._p(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f"{p.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as f:
                f.write(data) if isinstance(data, (bytes, bytearray, memoryview)) else f.writelines(data)
        except BaseException:  # a full disk, an interrupt: no half-written file is left in the store
            tmp.unlink(missing_ok=True)
            raise
        return p, tmp

    def write(self, key: str, data: "bytes | Iterable[bytes]"):
        """data: bytes, or pieces written one after another as they come."""
        p, tmp = self._staged(key, data)
        try:
            os.replace(tmp, p)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def sweep_temporaries(self) -> int:
        """Deletes the temporary files of writes that never finished (a process killed while it
        wrote, where no exception handler ran); only when no writer is at work (finalizing)."""
        n = 0
        for f in self.path.rglob(f"*{TMP_MARK}*"):
            if _TMP_NAME.search(f.name) and f.is_file():
                f.unlink(missing_ok=True)
                n += 1
        return n

    def create(self, key: str, data: bytes):
        p, tmp = self._staged(key, data)
        try:
            os.link(tmp, p)  # fails if p exists; p appears with its whole content
            st = p.stat()
            return st.st_ino, st.st_mtime_ns, st.st_size
        except FileExistsError:
            return None
        finally:
            tmp.unlink()

    @contextlib.contextmanager
    def _folder_lock(self, key: str):
        fd = os.open(self._p(key).parent, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def read_versioned(self, key: str):
        p = self._p(key)
        try:
            with self._folder_lock(key):
                st = p.stat()
                return p.read_bytes(), (st.st_ino, st.st_mtime_ns, st.st_size)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def replace(self, key: str, data: bytes, token) -> object | None:
        """Write data if key still is what read_versioned returned with token; the new token or None."""
        p = self._p(key)
        try:
            with self._folder_lock(key):
                st = p.stat()
                if (st.st_ino, st.st_mtime_ns, st.st_size) != token:
                    return None
                self.write(key, data)
                st = p.stat()
                return st.st_ino, st.st_mtime_ns, st.st_size
        except (FileNotFoundError, NotADirectoryError):
            return None

    def list(self, prefix: str) -> list[str]:
        """Keys under a folder prefix ('_progress/'), temporary files excluded."""
        d = self._p(prefix)
        if not d.is_dir():
            return []
        return sorted(f"{prefix}{p.name}" for p in d.iterdir() if p.is_file() and ".tmp" not in p.name)

    def delete(self, key: str):
        with contextlib.suppress(FileNotFoundError):
            self._p(key).unlink()

    def delete_prefix(self, prefix: str):
        shutil.rmtree(self._p(prefix), ignore_errors=True)

    def names(self) -> set[str]:
        """Top-level entries (files and folders); not another process's writability probe."""
        return {p.name for p in self.path.iterdir() if not p.name.startswith(PROBE)} if self.path.is_dir() else set()

    def delete_all(self, keep: tuple[str, ...] = ()):
        """Everything in the store except the top-level entries named in keep."""
        if not self.path.is_dir():
            return
        for p in self.path.iterdir():
            if p.name in keep:
                continue
            shutil.rmtree(p) if p.is_dir() else p.unlink()

    def size(self) -> int:
        return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())

    def free_bytes(self) -> int:
        p = self.path
        while not p.exists():
            p = p.parent
        return shutil.disk_usage(p).free

    def prepare(self):
        """The folder, made if missing, and proven writable (a folder on a read-only mount
        exists but refuses the first file: better here than in a writer process)."""
        self.path.mkdir(parents=True, exist_ok=True)
        probe = self.path / f"{PROBE}{uuid.uuid4().hex}"
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        probe.unlink()


class ObjectLocation(Location):
    local = False

    def __init__(self, url: str):
        import obstore
        from obstore.store import from_url

        self.url = url.rstrip("/")
        self._obs = obstore
        self.store = from_url(self.url)

    def sweep_temporaries(self) -> int:
        return 0  # a PUT appears whole or not at all: nothing is staged

    def zarr_store(self, read_only: bool = False):
        from zarr.storage import ObjectStore
        return ObjectStore(self.store, read_only=read_only)

    def is_file(self) -> bool:
        return False

    def read(self, key: str) -> bytes | None:
        got = self.read_versioned(key)
        return None if got is None else got[0]

    def read_range(self, key: str, start: int, end: int) -> bytes:
        return bytes(self._obs.get_range(self.store, key, start=start, end=end))

    def read_tail(self, key: str, n: int) -> bytes | None:
        try:
            return bytes(self._obs.get(self.store, key, options={"range": {"suffix": n}}).bytes())
        except FileNotFoundError:
            return None

    def read_versioned(self, key: str):
        try:
            r = self._obs.get(self.store, key)
        except FileNotFoundError:
            return None
        return bytes(r.bytes()), r.meta["e_tag"]

    def write(self, key: str, data: "bytes | Iterable[bytes]"):
        self._obs.put(self.store, key, data if isinstance(data, (bytes, bytearray, memoryview)) else b"".join(data))

    def create(self, key: str, data: bytes):
        try:
            return self._obs.put(self.store, key, data, mode="create")["e_tag"]
        except (self._obs.exceptions.AlreadyExistsError, self._obs.exceptions.PreconditionError):
            return None

    def replace(self, key: str, data: bytes, token) -> object | None:
        try:
            r = self._obs.put(self.store, key, data, mode={"e_tag": token})
        except (self._obs.exceptions.PreconditionError, FileNotFoundError):
            return None
        return r["e_tag"]

    def _metas(self, prefix: str = ""):
        for batch in self._obs.list(self.store, prefix or None, chunk_size=1000):
            yield from batch

    def list(self, prefix: str) -> list[str]:
        return sorted(m["path"] for m in self._metas(prefix))

    def delete(self, key: str):
        with contextlib.suppress(FileNotFoundError):
            self._obs.delete(self.store, key)

    def delete_prefix(self, prefix: str):
        keys = self.list(prefix)
        for i in range(0, len(keys), 1000):
            self._obs.delete(self.store, keys[i:i + 1000])

    def names(self) -> set[str]:
        # from the objects themselves: some servers keep an emptied folder listed
        return {m["path"].split("/", 1)[0] for m in self._metas()}

    def delete_all(self, keep: tuple[str, ...] = ()):
        keys = [m["path"] for m in self._metas() if m["path"].split("/", 1)[0] not in keep]
        for i in range(0, len(keys), 1000):
            self._obs.delete(self.store, keys[i:i + 1000])

    def size(self) -> int:
        return sum(m["size"] for m in self._metas())

    def free_bytes(self) -> None:
        return None  # object storage has no free space to check

    def prepare(self):
        pass


# --- local files -----------------------------------------------------------------------------

def atomic_write_text(path: Path, text: str):
    """Write through a temporary name in the same folder, then rename: readers see the old file
    or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def as_location(where: "str | Path | Location") -> Location:
    """A Location for a store given as a path, a URL, or already a Location."""
    if isinstance(where, Location):
        return where
    if is_url(where):
        return ObjectLocation(str(where))
    if isinstance(where, str) and where.startswith("file://"):
        where = where[len("file://"):]
    return LocalLocation(where)


def object_store_error(e: BaseException) -> str | None:
    """One line for a failure of object storage (obstore's errors, also raised through zarr):
    the server's own error code and message where it sent one (NoSuchBucket, AccessDenied, ...),
    else what the client says, first line only. None for any other exception."""
    try:
        from obstore.exceptions import BaseError
    except ImportError:  # pragma: no cover - obstore is a dependency
        return None
    if not isinstance(e, BaseError):
        return None
    text = str(e)
    code, msg = re.search(r"<Code>([^<]*)</Code>", text), re.search(r"<Message>([^<]*)</Message>", text)
    if code:
        return f"{code.group(1)}: {msg.group(1) if msg else text.splitlines()[0][:200]}"
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")
    low = text.lower()
    if any(s in low for s in ("connection refused", "error sending request", "dns error", "timed out",
                              "connect error", "tcp connect")):
        where = f" {endpoint}" if endpoint else ""
        return f"the object store{where} cannot be reached ({type(e).__name__}: {text.splitlines()[0][:160]})"
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}"
