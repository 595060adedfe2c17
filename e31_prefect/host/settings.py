"""Settings of the e31 worker and CLI, read from ``E31_*`` environment variables.

``E31_GPUS="4xH100" prefect worker start --pool gpu --type e31`` declares a host's GPUs.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from e31_prefect.model.job_values import SIZE_HINT, parse_bytes

# A Prefect server's setting e31 relies on: quota leases on disk, not in the server's memory, so a
# restarted server still knows which slots are held and frees those whose lease ran out (leases in
# memory die with the server and leave their slots held for ever).
DURABLE_LEASES = {"PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem"}


class E31Settings(BaseSettings):
    """Where e31 keeps its files on a host and how it treats the runs it starts."""

    model_config = SettingsConfigDict(env_prefix="E31_", extra="ignore")

    host_name: str = Field(
        default_factory=socket.gethostname, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="This host's name in the pool: in each run's infrastructure id, its ledger entry, its devices' "
        "events, its published inventory and heartbeats. Default: the machine's hostname; give each e31 host on one "
        "machine a name of its own (with its own E31_HOME and E31_DEVICE_LOCKS), as tests and benchmarks do.",
    )
    gpus: str | None = Field(
        default=None,
        description="Declared GPU inventory (0:H100,1:H100 or 4xH100); NVML is asked when unset.",
    )
    home: Path = Field(
        default=Path("~/.e31").expanduser(),
        description="Workspaces of running jobs and the spool of outputs not yet sent; e31's folders there are "
        "kept 0700, closed to jobs.",
    )
    device_locks: Path = Field(
        default=Path("/run/lock/e31"),
        description="Host-wide folder of device lock files, shared by every e31 worker on the host whatever its "
        "pool or E31_HOME, so a device is rented to one run at a time per host. It is 2770: the workers of its "
        "owner and its group share it (workers of several users: make it for a group they are in), no job opens it.",
    )
    host_lost_seconds: float = Field(
        default=120.0, ge=0,
        description="A pool setting (set it alike on its workers): a host whose workers and run supervisors have not "
        "reached the Prefect API for this long is lost; any live worker of the pool ends its runs' attempts, billed "
        "to its last heartbeat, and requeues them as new attempts where their deadlines allow. A supervisor cut off "
        "for three quarters of it stops its work itself (fencing), so no run works in two places at once. 0: none.",
    )
    host_attempts: int = Field(
        default=2, ge=1,
        description="A pool setting: how many attempts a run may have in all when hosts are lost under it or its "
        "GPU fails (each rented attempt counts; a loss before the rent does not). Its own Prefect retries are "
        "kept for its own failures.",
    )
    gpu_health_command: str | None = Field(
        default=None,
        description="A command that checks one GPU, run for each device every E31_GPU_HEALTH_SECONDS ({index} and "
        "{uuid} filled in, E31_GPU_INDEX set): a non-zero exit (or 30 s without one) drains the device, with its "
        "last line of output as the reason, and the run on it ends DeviceFailed and is requeued. NVML's lost GPUs, "
        "critical Xid events and uncorrected ECC errors drain a device too.",
    )
    gpu_health_seconds: float = Field(
        default=30.0, gt=0, description="How often a pool's worker checks its GPUs' health.",
    )
    allowed_volumes: list[Path] = Field(
        default_factory=list,
        description="Host folders job containers may mount read-only (a pool's volumes setting), as a JSON "
        'list: E31_ALLOWED_VOLUMES=\'["/datasets", "/models"]\'. None by default.',
    )
    cgroups: bool = Field(
        default=True,
        description="Put each process run in a cgroup of its own where the host allows (memory and pids limits, "
        "every process killed at the end); false: its processes are found as its supervisor's descendants.",
    )
    container_user: str = Field(
        default="62000:62000",
        pattern=r"^(\d+(:\d+)?)?$",
        description="uid:gid job containers run as (no account is needed in the image); its output dir is "
        "made its own. Empty: the image's own user (root in many images), for a pool whose operator allows it.",
    )
    queue_teams: dict[str, str] = Field(
        default_factory=dict,
        description='Work queues that belong to teams, as JSON: E31_QUEUE_TEAMS=\'{"vision": "vision"}\'. A run '
        "from such a queue is metered to its team, and a job that names another team is refused.",
    )
    job_users: Literal["auto", "worker"] = Field(
        default="auto",
        description="auto: where the worker runs as root, each process job runs as a uid of its own "
        "(61000-61999, no account needed), in a network of its own that reaches only its Prefect gateway; "
        "worker: process jobs run as the worker's user, with the worker's network.",
    )
    stop_grace_seconds: float = Field(
        default=10.0,
        description="At the time limit, how long a run has after SIGTERM before SIGKILL.",
    )
    report_grace_seconds: float = Field(
        default=60.0,
        description="After a job's engine says its flow returned, how long the job may take to report it and end "
        "(its hooks run then) before its supervisor kills it and the run ends KeptRunning. Billed: the meter "
        "stops when the job's last process is gone.",
    )
    report_seconds: float = Field(
        default=5.0, ge=0,
        description="How long a job's engine may take to report its flow's last state to the Prefect API before "
        "it leaves and e31 reports that state once the API answers: what an API that is down at the end of a run "
        "costs a team, at most.",
    )
    watch_seconds: float = Field(
        default=2.0, description="How often a running run's state is read, to stop it when cancelled."
    )
    backlog_heal_seconds: float = Field(
        default=300.0, gt=0,
        description="How often a pool's worker reads its whole backlog again, in the background; between those "
        "reads Prefect's flow-run events say which waiting runs changed.",
    )
    keep_workspaces: bool = Field(
        default=False, description="Keep each run's workspace after release (for debugging)."
    )
    history_runs: int = Field(
        default=20, ge=0, le=1000,
        description="How many recent completed runs of a deployment (per team) the scheduler learns a run's length "
        "from (a high quantile of their work times, capped by the run's limit); 0 plans every run by its limit. "
        "Set the same on every worker of a pool.",
    )
    history_refresh_seconds: float = Field(
        default=60.0, gt=0,
        description="How often a deployment's recent runs are read again from the Prefect server.",
    )
    plan_artifact_seconds: float = Field(
        default=30.0, gt=0,
        description="At most how often a worker writes the pool's plan (the e31-plan-<pool> table artifact), "
        "and only when it changed.",
    )
    cache_bytes: int = Field(
        default=50 * 2**30,
        description="Size bound of the host's content cache of staged inputs (bytes, or 200g, 500Gi); "
        "least recently used entries go first. 0 turns the cache off.",
    )

    @field_validator("cache_bytes", mode="before")
    @classmethod
    def _size(cls, value: object) -> object:
        if isinstance(value, str):
            try:
                return parse_bytes(value)
            except ValueError:
                raise ValueError(f"{value!r} is not a size; {SIZE_HINT}") from None
        return value

    @property
    def workspaces(self) -> Path:
        """One folder per flow run: data/ and output/."""
        return self.home.expanduser() / "workspaces"

    @property
    def cache(self) -> Path:
        """The host's content cache of staged inputs, shared by every worker on the host."""
        return self.home.expanduser() / "cache"

    @property
    def accounting(self) -> Path:
        """The host's accounting file: one JSON line per run, appended by its supervisor as the work ends."""
        return self.home.expanduser() / "accounting.jsonl"

    @property
    def spool(self) -> Path:
        """Outputs kept because their destination could not take them."""
        return self.home.expanduser() / "spool"

    file_roots: dict[str, list[Path]] = Field(
        default_factory=dict,
        description="Host folders each team's jobs may name in file:// inputs and destinations, besides their "
        'own job folder, as JSON (team -> folders; "*" is every team): '
        'E31_FILE_ROOTS=\'{"*": ["/datasets"], "vision": ["/results/vision"]}\'. None by default.',
    )

    @field_validator("file_roots")
    @classmethod
    def _absolute_roots(cls, value: dict[str, list[Path]]) -> dict[str, list[Path]]:
        for team, roots in value.items():
            for root in roots:
                if not root.is_absolute():
                    raise ValueError(f"team {team!r}: {str(root)!r} is not an absolute folder; give each root "
                                     "as an absolute path, e.g. /datasets")
        return value

    # A process job's private temp folders and the uids it runs as (issue 21).
    job_temp_bytes: int = Field(
        default=2 * 2**30,
        description="Size bound of each private temp folder a process job gets in place of the host's world-"
        "writable ones (/tmp, /var/tmp, /dev/shm, /run/lock ...): bytes, or 512m, 8Gi. Write bigger scratch "
        "files in the workspace.",
    )
    job_uids: str = Field(
        default="61000-61999", pattern=r"^\d+-\d+$",
        description="The uids process jobs run as where the worker runs as root, first-last (no account is "
        "needed). Every worker on a host claims them in one host-wide folder, whatever its range.",
    )

    @field_validator("job_temp_bytes", mode="before")
    @classmethod
    def _temp_size(cls, value: object) -> object:
        try:
            size = parse_bytes(value) if isinstance(value, (str, int)) else value
        except ValueError:
            raise ValueError(f"E31_JOB_TEMP_BYTES={value!r} is not a size; {SIZE_HINT}") from None
        if isinstance(size, int) and size < 2**20:  # tmpfs reads 0 as no bound at all
            raise ValueError(f"E31_JOB_TEMP_BYTES={value!r}: a job's temp folders need a bound of 1m or more, "
                             "e.g. 2Gi")
        return size

    @field_validator("job_uids")
    @classmethod
    def _uid_range(cls, value: str) -> str:
        first, last = (int(part) for part in value.split("-"))
        if not 1000 <= first <= last < 2**31:
            raise ValueError(f"E31_JOB_UIDS={value!r}: give first-last with 1000 <= first <= last < 2147483648, "
                             "far from the host's accounts, e.g. 61000-61999")
        # A job's uid is swept (its processes killed, its files and IPC removed) before it is handed out again:
        # an account's uid in the range would be swept too.
        import pwd

        if accounts := sorted(f"{a.pw_name} ({a.pw_uid})" for a in pwd.getpwall() if first <= a.pw_uid <= last):
            raise ValueError(f"E31_JOB_UIDS={value!r} holds the uids of accounts of this host: {', '.join(accounts)}; "
                             "choose a range no account uses, e.g. 61000-61999")
        return value

    @property
    def job_uid_range(self) -> range:
        """The uids process jobs run as."""
        first, last = (int(part) for part in self.job_uids.split("-"))
        return range(first, last + 1)
