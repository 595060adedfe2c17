"""The docker runtime: a flow run in its own container, created by prefect-docker, owned by its supervisor.

prefect-docker's worker (which the e31 worker extends) pulls the image, logs in
to registries, names, creates and starts the container and emits its events.
This module adds what an E31 job needs: exactly its rented GPUs, its data
read-only at /e31/data, its output dir at /e31/output, no storage credentials,
no privileges, limits from the request. The run's supervisor watches the
container, stops it at its time limit and removes it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

import docker.types

import docker
from e31_prefect import job_entry
from e31_prefect.host.inventory import Device
from e31_prefect.host.ledger import Spec
from e31_prefect.model import endings
from e31_prefect.model.job import Job
from e31_prefect.model.job_values import Problem
from e31_prefect.runtimes import (
    API_SOCKET_VARIABLE,
    DEFAULT_PIDS_LIMIT,
    HAND_OVER_VARIABLE,
    WORK_ENDED_VARIABLE,
    Placement,
    env_problems,
    job_environment,
    prefect_environment,
)

if TYPE_CHECKING:
    from prefect_docker.worker import DockerWorker, DockerWorkerJobConfiguration

    from e31_prefect.host.supervision import Supervisor

DATA_MOUNT = "/e31/data"
OUTPUT_MOUNT = "/e31/output"
ENTRY_MOUNT = "/e31/bin/job_entry.py"  # e31's job entry, mounted: any image with Prefect can run it
WORK_ENDED_MOUNT = "/e31/control/work-ended"
HAND_OVER_MOUNT = "/e31/control/hand-over"
API_SOCKET_MOUNT = "/e31/control/api.sock"
# The job's entry sets its own loopback URL for the gateway; a placeholder that is not a loopback
# address keeps prefect-docker from adding a host-gateway entry a container with no network cannot use.
GATEWAY_PLACEHOLDER_URL = "http://e31-gateway.invalid/api"
GpuRequests = Literal["auto", "on", "off"]

# prefect-docker's job variables as they work on an e31 pool: the pool's form shows these words.
DOCKER_SETTINGS = {
    "image": "The job's container image, as in prefect-docker: the same as work.image, which is the image where "
             "both are given. A job with neither runs as a local process.",
    "registry_credentials": "A DockerRegistryCredentials block: the worker logs in with it to pull a job's image.",
    "image_pull_policy": "For jobs with an image: when the worker pulls it (IfNotPresent for tagged images).",
    "networks": "Docker networks job containers join (instead of the network mode); not host.",
    "network_mode": "Network mode of job containers (default none: a job reaches only its own flow run's "
                    "Prefect calls, through its gateway). Given one, a job reaches what that network does; "
                    "host and container:NAME are refused (the host's or another container's network).",
    "volumes": "Host folders mounted read-only into job containers (SOURCE:TARGET); each must lie under a folder "
               "the host allows (E31_ALLOWED_VOLUMES). Others are refused.",
    "stream_output": "Copy a job container's output into the run's output log (and `e31 run`'s console).",
    "container_create_kwargs": "docker-py create options passed on: shm_size, ipc_mode (private, shareable, "
                               "none), ulimits, tmpfs. Others are refused: they would widen a job's view of the host.",
    "mem_limit": "Refused: a job's memory limit is its request.memory (no swap).",
    "memswap_limit": "Refused: a job's memory limit is its request.memory (no swap).",
    "privileged": "Refused: job containers never run privileged.",
    "auto_remove": "Refused: e31 removes every job container itself, once it has read how it ended.",
}
CREATE_OPTIONS = ("shm_size", "ipc_mode", "ulimits", "tmpfs")  # widen nothing the job should not see
IPC_MODES = ("private", "shareable", "none")
# How prefect-docker labels a run's container (Prefect's prefect.io/flow-run-id, in Docker's reversed form).
RUN_LABEL = "io.prefect.flow-run-id"
OWN_LABELS = ("prefect.io/", "io.prefect.", "e31.")  # the labels Prefect, prefect-docker and e31 set
NETWORK_FIX = ("would put the job on the host's network or another container's (the host's loopback services, "
               "the Prefect API around the run's gateway); a job reaches its own flow run's Prefect calls "
               "through its gateway with no network: for more, give a Docker network (networks: [NAME] or "
               "network_mode: bridge)")

def setting_problems(settings: dict[str, Any], allowed_volumes: Sequence[Path]) -> list[Problem]:
    """Each prefect-docker setting of a run that an e31 pool refuses: its name, value, and the e31 way instead.

    ``settings``: the run's values, those left at prefect-docker's defaults included (``command``, ``env``
    and ``labels`` as the deployment or run gave them, before Prefect fills in its own).
    """
    problems = []
    refused = {
        "command": (None, "e31 runs Prefect's engine itself; give the job's work as work.flow or work.command"),
        "mem_limit": (None, "use request.memory (a limit with no swap)"),
        "memswap_limit": (None, "use request.memory (a limit with no swap)"),
        "privileged": (False, "job containers never run privileged"),
        "auto_remove": (False, "e31 removes every job container itself once it has read how it ended"),
    }
    for name, (default, fix) in refused.items():
        if settings.get(name, default) not in (default, None, ""):
            problems.append(Problem(name, settings[name], f"is not an e31 setting: {fix}"))
    for option, value in (settings.get("container_create_kwargs") or {}).items():
        if option not in CREATE_OPTIONS:
            problems.append(Problem(f"container_create_kwargs.{option}", value,
                                    "would widen a job container's view of the host; e31 passes on only "
                                    + ", ".join(CREATE_OPTIONS)))
        elif option == "ipc_mode" and value not in IPC_MODES:
            problems.append(Problem("container_create_kwargs.ipc_mode", value,
                                    "would share another's memory; use one of " + ", ".join(IPC_MODES)))
    mode = settings.get("network_mode")
    if isinstance(mode, str) and (mode == "host" or mode.startswith("container:")):
        problems.append(Problem("network_mode", mode, NETWORK_FIX))
    problems += [Problem("networks", name, NETWORK_FIX) for name in settings.get("networks") or () if name == "host"]
    problems += env_problems(settings.get("env") or {})
    problems += [Problem(f"labels.{key}", value, "Prefect and e31 label a run's container themselves (e31 finds, "
                         "stops and removes a run's container by its run label); use a label of your own namespace")
                 for key, value in (settings.get("labels") or {}).items() if str(key).startswith(OWN_LABELS)]
    for volume in settings.get("volumes") or []:
        if read_only_volume(volume, allowed_volumes) is None:
            allowed = ", ".join(map(str, allowed_volumes)) or "none on this host"
            problems.append(Problem("volumes", volume, f"mounts a host path the host's operator did not allow "
                                    f"(E31_ALLOWED_VOLUMES: {allowed}); stage it as the job's data instead"))
    return problems


def read_only_volume(volume: str, allowed: Sequence[Path]) -> str | None:
    """``SOURCE:TARGET[:MODE]`` as mounted for a job (read-only), or None when its source is not under an
    allowed folder (a named volume, a relative path, a symlink out of one)."""
    source, _, rest = volume.partition(":")
    target = rest.split(":", 1)[0]
    if not source.startswith("/") or not target.startswith("/"):
        return None
    real = Path(source).resolve()
    if not any(real == root.resolve() or root.resolve() in real.parents for root in allowed):
        return None
    return f"{real}:{target}:ro"


def engine_runs_gpus(client: docker.DockerClient) -> bool:
    """Whether the engine has a GPU-capable runtime (the NVIDIA container runtime) to honour device requests."""
    return "nvidia" in (client.info().get("Runtimes") or {})


def device_requests(devices: Sequence[Device], send: bool) -> list[docker.types.DeviceRequest]:
    """A device request for exactly the rented GPUs, or none (no GPUs, or an engine that cannot honour one)."""
    if not devices or not send:
        return []
    return [docker.types.DeviceRequest(device_ids=[str(d.index) for d in devices], capabilities=[["gpu"]])]


def container_environment(base: dict[str, str | None], job: Job, devices: Sequence[Device]) -> dict[str, str]:
    """Prefect's environment for the run, the job's own, its devices and its dirs; nothing of the host's."""
    return {
        **prefect_environment(base),
        "PREFECT_API_URL": GATEWAY_PLACEHOLDER_URL,
        **job_environment(job, devices, DATA_MOUNT, OUTPUT_MOUNT),
        WORK_ENDED_VARIABLE: WORK_ENDED_MOUNT,
        HAND_OVER_VARIABLE: HAND_OVER_MOUNT,
        API_SOCKET_VARIABLE: API_SOCKET_MOUNT,
    }


