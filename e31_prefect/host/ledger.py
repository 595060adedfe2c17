"""What the e31 workers and run supervisors on this host hold, on disk, so no worker death loses it.

One folder per held flow run under ``$E31_HOME/ledger/<flow run id>/``:

- ``holding.json`` (the worker's): which worker holds the run, its job, devices,
  workspace, destination, lease and meter marks so far;
- ``spec.json`` (the worker's, for the supervisor): what to run and until when;
- ``record.json`` (the supervisor's alone): when the work started, when it
  reported its end, when it ended and how, its exit code;
- ``work-ended``: the pipe the job writes its end to; ``supervisor.log``, ``output.log``.

Every file is written whole and atomically (a crash leaves the old or the new
version). A worker that starts reads the folders whose worker is gone and
adopts the runs (their supervisors keep them bounded meanwhile) or closes them
from the supervisor's record. Only the standard library: the supervisor reads
and writes these files too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from e31_prefect.host.filelocks import try_lock

T = TypeVar("T")


def now() -> datetime:
    """The wall clock in UTC (the ledger's times are all UTC)."""
    return datetime.now(timezone.utc)


def moment(text: str | None) -> datetime | None:
    """A ledger time back as a datetime."""
    return datetime.fromisoformat(text) if text else None


@dataclass
class Holding:
    """One run held by one worker process on this host (written by the worker)."""

    flow_run_id: str
    worker_pid: int
    worker_started: str  # the worker process's start time: a reused pid is not the same worker
    job_name: str
    devices: list[int]
    workspace: str
    job: dict[str, Any] = field(default_factory=dict)  # the validated job, to finish the run's life elsewhere
    pool: str | None = None
    destination: str | None = None
    lease: str | None = None  # the pool/team quota lease, released when the run ends
    runtime: str = "process"
    gpus: int = 0
    team: str | None = None
    storage: str | None = None  # the job's E31 Storage block, to send what it wrote with its credentials
    stop_at: str | None = None  # the time limit: when the supervisor stops the work
    marks: dict[str, str] = field(default_factory=dict)
    output_bounds: dict[str, Any] = field(default_factory=dict)  # its OutputBounds: its disk, files, time to send
    host: str | None = None  # the host (E31_HOST_NAME) whose worker holds it: only that host's workers adopt it
    taken: str | None = None  # the Pending state its worker took it with: the attempt's (e31_prefect.model.attempts)
    attempt: int = 1

    def marks_as_datetimes(self) -> dict[str, datetime]:
        """The meter marks recorded so far."""
        return {step: datetime.fromisoformat(at) for step, at in self.marks.items()}


@dataclass
class Spec:
    """What a run's supervisor runs, and its bounds (written by the worker before the supervisor starts)."""

    run_id: str
    runtime: str  # "process" or "container"
    stop_at: str | None  # the time limit, absolute (UTC): given at the hand-over (None until then)
    grace_seconds: float = 10.0  # from SIGTERM (or docker stop) to SIGKILL
    report_grace_seconds: float = 60.0  # how long a job that said its flow returned may take to end
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # The job's own variables (its deployment's and its work.env, its dirs): given at the hand-over, so nothing
    # of the job acts before it (its entry starts again where one acts only as an interpreter starts). A null
    # unsets a variable.
    hand_over_env: dict[str, str | None] = field(default_factory=dict)
    cwd: str | None = None
    memory_bytes: int | None = None
    pids_limit: int | None = None
    container_label: str | None = None  # label=value naming the run's container, if the worker never names it
    cgroups: bool = True  # False: the work's processes are found as the supervisor's descendants only
    device_table: str = "/proc/devices"  # where the host's character majors are read (nvidia-uvm's is dynamic)
    container_logs: bool = False  # copy the container's output into the run's output log
    rented: str | None = None  # when the devices were rented (given at the hand-over): for the accounting line
    accounting: str | None = None  # the host's accounting file, where the supervisor appends the run's line
    api_upstream: str | None = None  # the Prefect API the run's gateway forwards the job's own calls to
    api_key: str | None = None  # the worker's credentials for it: an API key, or a server's auth string
    api_auth_string: str | None = None
    api_socket_fd: int | None = None  # the gateway's listening socket, inherited from the worker
    private_network: bool = False  # a process job gets a network namespace of its own (loopback only)
    job_user_locks: str | None = None  # run the process as a uid of its own, claimed in this lock folder
    job_writable: list[str] = field(default_factory=list)  # folders that uid owns (its output dir, its home)
    job_view: list[str] = field(default_factory=list)  # what the job must reach, whatever folders lie above
    job_hidden: list[str] = field(default_factory=list)  # host folders the job must not see (e31's lock folders)
    job_temp_bytes: int = 2 * 2**30  # the size bound of each of its private temp folders (/tmp, /dev/shm ...)
    job_uids: list[int] = field(default_factory=lambda: [61000, 61999])  # the uids it may run as, first and last
    # Where the output dir is no disk of its own: the bounds the supervisor counts it against (None: none).
    output_dir: str | None = None
    output_max_entries: int | None = None
    output_max_bytes: int | None = None
    # Its host's heartbeats and fence (e31_prefect.host.heartbeat): the host's name and its pool's lost time
    # (0: none; the work is not fenced).
    host: str | None = None
    host_lost_seconds: float = 0.0
    host_beat_file: str | None = None  # where the host's workers say when the API last took their heartbeat
    # The socket of the host's warm interpreter, which forks a process job's entry with Prefect loaded
    # (e31_prefect.host.warm_interpreter); None, or none answering: the entry starts as a new interpreter.
    warm_interpreter: str | None = None


@dataclass
class Record:
    """What the supervisor saw of the work (written by the supervisor alone)."""

    supervisor_pid: int | None = None
    supervisor_started: str | None = None
    cgroup: str | None = None  # the run's cgroup v2 folder, if it had one
    limits: dict[str, bool] = field(default_factory=dict)  # which request limits (and device rules) held
    notes: list[str] = field(default_factory=list)
    warm: bool = False  # its entry was forked by the host's warm interpreter (e31_prefect.host.warm_interpreter)
    infrastructure: str | None = None  # the work's pid, or its container id
    ready: str | None = None  # the job's process loaded Prefect and waits for its devices (not billed)
    started: str | None = None  # the devices were handed to the work: it runs the job's own code from here
    # The job's word that its flow returned, and the outcome it named (its engine says it before reporting
    # the final state). A word, not a bound: the meter ends when its last process is gone.
    work_ended: str | None = None
    outcome: str | None = None  # "completed", "failed", "crashed", "cancelled"
    unreported: bool = False  # its engine gave up reporting that outcome (the API did not answer): e31 reports it
    stop_reason: str | None = None  # "time-limit", "stop-requested", "report-overdue", "output-bound"
    stop_requested: str | None = None
    exited: str | None = None  # the work's main process ended (its leftovers then killed)
    ended: str | None = None  # the work's last process is gone
    exit_code: int | None = None
    # "exited", "timed-out", "stopped", "out-of-memory", "not-started", "output-bound", "kept-running" (said
    # its flow returned, then did not end within its report grace), "fenced" (its host was cut off from the API)
    ending: str | None = None
    job_user: int | None = None  # the uid the process ran as, where it had one of its own
    message: str | None = None

    @property
    def finished(self) -> bool:
        """Whether the supervisor saw the work end (or never start)."""
        return self.ending is not None


def append_line(path: Path, data: Any) -> None:
    """Append one JSON line to ``path`` in a single write, durably (many writers may append at once)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (json.dumps(data) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def output_tail(path: Path, lines: int = 5, limit: int = 800) -> str:
    """The last lines a work wrote to its log, read from its end (a log may hold gigabytes), for a
    message about how it ended."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 8192))
            text = log.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])[-limit:]


