"""The docker runtime: a flow run in its own container, created, watched and stopped by prefect-docker.

prefect-docker's worker (which the e31 worker extends) pulls the image, logs in
to registries, names and creates the container and emits its events. This
module adds what an E31 job needs: exactly its rented GPUs, its data read-only
at /e31/data, its output dir at /e31/output, no storage credentials, no
privileges, limits from the request, and a stop at its time limit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import docker.errors
import docker.types

import docker
from e31_prefect.inventory import Device
from e31_prefect.job import Job
from e31_prefect.runtimes import RunOutcome, job_environment

if TYPE_CHECKING:
    from prefect_docker.worker import DockerWorker, DockerWorkerJobConfiguration

DATA_MOUNT = "/e31/data"
OUTPUT_MOUNT = "/e31/output"
DEFAULT_PIDS_LIMIT = 4096
GpuRequests = Literal["auto", "on", "off"]


class NoContainerEngine(RuntimeError):
    """The job names an image but this host has no Docker engine that answers."""


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


def mounts(data_dir: Path, output_dir: Path, job_folder: Path | None) -> list[str]:
    """Data read-only, output writable, and the job file's folder read-only at its own path (for its flow code)."""
    volumes = [f"{data_dir}:{DATA_MOUNT}:ro", f"{output_dir}:{OUTPUT_MOUNT}:rw"]
    if job_folder is not None:
        volumes.append(f"{job_folder}:{job_folder}:ro")
    return volumes


def prepare(
    configuration: DockerWorkerJobConfiguration,
    job: Job,
    devices: Sequence[Device],
    data_dir: Path,
    output_dir: Path,
    job_folder: Path | None,
    send_device_requests: bool,
) -> DockerWorkerJobConfiguration:
    """A copy of the run's configuration that creates the E31 container for it."""
    prepared = configuration.model_copy(deep=True)
    assert job.work.image
    prepared.image = job.work.image
    prepared.command = "python -m prefect.engine"
    prepared.env = container_environment(configuration.env, job, devices)
    prepared.volumes = mounts(data_dir, output_dir, job_folder)
    prepared.privileged = False
    prepared.auto_remove = False  # the worker reads the exit state (OOM) before removing it
    memory = job.request.memory_bytes
    prepared.mem_limit = str(memory) if memory else None
    prepared.memswap_limit = str(memory) if memory else None  # no swap beyond the limit
    prepared.labels = {**configuration.labels, "e31.job": job.name}
    prepared.container_create_kwargs = {
        **isolation(job, devices, send_device_requests),
        **({"working_dir": str(job_folder)} if job_folder else {}),
    }
    return prepared


async def run_container(
    worker: DockerWorker,
    configuration: DockerWorkerJobConfiguration,
    *,
    time_limit: float | None,
    grace_seconds: float,
    stop: asyncio.Event,
    on_started: Callable[[str], None],
) -> RunOutcome:
    """Create and start the container, watch it to its end, stop it at the limit or when asked, remove it."""
    container, created_event = await asyncio.to_thread(worker._create_and_start_container, configuration)
    on_started(container.id)
    watch = asyncio.ensure_future(
        asyncio.to_thread(worker._watch_container_safe, container, configuration, created_event))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({watch, stopped}, timeout=time_limit, return_when=asyncio.FIRST_COMPLETED)
        timed_out = not watch.done() and not stopped.done()
        if not watch.done():
            await asyncio.to_thread(_stop, worker, container.id, grace_seconds)
        await watch
        state = await asyncio.to_thread(_final_state, container)
    except BaseException:
        await asyncio.shield(asyncio.to_thread(_stop, worker, container.id, grace_seconds))
        raise
    finally:
        stopped.cancel()
        await asyncio.shield(asyncio.to_thread(_remove, container))
    return RunOutcome(
        exit_code=int(state.get("ExitCode", -1)),
        timed_out=timed_out,
        stopped=stop.is_set() and not timed_out,
        out_of_memory=bool(state.get("OOMKilled")),
    )


def _stop(worker: DockerWorker, container_id: str, grace_seconds: float) -> None:
    from prefect.exceptions import InfrastructureNotFound

    with contextlib.suppress(InfrastructureNotFound):
        worker._stop_container(container_id, max(1, round(grace_seconds)))


def _final_state(container) -> dict[str, Any]:
    with contextlib.suppress(docker.errors.NotFound):
        container.reload()
    return container.attrs.get("State") or {}


def _remove(container) -> None:
    with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
        container.remove(force=True)