def isolation(job: Job, devices: Sequence[Device], send_device_requests: bool,
              pids_limit: int = DEFAULT_PIDS_LIMIT) -> dict[str, Any]:
    """Container options that hold the run to its request: no privileges, no capabilities, limits, GPUs."""
    options: dict[str, Any] = {
        "security_opt": ["no-new-privileges"],
        "cap_drop": ["ALL"],
        "pids_limit": pids_limit,
    }
    if job.request.cpus:
        options["nano_cpus"] = int(job.request.cpus * 1e9)
    requests = device_requests(devices, send_device_requests)
    if requests:
        options["device_requests"] = requests
    return options


def mounts(data_dir: Path, output_dir: Path, code: Path | None, work_ended: Path | None = None,
           api_socket: Path | None = None, hand_over: Path | None = None) -> list[str]:
    """Data read-only, output writable, the job's code read-only at its own path (its folder, or the
    project folder holding it and its flow), e31's job entry read-only, the pipe the job says its
    work ended on (and its ready), the pipe it is handed its devices on, and its gateway to the
    Prefect API."""
    volumes = [f"{data_dir}:{DATA_MOUNT}:ro", f"{output_dir}:{OUTPUT_MOUNT}:rw"]
    if code is not None:
        volumes.append(f"{code}:{code}:ro")
    volumes.append(f"{job_entry.__file__}:{ENTRY_MOUNT}:ro")
    if work_ended is not None:
        volumes.append(f"{work_ended}:{WORK_ENDED_MOUNT}:rw")
    if hand_over is not None:
        volumes.append(f"{hand_over}:{HAND_OVER_MOUNT}:ro")
    if api_socket is not None:
        volumes.append(f"{api_socket}:{API_SOCKET_MOUNT}:rw")
    return volumes