def write_json(path: Path, data: Any, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` as JSON, atomically and durably."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w") as handle:
        handle.write(json.dumps(data))  # one string: json.dump writes it piece by piece
        handle.flush()
        os.fsync(handle.fileno())
    temporary.replace(path)
    with contextlib.suppress(OSError):
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def read_json(path: Path, kind: type[T]) -> T | None:
    """A dataclass back from its JSON file; None when missing or unreadable. Unknown keys are ignored."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    known = {f.name for f in fields(kind)}  # type: ignore[arg-type]
    try:
        return kind(**{k: v for k, v in data.items() if k in known})
    except TypeError:
        return None


class RunFolder:
    """One held run's folder in the ledger."""

    def __init__(self, path: Path):
        self.path = path

    @property
    def run_id(self) -> str:
        """The flow run's id."""
        return self.path.name

    holding_file = property(lambda self: self.path / "holding.json")
    spec_file = property(lambda self: self.path / "spec.json")
    record_file = property(lambda self: self.path / "record.json")
    work_ended_pipe = property(lambda self: self.path / "work-ended")
    hand_over_pipe = property(lambda self: self.path / "hand-over")
    supervisor_log = property(lambda self: self.path / "supervisor.log")
    output_log = property(lambda self: self.path / "output.log")
    api_socket = property(lambda self: self.path / "api.sock")

    def own(self) -> int | None:
        """Take the run's owner lock (an open file; None if a live worker owns the run).

        The worker living the run holds it; the kernel drops it when that worker dies, and the
        run is then an orphan for another worker on the host to adopt.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        return try_lock(self.path / "owner.lock")

    def holding(self) -> Holding | None:
        """The worker's entry."""
        return read_json(self.holding_file, Holding)

    def spec(self) -> Spec | None:
        """What the supervisor runs."""
        return read_json(self.spec_file, Spec)

    def record(self) -> Record | None:
        """What the supervisor saw."""
        return read_json(self.record_file, Record)

    def write_holding(self, holding: Holding) -> None:
        """Write (or rewrite) the worker's entry."""
        self.path.mkdir(parents=True, exist_ok=True)
        write_json(self.holding_file, asdict(holding))

    def write_spec(self, spec: Spec) -> None:
        """Write what the supervisor will run (its environment and the API's credentials: for root alone)."""
        self.path.mkdir(parents=True, exist_ok=True)
        write_json(self.spec_file, asdict(spec), mode=0o600)

    def write_record(self, record: Record) -> None:
        """The supervisor's own record of the work (only the supervisor calls this)."""
        write_json(self.record_file, asdict(record))


def _stat(pid: int) -> list[str] | None:
    """A process's /proc stat fields after its name (state first); None if it does not exist."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def process_start_time(pid: int) -> str | None:
    """When a process started (in clock ticks since boot, from /proc); None if it does not exist."""
    fields_ = _stat(pid)
    return fields_[19] if fields_ else None


def process_running(pid: int) -> bool:
    """Whether a process runs (a killed one left unreaped as a zombie does not)."""
    fields_ = _stat(pid)
    return fields_ is not None and fields_[0] not in ("Z", "X")


def same_process(pid: int | None, started: str | None) -> bool:
    """Whether the process ``pid`` that started at ``started`` still runs (a reused pid is another one)."""
    return pid is not None and process_running(pid) and process_start_time(pid) == started


def this_process() -> tuple[int, str]:
    """This process's pid and start time, as a ledger entry names its worker."""
    pid = os.getpid()
    return pid, process_start_time(pid) or "unknown"


class Ledger:
    """The on-disk record of held runs on this host."""

    def __init__(self, root: Path):
        self.root = root

    def folder(self, flow_run_id: str) -> RunFolder:
        """The run's folder (made when first written)."""
        return RunFolder(self.root / flow_run_id)

    def forget(self, flow_run_id: str) -> None:
        """The run was released: drop its folder."""
        shutil.rmtree(self.root / flow_run_id, ignore_errors=True)

    def folders(self) -> list[RunFolder]:
        """Every run folder on this host with a readable holding."""
        if not self.root.exists():
            return []
        return [RunFolder(path) for path in sorted(self.root.iterdir())
                if path.is_dir() and (path / "holding.json").exists()]

    def claim_orphans(self, host: str | None = None) -> list[tuple[RunFolder, int]]:
        """The runs no live worker owns, each with its owner lock, now held by the caller who adopts them.

        ``host``: the caller's host name; a run held for another host (two e31 hosts on one machine that
        share an E31_HOME by mistake) is left to that host's workers.
        """
        claimed = []
        for folder in self.folders():
            holding = folder.holding()
            if host is not None and holding is not None and holding.host not in (None, host):
                continue
            fd = folder.own()
            if fd is not None:
                claimed.append((folder, fd))
        return claimed
