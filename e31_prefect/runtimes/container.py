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
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import docker.types

import docker
from e31_prefect import endings, job_entry
from e31_prefect.inventory import Device
from e31_prefect.job import Job
from e31_prefect.ledger import Spec
from e31_prefect.runtimes import DEFAULT_PIDS_LIMIT, WORK_ENDED_VARIABLE, Placement, job_environment

if TYPE_CHECKING:
    from prefect_docker.worker import DockerWorker, DockerWorkerJobConfiguration

    from e31_prefect.supervision import Supervisor

DATA_MOUNT = "/e31/data"
OUTPUT_MOUNT = "/e31/output"
ENTRY_MOUNT = "/e31/bin/job_entry.py"  # e31's job entry, mounted: any image with Prefect can run it
WORK_ENDED_MOUNT = "/e31/control/work-ended"
GpuRequests = Literal["auto", "on", "off"]

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
        **{k: v for k, v in base.items() if v is not None},
        **job_environment(job, devices, DATA_MOUNT, OUTPUT_MOUNT),
        WORK_ENDED_VARIABLE: WORK_ENDED_MOUNT,
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


def mounts(data_dir: Path, output_dir: Path, code: Path | None, work_ended: Path | None = None) -> list[str]:
    """Data read-only, output writable, the job's code read-only at its own path (its folder, or the
    project folder holding it and its flow), e31's job entry read-only, and the pipe the job says its
    work ended on."""
    volumes = [f"{data_dir}:{DATA_MOUNT}:ro", f"{output_dir}:{OUTPUT_MOUNT}:rw"]
    if code is not None:
        volumes.append(f"{code}:{code}:ro")
    volumes.append(f"{job_entry.__file__}:{ENTRY_MOUNT}:ro")
    if work_ended is not None:
        volumes.append(f"{work_ended}:{WORK_ENDED_MOUNT}:rw")
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
) -> DockerWorkerJobConfiguration:
    """A copy of the run's configuration that creates the E31 container for it.

    ``job_folder`` is its working directory; ``code`` (default: the job folder) is mounted read-only.
    """
    prepared = configuration.model_copy(deep=True)
    assert job.work.image
    prepared.image = job.work.image
    prepared.command = f"python {ENTRY_MOUNT}"
    prepared.env = container_environment(configuration.env, job, devices)
    prepared.volumes = mounts(data_dir, output_dir, code or job_folder, work_ended)
    prepared.privileged = False
    prepared.auto_remove = False  # the supervisor reads the exit state (OOM) before removing it
    memory = job.request.memory_bytes
    prepared.mem_limit = str(memory) if memory else None
    prepared.memswap_limit = str(memory) if memory else None  # no swap beyond the limit
    prepared.labels = {**configuration.labels, "e31.job": job.name}
    prepared.container_create_kwargs = {
        **isolation(job, devices, send_device_requests),
        **({"working_dir": str(job_folder)} if job_folder else {}),
    }
    return prepared


class ContainerRuntime:
    """A run as a container on this host's Docker engine, created through prefect-docker."""

    name = "container"
    died = endings.CONTAINER_DIED

    def __init__(self, worker: DockerWorker, configuration: Any):
        self.worker = worker
        self.configuration = configuration
        self.send_gpus = False

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
        label = f"prefect.io/flow-run-id={placement.run_id}"  # prefect-docker labels the run's container so
        return placement.spec(self.name, container_label=label)

    async def start(self, placement: Placement, supervisor: Supervisor) -> None:
        configuration = placement.configuration
        prepared = prepare(configuration, placement.job, placement.devices, placement.data_dir,
                           placement.output_dir, configuration._job_folder, self.send_gpus,
                           placement.folder.work_ended_pipe, configuration.code_mount())
        try:
            container, _ = await asyncio.to_thread(self.worker._create_and_start_container, prepared)
        except BaseException:
            await supervisor.name_container(None)
            raise
        await supervisor.name_container(container.id)