def prepare(
    configuration: DockerWorkerJobConfiguration,
    job: Job,
    devices: Sequence[Device],
    data_dir: Path,
    output_dir: Path,
    job_folder: Path | None,
    send_device_requests: bool,
    work_ended: Path | None = None,
    code: Path | None = None,
    allowed_volumes: Sequence[Path] = (),
    api_socket: Path | None = None,
    user: str = "",
    hand_over: Path | None = None,
) -> DockerWorkerJobConfiguration:
    """A copy of the run's configuration that creates the E31 container for it.

    ``job_folder`` is its working directory; ``code`` (default: the job folder) is mounted read-only.
    """
    prepared = configuration.model_copy(deep=True)
    assert job.work.image
    prepared.image = job.work.image
    prepared.command = f"python {ENTRY_MOUNT}"
    prepared.env = container_environment(configuration.env, job, devices)
    extra = [read_only_volume(volume, allowed_volumes) for volume in configuration.volumes]
    prepared.volumes = mounts(data_dir, output_dir, code or job_folder, work_ended, api_socket, hand_over) + [
        v for v in extra if v]
    # The job reaches Prefect through its gateway's socket; no network unless the pool's operator gave one.
    if not configuration.network_mode and not configuration.networks:
        prepared.network_mode = "none"
    prepared.privileged = False
    prepared.auto_remove = False  # the supervisor reads the exit state (OOM) before removing it
    memory = job.request.memory_bytes
    prepared.mem_limit = str(memory) if memory else None
    prepared.memswap_limit = str(memory) if memory else None  # no swap beyond the limit
    prepared.labels = {**configuration.labels, "e31.job": job.name}
    passed_on = {k: v for k, v in (configuration.container_create_kwargs or {}).items() if k in CREATE_OPTIONS}
    if user:  # a user with no account in the image has no home: Prefect keeps its files in /tmp
        prepared.env = {"HOME": "/tmp", "PREFECT_HOME": "/tmp/.prefect", **prepared.env}
    prepared.container_create_kwargs = {
        **passed_on,
        **({"user": user} if user else {}),
        **isolation(job, devices, send_device_requests),
        **({"working_dir": str(job_folder)} if job_folder else {}),
    }
    return prepared


