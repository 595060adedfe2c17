"""Where a flow run's work executes: a local process, or a container on the host's Docker engine.

A :class:`Runtime` is chosen once per run (:func:`e31_prefect.surface.life.runtime_for`): a job with
``work.image`` runs in a container, one without runs as a local process. Either
way the run's supervisor owns the work; the runtime says what it runs.

A local process loads Prefect before the rent (:attr:`Runtime.loads_before_rent`),
with no device visible and nothing of the job's, and is handed its devices'
variables (:func:`hand_over_environment`) and the job's own environment once
they are rented. A container is created once its devices are rented: its image
is the job's code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, Protocol

from e31_prefect.data.results import result_environment
from e31_prefect.dirs import DATA_DIR_VARIABLE, OUTPUT_DIR_VARIABLE
from e31_prefect.host.heartbeat import HOST_BEAT_FILE
from e31_prefect.host.inventory import Device, visible_devices_env
from e31_prefect.host.ledger import RunFolder, Spec

# The job entry's own names for its pipes and gateway (it stands alone in a container: it defines them).
from e31_prefect.job_entry import (
    API_SOCKET_VARIABLE,
    HAND_OVER_VARIABLE,
    REPORT_SECONDS_VARIABLE,
    WORK_ENDED_VARIABLE,
)
from e31_prefect.model.endings import Ending
from e31_prefect.model.job import Job
from e31_prefect.model.job_values import Problem
from e31_prefect.model.shards import SHARDS_VARIABLE, ShardSettings

if TYPE_CHECKING:
    from e31_prefect.host.settings import E31Settings
    from e31_prefect.host.supervision import Supervisor

DEFAULT_PIDS_LIMIT = 4096


@dataclass(frozen=True)
class Placement:
    """One run's work as placed on this host: its job, workspace and ledger folder, and the devices it is
    started with (none where it loads before the rent and is handed them: :func:`hand_over_environment`)."""

    run_id: str
    job: Job
    devices: list[Device]
    workspace: Path
    folder: RunFolder
    configuration: Any  # the run's E31JobConfiguration: Prefect's environment and labels, the job's folder
    settings: E31Settings

    @property
    def data_dir(self) -> Path:
        """The staged inputs."""
        return self.workspace / "data"

    @property
    def output_dir(self) -> Path:
        """What the work writes and the worker sends."""
        return self.workspace / "output"

    def spec(self, runtime: str, **fields: Any) -> Spec:
        """The supervisor's spec for this run: its bounds, its API gateway, and what ``fields`` add."""
        from prefect.settings import get_current_settings

        api = get_current_settings().api
        return Spec(run_id=self.run_id, runtime=runtime,
                    api_upstream=str(api.url) if api.url else None,
                    api_key=_secret(api.key), api_auth_string=_secret(api.auth_string),
                    stop_at=None,  # the time limit counts from the hand-over
                    grace_seconds=self.settings.stop_grace_seconds,
                    report_grace_seconds=self.settings.report_grace_seconds,
                    memory_bytes=self.job.request.memory_bytes, pids_limit=DEFAULT_PIDS_LIMIT,
                    cgroups=self.settings.cgroups, accounting=str(self.settings.accounting),
                    host=self.settings.host_name, host_lost_seconds=self.settings.host_lost_seconds,
                    host_beat_file=str(self.settings.home.expanduser() / HOST_BEAT_FILE), **fields)


def _secret(value: Any) -> str | None:
    return value.get_secret_value() if value is not None else None


class Runtime(Protocol):
    """What a runtime does for a run; the supervisor does the rest."""

    name: str  # "process" or "container", as the ledger records it
    died: Ending  # how a run whose work died before reporting its state ends
    # Whether the work loads Prefect before its devices are rented (nothing of the job's in it until they are
    # handed over), or is started with them, after the rent, and billed from then (an image is the job's code).
    loads_before_rent: bool

    async def check(self) -> str | None:
        """Before renting: a reason this host cannot run the job (None: it can)."""

    def spec(self, placement: Placement) -> Spec:
        """What the supervisor runs."""

    async def start(self, placement: Placement, supervisor: Supervisor) -> None:
        """Once the supervisor runs: anything the work needs started for it (a container, named to it)."""

    def ended(self) -> None:
        """Once the work ended: anything to say of it (a container's ``exited`` event)."""



