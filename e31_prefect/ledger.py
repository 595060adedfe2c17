"""What the e31 workers on this host hold, kept on disk so a restarted worker can clean up after a killed one.

One JSON file per running flow run under ``$E31_HOME/ledger/``: which worker
process holds it, its process or container, its devices, its meter marks so
far and its last heartbeat. A worker that starts reads the entries whose
worker process is gone: their runs are stopped, closed at their last
heartbeat and released, so no GPU stays held and no meter keeps running.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path


@dataclass
class Holding:
    """One run held by one worker process on this host."""

    flow_run_id: str
    worker_pid: int
    worker_started: str  # the worker process's start time: a reused pid is not the same worker
    job_name: str
    devices: list[int]
    workspace: str
    destination: str | None = None
    infrastructure: str | None = None  # process group id, or container id
    lease: str | None = None  # the pool/team quota lease, released on recovery
    runtime: str = "process"
    gpus: int = 0
    team: str | None = None
    storage: str | None = None  # the job's E31 Storage block, to send what it wrote with its credentials
    marks: dict[str, str] = field(default_factory=dict)
    heartbeat: str | None = None

    def marks_as_datetimes(self) -> dict[str, datetime]:
        """The meter marks recorded so far."""
        return {step: datetime.fromisoformat(at) for step, at in self.marks.items()}


def _stat(pid: int) -> list[str] | None:
    """A process's /proc stat fields after its name (state first); None if it does not exist."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def process_start_time(pid: int) -> str | None:
    """When a process started (in clock ticks since boot, from /proc); None if it does not exist."""
    fields = _stat(pid)
    return fields[19] if fields else None


def process_running(pid: int) -> bool:
    """Whether a process runs (a killed one left unreaped as a zombie does not)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def this_process() -> tuple[int, str]:
    """This process's pid and start time, as a ledger entry names its worker."""
    pid = os.getpid()
    return pid, process_start_time(pid) or "unknown"


class Ledger:
    """The on-disk record of held runs on this host."""

    def __init__(self, root: Path):
        self.root = root

    def _path(self, flow_run_id: str) -> Path:
        return self.root / f"{flow_run_id}.json"

    def record(self, holding: Holding) -> None:
        """Write (or rewrite) a run's entry atomically."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self._path(holding.flow_run_id)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(asdict(holding)))
        temporary.replace(path)

    def forget(self, flow_run_id: str) -> None:
        """The run was released: drop its entry."""
        self._path(flow_run_id).unlink(missing_ok=True)

    def entries(self) -> list[Holding]:
        """Every entry on this host, readable or not skipped."""
        if not self.root.exists():
            return []
        found = []
        for path in sorted(self.root.glob("*.json")):
            try:
                found.append(Holding(**json.loads(path.read_text())))
            except (OSError, ValueError, TypeError):
                continue
        return found

    def orphans(self) -> list[Holding]:
        """Entries whose worker process no longer runs."""
        return [h for h in self.entries() if process_start_time(h.worker_pid) != h.worker_started]