def give_output_dir(output_dir: Path, user: str) -> None:
    """Make the run's output dir writable by the container's user (its own, where the worker is root)."""
    if not user:
        return
    if os.geteuid() == 0:
        uid, _, gid = user.partition(":")
        os.chown(output_dir, int(uid), int(gid or uid))
    else:  # the worker's own folder: only it and the container reach it
        output_dir.chmod(0o777)


class ContainerEvents:
    """prefect-docker's ``prefect.docker.container.<status>`` events of one container: created, then each
    new status, each following the last. prefect-docker's own code emits them, so their resource (the
    container) and related resources (flow run, deployment, flow, work pool, worker) are DockerWorker's."""

    def __init__(self, worker: DockerWorker, configuration: Any, container: Any, created: Any):
        self.worker = worker
        self.configuration = configuration
        self.id, self.name = container.id, container.name
        self.seen = {container.status}
        self.last = created

    def status(self, status: str) -> None:
        """Emit the container's ``status`` (running, exited ...) the first time it is seen."""
        if status in self.seen:
            return
        self.seen.add(status)
        # The supervisor may have removed the container by now: the event needs only its id, name and status.
        snapshot = SimpleNamespace(id=self.id, name=self.name, status=status)
        self.last = self.worker._emit_container_status_change_event(snapshot, self.configuration,
                                                                    last_event=self.last)


class ContainerRuntime:
    """A run as a container on this host's Docker engine, created through prefect-docker once its devices
    are rented.

    The image is the job's code (its entrypoint, its Python and what that Python loads as it starts), so a
    container is never started before its rent: it is created with its devices, loads Prefect, waits at the
    same gate as a process and is billed from the rent.
    """

    name = "container"
    died = endings.CONTAINER_DIED
    loads_before_rent = False

    def __init__(self, worker: DockerWorker, configuration: Any):
        self.worker = worker
        self.configuration = configuration
        self.send_gpus = False
        self.events: ContainerEvents | None = None

    async def check(self) -> str | None:
        try:
            self.send_gpus = await asyncio.to_thread(self._engine_takes_device_requests)
        except Exception as exc:
            return f"this host's Docker engine does not answer ({exc})"
        return None

    def _engine_takes_device_requests(self) -> bool:
        """Reach the Docker engine (raises if none answers); say whether to send GPU device requests."""
        client = self.worker._get_client()
        try:
            client.ping()
            choice = self.configuration.gpu_device_requests
            return choice == "on" or (choice == "auto" and engine_runs_gpus(client))
        finally:
            client.close()

    def spec(self, placement: Placement) -> Spec:
        label = f"{RUN_LABEL}={placement.run_id}"  # prefect-docker labels the run's container so
        return placement.spec(self.name, container_label=label,
                              container_logs=bool(placement.configuration.stream_output))

    async def start(self, placement: Placement, supervisor: Supervisor) -> None:
        configuration = placement.configuration
        try:
            prepared = prepare(configuration, placement.job, placement.devices, placement.data_dir,
                               placement.output_dir, configuration._job_folder, self.send_gpus,
                               placement.folder.work_ended_pipe, configuration.code_mount(),
                               placement.settings.allowed_volumes, placement.folder.api_socket,
                               placement.settings.container_user, placement.folder.hand_over_pipe)
            give_output_dir(placement.output_dir, placement.settings.container_user)
            container, created = await asyncio.to_thread(self.worker._create_and_start_container, prepared)
        except BaseException:
            supervisor.name_container(None)
            raise
        supervisor.name_container(container.id)
        self.events = ContainerEvents(self.worker, prepared, container, created)
        try:
            await asyncio.to_thread(container.reload)
        except Exception:  # gone already (the supervisor removes it once it exits): ended() says so
            return
        self.events.status(container.status)

    def ended(self) -> None:
        """The work ended (the supervisor saw the container exit, and removed it): its ``exited`` event."""
        if self.events is not None:
            self.events.status("exited")
