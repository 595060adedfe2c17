"""Every process of one run in one place: a cgroup per run, where the host lets e31 make one.

A run's supervisor (:mod:`e31_prefect.host.supervisor`) puts the work in a cgroup of
its own, so that no process of it escapes, whatever it does (``setsid``, a
double fork, a daemon): at the end the whole group is killed. Limits come from
the job's request: ``memory.max`` (no swap) and ``pids.max``.

Hosts differ, so the group is made of what the host has:

- cgroup v2 (``cgroup2`` mount): membership, ``cgroup.kill``, and memory and pids
  limits where those controllers can be enabled under ``<mount>/e31``;
- cgroup v1 ``memory`` and ``pids`` hierarchies (a hybrid host): the limits, and
  membership where v2 is absent; a v1 ``devices`` hierarchy: the run's device rules
  (:mod:`e31_prefect.host.device_fence`, which also fences a v2 group);
- none (no permission, no cgroupfs): membership is the supervisor's descendants,
  which it finds as the child subreaper they are reparented to.

Only the standard library: a supervisor starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

E31_FOLDER = "e31"
_V1_LIMITS = ("memory", "pids")
_V1_CONTROLLERS = (*_V1_LIMITS, "devices")  # devices: the run's device rules, set by device_fence


@dataclass(frozen=True)
class Mounts:
    """Where the host mounts its cgroup hierarchies: the v2 one and v1 ones by controller."""

    v2: Path | None = None
    v1: dict[str, Path] = field(default_factory=dict)


def read_mounts(mountinfo: str) -> Mounts:
    """The cgroup mounts listed in ``/proc/self/mountinfo`` text."""
    v2: Path | None = None
    v1: dict[str, Path] = {}
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, after = left.split(), right.split()
        if len(fields) < 5 or len(after) < 3:
            continue
        mount_point, kind, options = Path(fields[4]), after[0], after[2].split(",")
        if kind == "cgroup2" and v2 is None:
            v2 = mount_point
        elif kind == "cgroup":
            for controller in _V1_CONTROLLERS:
                if controller in options:
                    v1.setdefault(controller, mount_point)
    return Mounts(v2, v1)


def host_mounts() -> Mounts:
    """This host's cgroup mounts (none where /proc cannot tell)."""
    try:
        return read_mounts(Path("/proc/self/mountinfo").read_text())
    except OSError:
        return Mounts()