# Prefect settings a job never receives: the API's credentials, the server's own (its database URL),
# the API URL itself (the job's is its gateway's, set by its entry) and the worker's home and profiles
# (a job's Prefect keeps its own, in its workspace).
WITHHELD_PREFECT = ("PREFECT_API_KEY", "PREFECT_API_AUTH_STRING", "PREFECT_API_URL", "PREFECT_SERVER_",
                    "PREFECT_API_DATABASE", "PREFECT_API_SERVICES", "PREFECT_HOME", "PREFECT_PROFILES_PATH")


# What e31 itself sets for every run, after any environment a job variable gives: the rented devices, the
# job's dirs, its shards and its ends of the supervisor's pipe and gateway.
SET_FOR_THE_RUN = ("CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", DATA_DIR_VARIABLE,
                   OUTPUT_DIR_VARIABLE, SHARDS_VARIABLE, WORK_ENDED_VARIABLE, API_SOCKET_VARIABLE,
                   HAND_OVER_VARIABLE, REPORT_SECONDS_VARIABLE)


def env_problems(env: dict[str, Any]) -> list[Problem]:
    """Each variable of the ``env`` job variable that e31 would replace or withhold, refused by name:
    a setting is never quietly ignored."""
    problems = []
    for name, value in env.items():
        if name == "PREFECT_API_URL":
            fix = ("e31 sets it: a job reaches its own flow run's Prefect calls through its run's gateway, "
                   "with the worker's server and credentials; remove it")
        elif name.startswith(WITHHELD_PREFECT):
            if value is None:  # asked unset (as prefect-docker allows): e31 never passes it on anyway
                continue
            fix = ("a job never receives the worker's Prefect credentials, server settings or home; remove it "
                   "(a job's Prefect keeps its own home in its workspace)")
        elif name in SET_FOR_THE_RUN:
            fix = "e31 sets it for each run (its rented devices, dirs and supervisor); remove it"
        else:
            continue
        # A credential or database URL is not repeated in the run's state, where anyone may read it.
        shown = "<hidden>" if name.startswith(WITHHELD_PREFECT) and name != "PREFECT_API_URL" else value
        named = name if len(name) <= 80 else name[:77] + "..."  # a huge name does not swell the run's state
        problems.append(Problem(f"env.{named}", shown, fix))
    return problems


def prefect_environment(env: dict[str, str | None]) -> dict[str, str]:
    """Prefect's variables for the run (its flow run id, settings the worker passes on), without secrets."""
    return {k: v for k, v in env.items() if v is not None and not k.startswith(WITHHELD_PREFECT)}


def hand_over_environment(devices: Sequence[Device], report_seconds: float) -> dict[str, str]:
    """The variables a job's entry is handed with its devices, set before any of the job's code is imported:
    the devices, and how long its engine may take to report the flow's last state."""
    return {**visible_devices_env(devices), REPORT_SECONDS_VARIABLE: str(report_seconds)}


def job_environment(job: Job, devices: Sequence[Device], data_dir: PurePath | str, output_dir: PurePath | str,
                    shards_start: tuple[list[str], str] | None = None) -> dict[str, str]:
    """What every runtime adds for a job: its own variables, then its devices (none until the hand-over,
    where it starts before the rent) and dirs.

    The devices and dirs come last so a job cannot widen its own view of the host; the result
    settings come first so a job may choose its own result storage. ``shards_start``: the command and
    folder of a sharded command's shards, where its entry may start them before Prefect loads.
    """
    shards = ShardSettings.of(job, *(shards_start or ()))
    return {
        **result_environment(output_dir),
        **job.work.env,
        **visible_devices_env(devices),
        DATA_DIR_VARIABLE: str(data_dir),
        OUTPUT_DIR_VARIABLE: str(output_dir),
        # The command flow runs the shards; it learns how from here, so a deployment's job variables decide.
        **({SHARDS_VARIABLE: shards.to_text()} if shards else {}),
    }
