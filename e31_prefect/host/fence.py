"""A run's fence keeper: stops the run's work once its fence lease runs out, whatever its supervisor does.

    python -s -m e31_prefect.host.fence $E31_HOME/ledger/<flow run id>   # or forked by the run's supervisor

The supervisor extends the lease each time the Prefect API takes one of its heartbeats
(:mod:`e31_prefect.host.heartbeat`). A host cut off from the API, or whose supervisor is stopped or hung,
extends it no more: once it runs out, the keeper kills every process of the work (its cgroup, or what runs
below the supervisor; a container through Docker) and says when in ``fenced.json``. The pool requeues the
run only later (``E31_HOST_LOST_SECONDS``, a quarter more than the fence), so one run never works in two
places at once. Its outputs stay where the work wrote them, for its host's worker to keep in its spool.

It leaves once the supervisor recorded the work's end, once the run's folder is gone, or once it fenced.
Only the standard library (and the Docker client, for a container, when it fences).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

from e31_prefect.host.heartbeat import FENCED_FILE, lease_end, read_lease
from e31_prefect.host.ledger import RunFolder, now, write_json
from e31_prefect.model.attempts import fence_seconds

CHECK_SECONDS = 1.0
KILL_SECONDS = 10.0  # how long the keeper goes on killing what it finds of the work


def keep(folder: RunFolder, supervisor: int) -> int:
    """Watch the lease until the work ended (0) or the keeper fenced it (1)."""
    while folder.path.exists():
        record = folder.record()
        if record is not None and record.finished:
            return 0
        own, _ = read_lease(folder.path)
        spec = folder.spec()
        until = lease_end(own, Path(spec.host_beat_file) if spec and spec.host_beat_file else None,
                          timedelta(seconds=fence_seconds(spec.host_lost_seconds)) if spec else timedelta())
        at = now()
        if until is not None and at >= until:
            fence(folder, supervisor)
            return 1
        wait = CHECK_SECONDS if until is None else min(CHECK_SECONDS, (until - at).total_seconds())
        time.sleep(max(0.05, wait))
    return 0


def fence(folder: RunFolder, supervisor: int) -> None:
    """Stop every process of the run's work now, and say when (nothing, where none of it was left)."""
    record = folder.record()
    spec = folder.spec()
    cgroup = Path(record.cgroup) if record is not None and record.cgroup else None
    container = record.infrastructure if spec is not None and spec.runtime == "container" and record else None
    said = False
    deadline = time.monotonic() + KILL_SECONDS
    while time.monotonic() < deadline:
        at = now()
        left = _in_group(cgroup) | _below(supervisor)
        if not left and not container:
            return
        if not said:
            write_json(folder.path / FENCED_FILE, {"at": at.isoformat()})
            said = True
        if container:
            _kill_container(container)
            container = None
        if cgroup is not None:
            with contextlib.suppress(OSError):
                (cgroup / "cgroup.kill").write_text("1")
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _in_group(cgroup: Path | None) -> set[int]:
    """The processes in the run's cgroup (v2)."""
    if cgroup is None:
        return set()
    try:
        return {int(pid) for pid in (cgroup / "cgroup.procs").read_text().split()}
    except OSError:
        return set()


def _below(root: int) -> set[int]:
    """Every live process below the supervisor (its subreaper's orphans too), but this keeper."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if stat[0] not in ("Z", "X"):
            children.setdefault(int(stat[1]), []).append(int(entry))
    found: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    found.discard(os.getpid())
    return found


def _kill_container(container: str) -> None:
    with contextlib.suppress(Exception):
        import docker

        client = docker.from_env(timeout=10)
        try:
            client.api.kill(container)
        finally:
            client.close()


def main(argv: list[str] | None = None) -> int:
    """Keep the fence of the run whose ledger folder is the first argument (its supervisor is our parent)."""
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stop of the work is the supervisor's; the keeper outlasts it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return keep(RunFolder(Path(argv[0])), os.getppid())


if __name__ == "__main__":
    sys.exit(main())