def _write(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


class RunGroup:
    """The cgroup(s) holding one run's processes, with the limits the host could apply.

    Made with :meth:`create`; a child joins it by writing its pid to :attr:`join_files`
    before it runs the work (see :func:`join`).
    """

    def __init__(self, v2: Path | None, v1: dict[str, Path], limits: dict[str, bool], why: list[str]):
        self.v2 = v2
        self.v1 = v1
        self.limits = limits
        self.why = why  # what the host could not give, in words, for the run's log

    @classmethod
    def create(cls, name: str, memory_bytes: int | None, pids_limit: int | None,
               mounts: Mounts | None = None) -> RunGroup:
        """Make the run's cgroup(s) under ``<mount>/e31/`` and apply what limits the host allows."""
        mounts = host_mounts() if mounts is None else mounts
        why: list[str] = []
        wanted = {"memory": memory_bytes is not None, "pids": pids_limit is not None}
        limits = {"memory": False, "pids": False}
        v2 = None
        if mounts.v2 is not None:
            v2 = _make(mounts.v2 / E31_FOLDER / name, why)
            if v2 is not None:
                enabled = _enable_v2_controllers(mounts.v2, [c for c, on in wanted.items() if on])
                for controller in enabled:
                    limits[controller] = _apply(v2, "v2", controller, memory_bytes, pids_limit, why)
        v1: dict[str, Path] = {}
        for controller, mount in mounts.v1.items():
            if controller in limits and (limits[controller] or not wanted[controller] and v2 is not None):
                continue  # v2 holds it, or nothing asks for it and v2 already tracks membership
            made = _make(mount / E31_FOLDER / name, why)
            if made is None:
                continue
            v1[controller] = made
            if wanted.get(controller):
                limits[controller] = _apply(made, "v1", controller, memory_bytes, pids_limit, why)
        for controller, on in wanted.items():
            if on and not limits[controller]:
                why.append(f"this host gives e31 no cgroup {controller} controller: the {controller} limit "
                           "is not enforced for this run")
        if v2 is None and not v1:
            why.append("no cgroup could be made for this run; its processes are tracked as the supervisor's "
                       "descendants")
        return cls(v2, v1, limits, why)

    @property
    def join_files(self) -> list[Path]:
        """The ``cgroup.procs`` files a process writes itself into to join the run."""
        return [path / "cgroup.procs" for path in ([self.v2] if self.v2 else []) + list(self.v1.values())]

    @property
    def tracks(self) -> bool:
        """Whether membership is kept by the kernel (else by the supervisor's descendants)."""
        return bool(self.v2 or self.v1)

    def pids(self) -> set[int]:
        """Every process in the run's cgroup(s) now."""
        found: set[int] = set()
        for procs in self.join_files:
            with contextlib.suppress(OSError, ValueError):
                found |= {int(line) for line in procs.read_text().split()}
        return found

    def kill(self) -> None:
        """SIGKILL every process in the run, including ones forking as they are killed."""
        if self.v2 is not None and (self.v2 / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                _write(self.v2 / "cgroup.kill", "1")
                return
        for _ in range(100):  # a fork bomb forks while we kill; its pids are bounded, so this ends
            alive = self.pids()
            if not alive:
                return
            for pid in alive:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to every process in the run."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def out_of_memory(self) -> bool:
        """Whether the kernel killed a process of the run at its memory limit."""
        counters: dict[str, str] = {}
        if self.v2 is not None:
            counters |= _counters(self.v2 / "memory.events")
        if "memory" in self.v1:
            counters |= _counters(self.v1["memory"] / "memory.oom_control")
        return int(counters.get("oom_kill", "0")) > 0

    def remove(self) -> None:
        """Remove the emptied cgroup(s) (they are removed as folders; their files go with them)."""
        for path in ([self.v2] if self.v2 else []) + list(self.v1.values()):
            for _ in range(50):  # the kernel empties a cgroup a moment after its last process dies
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        break
                    time.sleep(0.02)


def join(files: list[Path]) -> None:
    """Move the calling process into the run's cgroup(s); run in the child before it runs the work."""
    for procs in files:
        _write(procs, "0")


def kill_path(v2: str | None) -> None:
    """Kill every process left in a run's v2 cgroup (recovery after a supervisor died)."""
    if v2:
        with contextlib.suppress(OSError):
            _write(Path(v2) / "cgroup.kill", "1")


def _make(path: Path, why: list[str]) -> Path | None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except OSError as exc:
        why.append(f"cannot make cgroup {path}: {exc.strerror or exc}")
        return None


def _enable_v2_controllers(mount: Path, controllers: list[str]) -> list[str]:
    """Enable controllers for the run cgroups under ``<mount>/e31``; returns those enabled.

    The root cgroup may hold processes and still enable them for its children; ``e31`` holds
    none, so it may enable them for the runs' cgroups.
    """
    available = set(_read(mount / "cgroup.controllers").split())
    enabled = []
    for controller in controllers:
        if controller not in available:
            continue
        try:
            for parent in (mount, mount / E31_FOLDER):
                if controller not in _read(parent / "cgroup.subtree_control").split():
                    _write(parent / "cgroup.subtree_control", f"+{controller}")
            enabled.append(controller)
        except OSError:
            continue
    return enabled


# Per cgroup version and controller: the limit's file, and the file that keeps swap out of it with
# what to write there (v2 counts swap apart, v1 counts memory and swap together).
_LIMIT_FILES = {
    ("v2", "memory"): ("memory.max", "memory.swap.max", lambda limit: "0"),
    ("v1", "memory"): ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", str),
    ("v2", "pids"): ("pids.max", None, None),
    ("v1", "pids"): ("pids.max", None, None),
}


def _apply(path: Path, version: str, controller: str, memory_bytes: int | None, pids_limit: int | None,
           why: list[str]) -> bool:
    """Write the run's limit for one controller; False (and why) where the host refuses it."""
    limit = memory_bytes if controller == "memory" else pids_limit
    limit_file, swap_file, swap_value = _LIMIT_FILES[(version, controller)]
    try:
        _write(path / limit_file, str(limit))
    except OSError as exc:
        why.append(f"cannot set the {controller} limit: {exc.strerror or exc}")
        return False
    if swap_file is not None:
        with contextlib.suppress(OSError):  # no swap accounting on this host: the limit holds without it
            _write(path / swap_file, swap_value(limit))
    return True


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _counters(path: Path) -> dict[str, str]:
    return dict(line.split(None, 1) for line in _read(path).splitlines() if " " in line)
