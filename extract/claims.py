"""Claims: which process plans the store, computes a unit, or finalizes, with no coordinator.

Every process of every run (one host or many; `python -m extract`, torchrun, or the same
command started on several nodes) works through the same store: a unit is computed by the one
process whose claim `_claims/unit-XXXXXXX.json` it holds. A claim is a lease:

  - taken with create-if-absent, so of several processes exactly one gets it;
  - renewed by its holder every lease/3 with compare-and-swap (a holder whose renewal fails has
    lost it, and stops writing that unit);
  - taken over, again with compare-and-swap, when it expired (its holder stopped renewing: a
    dead or hung process) or, on the same host, when its holder's pid is gone (kill -9 and rerun
    goes on at once).

After taking a claim the taker checks whether the work is already done (a marker, a manifest),
and if so releases it: the check and the claim together make "done" final. Leases assume
clocks that agree to well under the lease (NTP); docs/DESIGN.md, "Stores on object storage".
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Iterator

from shared import store as st
from shared.location import Location
from shared.progress import log


def _host_id() -> str:
    """This host (and pid namespace): whose pids a holder's pid can be checked against."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        boot, ns = "", 0
    return f"{socket.gethostname()}/{boot}/{ns}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Claim:
    key: str
    token: object
    until: float


class Claims:
    """The claims this process holds, renewed by a background thread while it runs."""

    def __init__(self, loc: Location, lease_s: float = 120.0):
        self.loc, self.lease = loc, float(lease_s)
        self.host, self.pid = _host_id(), os.getpid()
        self.owner = f"{socket.gethostname()}:{self.pid}:{uuid.uuid4().hex[:8]}"
        self.held: dict[str, Claim] = {}
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the lease ---------------------------------------------------------------------------
    def _record(self, until: float) -> bytes:
        return json.dumps({"owner": self.owner, "host": self.host, "pid": self.pid, "until": until,
                           "lease_s": self.lease}).encode()

    def expired(self, rec: dict) -> bool:
        if rec.get("until", 0) < time.time():
            return True
        return rec.get("host") == self.host and rec.get("pid") != self.pid and not _pid_alive(rec.get("pid", -1))

    def holder(self, name: str) -> dict | None:
        raw = self.loc.read(f"{st.CLAIMS}/{name}.json")
        try:
            return None if raw is None else json.loads(raw)
        except json.JSONDecodeError:
            return {}

    def take(self, name: str) -> bool:
        """Claim `name` (e.g. 'unit-0000012'): True if this process holds it now."""
        key = f"{st.CLAIMS}/{name}.json"
        with self._mutex:
            if name in self.held:
                return True
        until = time.time() + self.lease
        token = self.loc.create(key, self._record(until))
        if token is None:
            got = self.loc.read_versioned(key)
            if got is None:  # released in between: one more try
                token = self.loc.create(key, self._record(until))
            else:
                try:
                    rec = json.loads(got[0])
                except json.JSONDecodeError:
                    rec = {}  # a torn claim cannot come from create or replace; treat as expired
                if self.expired(rec):
                    token = self.loc.replace(key, self._record(until), got[1])
        if token is None or time.time() >= until:  # a lease that ran out while its requests ran is no claim
            return False
        with self._mutex:
            self.held[name] = Claim(key, token, until)
        return True

    def holds(self, name: str) -> bool:
        """Still ours, with a lease that has not run out (a hung process must not go on writing)."""
        with self._mutex:
            c = self.held.get(name)
        return c is not None and time.time() < c.until

    def release(self, name: str):
        with self._mutex:
            c = self.held.pop(name, None)
        if c is None:
            return
        rec = self.holder(name)
        if rec and rec.get("owner") == self.owner:
            self.loc.delete(c.key)

    def renew(self):
        with self._mutex:
            items = list(self.held.items())
        for name, c in items:
            until = time.time() + self.lease
            token = self.loc.replace(c.key, self._record(until), c.token)
            with self._mutex:
                if name not in self.held:
                    continue
                if token is None:
                    del self.held[name]
                    log(f"lost the claim on {name} (another process took it over): leaving it to them")
                else:
                    self.held[name] = Claim(c.key, token, until)

    # -- the heartbeat -----------------------------------------------------------------------
    def __enter__(self) -> "Claims":
        self._thread = threading.Thread(target=self._beat, daemon=True, name="claims")
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for name in list(self.held):
            self.release(name)

    def _beat(self):
        while not self._stop.wait(self.lease / 3):
            try:
                self.renew()
            except Exception as e:  # a network blip: the next beat tries again, within the lease
                log(f"renewing claims failed ({type(e).__name__}: {e}); retrying")


def claimed_units(claims: Claims, n_units: int, rank: int = 0, world: int = 1, poll_s: float = 2.0) -> Iterator[int]:
    """Units this process should compute, claimed one at a time as it asks for the next, until
    every unit is done. Each process starts at its own share of the units left, so processes
    rarely contend; units others hold are retried once their lease runs out."""
    waited_log = 0.0
    while True:
        done = st.done_unit_ids(claims.loc)
        left = [u for u in range(n_units) if u not in done]
        if not left:
            return
        start = (rank * len(left)) // max(world, 1)
        got = 0
        for u in left[start:] + left[:start]:
            if claims.holds(st.unit_name(u)) or not claims.take(st.unit_name(u)):
                continue
            if claims.loc.read(st.marker_key(u)) is not None:  # finished since the listing
                claims.release(st.unit_name(u))
                continue
            got += 1
            yield u
        if got == 0:
            others = [u for u in left if not claims.holds(st.unit_name(u))]
            if others and time.time() - waited_log > 60:
                held = [h for h in (claims.holder(st.unit_name(u)) for u in others[:3]) if h]
                who = ", ".join(f"{h.get('owner')} until {time.strftime('%H:%M:%S', time.localtime(h['until']))}"
                                for h in held if "until" in h)
                log(f"{len(others)} unit(s) left, claimed by other processes ({who or '...'}); waiting for "
                    f"them to finish or for their lease to run out")
                waited_log = time.time()
            time.sleep(poll_s if others else 0.1)  # only our own units in flight: they end soon


def once(claims: Claims, name: str, is_done, work, what: str, poll_s: float = 1.0):
    """Run work() in exactly one process (the one that claims `name`), unless is_done(); the
    others wait until is_done(), or take the claim over if its holder died."""
    waited_log = 0.0
    while not is_done():
        if claims.take(name):
            try:
                if not is_done():
                    work()
            finally:
                claims.release(name)
            return
        if time.time() - waited_log > 60:
            h = claims.holder(name) or {}
            log(f"waiting for {h.get('owner', 'another process')} to finish {what}")
            waited_log = time.time()
        time.sleep(poll_s)
