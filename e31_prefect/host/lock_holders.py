"""Who holds a device's lock file on this host, read from ``/proc``, named in the worker's log when that is
no e31 worker and no run's supervisor.

A device locked by something else (a stray ``flock gpu-0.lock``, a job of a worker whose jobs run as its own
user) is rented to nobody and free to nobody, silently. The worker that would rent it says so instead:
the lock file, and each holding process's pid, uid and command line, at most once per lock and holder per
:data:`LOG_EVERY_S`. Only a diagnosis: a process can name itself anything, and the lock still decides.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

CHECK_EVERY_S = 60.0  # how often one locked device's holders are looked up (a walk of /proc/*/fd)
LOG_EVERY_S = 600.0  # how often one holder of one lock is named again
SUPERVISOR_MODULE = "e31_prefect.supervisor"


@dataclass(frozen=True)
class Holder:
    """A process holding a lock file open (or, per ``/proc/locks``, the one that placed its lock)."""

    pid: int
    uid: int | None
    argv: tuple[str, ...]


def flock_pids(proc_locks: str, device: int, inode: int) -> list[int]:
    """The pids ``/proc/locks`` gives for the ``flock`` locks on the file (device, inode); waiters are left out.

    A line reads ``1: FLOCK  ADVISORY  WRITE 4069 fe:00:1482821 0 EOF`` (major and minor in hex); a
    waiter's has ``->`` after its number.
    """
    pids = []
    for line in proc_locks.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        try:
            major, minor, number = fields[5].split(":")
            pid = int(fields[4])
            same = (int(major, 16), int(minor, 16), int(number)) == (os.major(device), os.minor(device), inode)
        except ValueError:
            continue
        if same and pid not in pids:
            pids.append(pid)
    return pids


def is_e31(argv: Sequence[str]) -> bool:
    """Whether a command line is an e31 worker's (``e31 run``, ``prefect worker start ... --type e31``) or a
    run's supervisor's (``python -m e31_prefect.host.supervisor``)."""
    words = list(argv)
    if any(words[i:i + 2] == ["-m", SUPERVISOR_MODULE] for i in range(len(words))):
        return True
    if any(os.path.basename(word) == "e31" for word in words[:2]):
        return True
    return "worker" in words and ("e31" in words or "--type=e31" in words)


def describe(lock: Path, holders: Sequence[Holder]) -> str:
    """The worker's log line for a device lock that no e31 process holds."""
    named = "; ".join(f"pid {h.pid} (uid {'?' if h.uid is None else h.uid}: {' '.join(h.argv)[:200] or '?'})"
                      for h in holders) or "a process this worker cannot see"
    return (f"Device lock {lock} is held by {named}, which is no e31 worker's or run's: the device is rented "
            "to no run and stays out of use until that process lets it go (kill it to free the device)")


class Throttle:
    """When a key was last acted on, so each acts at most once per interval (``now`` from the caller)."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self._last: dict[object, float] = {}

    def due(self, key: object, now: float) -> bool:
        """True (and remembered) when the key was never acted on, or not for ``every_s``."""
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            return False
        self._last[key] = now
        return True


def holders(lock: Path) -> list[Holder]:
    """The processes this worker can see holding ``lock``: those with it open, and the one that placed its
    ``flock`` (``/proc/locks``) if still alive."""
    try:
        info = os.stat(lock)
    except OSError:
        return []
    pids: list[int] = []
    with contextlib.suppress(OSError):
        pids += flock_pids(Path("/proc/locks").read_text(), info.st_dev, info.st_ino)
    real = os.path.realpath(lock)
    for pid in _pids():
        if pid not in pids and _has_open(pid, real, info):
            pids.append(pid)
    found = [_holder(pid) for pid in pids]
    return [holder for holder in found if holder is not None]


def _pids() -> Iterable[int]:
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit():
                yield int(name)


def _has_open(pid: int, real: str, info: os.stat_result) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or not ours to look at
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == real:
                target = os.stat(f"/proc/{pid}/fd/{fd}")
                if (target.st_dev, target.st_ino) == (info.st_dev, info.st_ino):
                    return True
    return False


def _holder(pid: int) -> Holder | None:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    uid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("Uid:")), None)
    return Holder(pid, uid, tuple(word.decode(errors="replace") for word in argv if word))


class StrangerWatch:
    """Names, in the worker's log, device locks held by no e31 process (checked and said at most so often)."""

    def __init__(self, log: logging.Logger, check_every_s: float = CHECK_EVERY_S, log_every_s: float = LOG_EVERY_S):
        self.log = log
        self._checks = Throttle(check_every_s)
        self._said = Throttle(log_every_s)

    def locked(self, lock: Path, now: float | None = None) -> None:
        """A device this worker would rent is locked by someone else: look who, and say so if no e31 process."""
        now = time.monotonic() if now is None else now
        if not self._checks.due(lock, now):
            return
        found = holders(lock)
        if any(is_e31(holder.argv) for holder in found):
            return
        if self._said.due((lock, tuple(h.pid for h in found)), now):
            self.log.warning(describe(lock, found))
