"""The e31 worker: rents GPUs for each flow run, runs it unattended, returns its outputs, meters it.

    prefect work-pool create gpu --type e31
    E31_GPUS="2xH100" prefect worker start --pool gpu --type e31

For each flow run of its pool the worker lives the job's life: refuse it if
its deadline can no longer be met, stage its data (no GPU held yet), rent
devices, run it with only those devices visible, give the devices back the
moment it ends, send its outputs, and close the meter. A job with an image
runs in a container (the worker extends prefect-docker's DockerWorker); one
without runs as a local process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal
from uuid import UUID

import anyio
import anyio.abc
from prefect.client.schemas.objects import FlowRun
from prefect.context import TagsContext
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL
from prefect.states import Cancelled, Crashed, Pending, Scheduled
from prefect.workers.base import BaseVariables, BaseWorkerResult
from prefect_docker.worker import DockerWorker, DockerWorkerJobConfiguration
from pydantic import Field, PrivateAttr

from e31_prefect import quotas, reporting, results, timing
from e31_prefect import spool as spooling
from e31_prefect.blocks import E31Storage, StorageBlockError, load_storage
from e31_prefect.inventory import Device, Inventory, discover, pick_devices
from e31_prefect.job import JOB_VARIABLE_KEYS, DataInput, Job, JobError, Output, Request, Work, anchor, job_name
from e31_prefect.ledger import Holding, Ledger, this_process
from e31_prefect.meter import Meter
from e31_prefect.recovery import recover
from e31_prefect.runtimes import RunOutcome, job_environment
from e31_prefect.runtimes import container as containers
from e31_prefect.runtimes.process import run_process
from e31_prefect.scheduling import Busy, WaitingQueue, WaitingRun, decide
from e31_prefect.settings import E31Settings
from e31_prefect.staging import (
    StagingError,
    UploadError,
    missing_outputs,
    remove_workspace,
    stage_inputs,
    upload_outputs,
)

if TYPE_CHECKING:
    from prefect.client.schemas.objects import Flow as APIFlow
    from prefect.client.schemas.objects import WorkPool
    from prefect.client.schemas.responses import DeploymentResponse, WorkerFlowRunResponse

# Environment a job never inherits from its worker: storage credentials and the worker's own settings.
_WITHHELD_PREFIXES = ("AWS_", "AZURE_", "GOOGLE_APPLICATION_CREDENTIALS", "E31_")


class E31Variables(BaseVariables):
    """The e31 work pool's form: the job's team, work, data, request and output."""

    team: str | None = Field(default=None, title="Team", description="Who pays: used by the meter.",
                             examples=["vision"])
    timezone: str | None = Field(default=None, title="Time zone",
                                 description="IANA zone for HH:MM starts and deadlines.",
                                 examples=["Europe/Paris"])
    work: Work | None = Field(default=None, title="Work", description="Parameters, environment and image.")
    data: list[DataInput] | None = Field(default=None, title="Data",
                                         description="Inputs staged read-only before any GPU is rented.")
    request: Request | None = Field(default=None, title="Request",
                                    description="GPUs, time limit, earliest start, deadline, priority.")
    output: Output | None = Field(default=None, title="Output",
                                  description="Where the output dir is sent and what it must hold.")
    storage: str | None = Field(default=None, title="Storage block",
                                description="The E31 Storage block whose credentials read the data and send the "
                                "outputs; empty: s3fs's default credential chain on the worker.",
                                examples=["e31-store"])
    image_pull_policy: Literal["IfNotPresent", "Always", "IfPossible", "Never"] | None = Field(
        default=None, title="Image pull policy",
        description="For jobs with an image: when the worker pulls it (IfNotPresent for tagged images).",
        examples=["IfNotPresent"])
    network_mode: str | None = Field(
        default=None, title="Container network",
        description="Network mode of job containers; host when the Prefect API is on this host's loopback.",
        examples=["host"])
    gpu_device_requests: containers.GpuRequests = Field(
        default="auto", title="GPU device requests",
        description="Send containers a device request for their GPUs: auto (when the engine has the NVIDIA "
        "runtime), on or off. The visible-devices variables are always set.",
        examples=["auto"])


class E31JobConfiguration(DockerWorkerJobConfiguration):
    """One flow run's job as the worker receives it: raw job variables, validated in :meth:`job`."""

    team: str | None = Field(default=None)
    timezone: str | None = Field(default=None)
    work: dict[str, Any] | None = Field(default=None)
    data: list[Any] | None = Field(default=None)
    request: dict[str, Any] | None = Field(default=None)
    output: dict[str, Any] | None = Field(default=None)
    storage: str | None = Field(default=None)
    gpu_device_requests: containers.GpuRequests = Field(default="auto")

    _job_name: str = PrivateAttr(default="job")
    _job_folder: Path | None = PrivateAttr(default=None)
    _code_folder: Path | None = PrivateAttr(default=None)

    @classmethod
    def json_template(cls) -> dict[str, Any]:
        """Template only what the pool's form offers; the rest of a container is the worker's to set."""
        return {k: v for k, v in super().json_template().items() if k in E31Variables.model_fields}

    def prepare_for_flow_run(
        self,
        flow_run: FlowRun,
        deployment: DeploymentResponse | None = None,
        flow: APIFlow | None = None,
        work_pool: WorkPool | None = None,
        worker_name: str | None = None,
        worker_id: UUID | None = None,
    ) -> None:
        """Stamp Prefect's environment and labels; the job is named after its deployment."""
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id=worker_id)
        self._job_name = deployment.name if deployment else flow_run.name
        self._job_folder = job_folder(deployment)
        self._code_folder = code_folder(deployment)
        entrypoint = (self.work or {}).get("flow")
        if deployment is None and entrypoint:
            # A run with no deployment (an @e31 flow) names its source file: the flow is loaded
            # from there, and the file's folder is its code (mounted read-only in a container).
            folder = Path(entrypoint.rsplit(":", 1)[0]).parent
            self.env["PREFECT__FLOW_ENTRYPOINT"] = entrypoint
            self._job_folder = self._code_folder = folder if folder.is_dir() else None
            if flow is not None:
                self._job_name = job_name(flow.name)

    def job(self, name: str | None = None) -> Job:
        """The validated job; raises :class:`JobError` naming each bad field.

        Relative local paths (as a hand-written deployment may give) are read from the deployment's folder.
        """
        job = Job.from_job_variables({k: getattr(self, k) for k in JOB_VARIABLE_KEYS}, name=name or self._job_name)
        return anchor(job, self._code_folder) if self._code_folder else job


def code_folder(deployment: DeploymentResponse | None) -> Path | None:
    """Where a deployment's code lives on this host: the folder its pull step moves into (``prefect deploy``
    of local code writes a ``set_working_directory`` step, as e31 does), else its path.

    The pull step first: it is where the flow really runs, and ``prefect deploy`` over a deployment
    that e31 made keeps the old ``path``.
    """
    if deployment is None:
        return None
    folders = [step["prefect.deployments.steps.set_working_directory"].get("directory")
               for step in deployment.pull_steps or [] if "prefect.deployments.steps.set_working_directory" in step]
    folders += [deployment.path] if deployment.path else []
    return next((Path(folder) for folder in folders if folder and Path(folder).is_dir()), None)


def job_folder(deployment: DeploymentResponse | None) -> Path | None:
    """The job file's folder on this host, for a deployment made from a job file (its code lives there)."""
    if deployment is None or not deployment.path:
        return None
    steps = deployment.pull_steps or []
    made_by_e31 = steps == [{"prefect.deployments.steps.set_working_directory": {"directory": deployment.path}}]
    folder = Path(deployment.path)
    return folder if made_by_e31 and folder.is_dir() else None


class E31WorkerResult(BaseWorkerResult):
    """How a flow run's infrastructure ended."""


class E31Worker(DockerWorker):
    """Runs E31 jobs on this host's GPUs: stage, rent, run, output, release, metered."""

    type = "e31"
    job_configuration = E31JobConfiguration
    job_configuration_variables = E31Variables
    _description = "Run E31 GPU jobs: stage data, rent GPUs, run unattended, return outputs, meter the rent."
    _display_name = "E31"
    _documentation_url = "https://github.com/e31-network/e31-prefect"

    def __init__(self, *args: Any, settings: E31Settings | None = None,
                 only_flow_run_ids: set[UUID] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.settings = settings or E31Settings()
        self.inventory = Inventory(discover(self.settings.gpus))
        self.meters: dict[UUID, Meter] = {}  # the meters of runs in progress (and, for `e31 run`, its own)
        self.ledger = Ledger(self.settings.home.expanduser() / "ledger")
        self._living: set[UUID] = set()
        # When each run holding devices here must have let them go (its time limit), for backfill.
        self.holds_until: dict[UUID, datetime] = {}
        # The pool's waiting runs in order of urgency, kept across polls so a decision never sorts.
        self.queue = WaitingQueue()
        # `e31 run` drives a worker for its own run only; `prefect worker start` takes the whole pool.
        self._only_flow_run_ids = only_flow_run_ids

    async def setup(self) -> None:
        """Connect, register the E31 Storage block type (so the UI offers it), then clean up after
        any e31 worker on this host that was killed."""
        await super().setup()
        try:
            await E31Storage.aregister_type_and_schema(client=self.client)
        except Exception as exc:  # the worker runs jobs without it; only the UI's block catalog misses it
            self._logger.warning("Could not register the E31 Storage block type: %s", exc)
        recovered = await recover(self.client, self.ledger, self.settings.spool)
        if recovered:
            self._logger.warning("Recovered %d run(s) left by a dead worker: %s", len(recovered),
                                 ", ".join(map(str, recovered)))

    # -- choosing runs ----------------------------------------------------------------------------

    async def get_and_submit_flow_runs(self) -> list[FlowRun]:
        """Poll the pool; refuse missed deadlines; take the most urgent runs that fit free devices."""
        if not self._has_successfully_synced:
            return await super().get_and_submit_flow_runs()
        responses = await self._get_scheduled_flow_runs()
        self._last_polled_time = datetime.now(timezone.utc)
        responses = [r for r in responses if r.flow_run.id not in self._submitting_flow_run_ids
                     and (self._only_flow_run_ids is None or r.flow_run.id in self._only_flow_run_ids)]
        if not responses:
            return []
        by_id = {r.flow_run.id: r for r in responses}
        waiting = await self._waiting_runs([r.flow_run for r in responses])
        now = datetime.now(timezone.utc)
        busy = [Busy(device, self.holds_until.get(holder))
                for device, holder in self.inventory.holders().items()]
        self.queue.sync(run for run, _, _ in waiting.values())
        decision = decide(self.queue, self.inventory.free(), now, busy)
        for run in decision.missed:
            await self._refuse_missed(by_id[run.id].flow_run, *waiting[run.id][1:], run.latest_start, now)
        chosen: list[WorkerFlowRunResponse] = []
        for run, devices in decision.start:
            if self.inventory.hold(run.id, devices):
                chosen.append(by_id[run.id])
                if run.duration is not None:
                    self.holds_until[run.id] = now + run.duration
        return await self._submit_scheduled_flow_runs(flow_run_response=chosen)

    async def _waiting_runs(self, flow_runs: list[FlowRun]) -> dict[UUID, tuple[WaitingRun, str, str | None]]:
        """Each scheduled run as the scheduler sees it, with its job's name and team."""
        deployments: dict[UUID, DeploymentResponse | None] = {}
        waiting = {}
        for flow_run in flow_runs:
            if flow_run.deployment_id and flow_run.deployment_id not in deployments:
                try:
                    deployments[flow_run.deployment_id] = await self.client.read_deployment(flow_run.deployment_id)
                except ObjectNotFound:
                    deployments[flow_run.deployment_id] = None
            deployment = deployments.get(flow_run.deployment_id) if flow_run.deployment_id else None
            name = deployment.name if deployment else flow_run.name
            run, team = await self._waiting_run(flow_run, deployment, name)
            waiting[flow_run.id] = (run, name, team)
        return waiting

    async def _waiting_run(self, flow_run: FlowRun, deployment: DeploymentResponse | None,
                           name: str) -> tuple[WaitingRun, str | None]:
        scheduled = scheduled_start(flow_run)
        values = {**(deployment.job_variables if deployment else {}), **(flow_run.job_variables or {})}
        try:
            configuration = await self.job_configuration.from_template_and_values(
                self.work_pool.base_job_template, values, client=self.client)
            job = configuration.job(name)
        except ValueError:
            # An invalid job (JobError, or job variables of the wrong shape) is taken at once,
            # on no device, so that its run fails with the reason.
            return WaitingRun(flow_run.id, 0, None, scheduled), None
        deadline = timing.resolve_deadline(job.request.deadline, scheduled, job.tz)
        return WaitingRun(
            id=flow_run.id,
            gpus=job.request.gpus,
            gpu_type=job.request.gpu_type,
            scheduled=scheduled,
            latest_start=timing.latest_start(deadline, job.request.admission_duration),
            priority=job.request.priority,
            duration=job.request.time_limit or job.request.expected_duration,
        ), job.team

    async def _refuse_missed(self, flow_run: FlowRun, job_name: str, team: str | None, latest: datetime | None,
                             now: datetime) -> None:
        report = reporting.JobReport(self.client, flow_run, [])
        message = (f"Deadline missed: the run had to start by {latest.isoformat() if latest else '?'} "
                   f"to finish in time; it is now {now.isoformat(timespec='seconds')}. No GPU was rented.")
        report.step("deadline-missed", latest_start=str(latest), now=now.isoformat())
        await report.fail(reporting.DEADLINE_MISSED, message)
        meter = Meter(team=team)
        meter.mark("submitted", scheduled_start(flow_run))
        meter.mark("released", now)
        await report.close(meter, job_name, "deadline-missed", None)
        self.get_flow_run_logger(flow_run).warning(message)

    @property
    def busy(self) -> bool:
        """Whether a run is being submitted or lived on this worker now."""
        return bool(self._submitting_flow_run_ids or self._living)

    def _release_limit_slot(self, flow_run_id: UUID) -> None:
        # Called by Prefect whenever a run stops occupying this worker, including a submission
        # another worker won: the devices reserved for it go back too.
        self.return_devices(flow_run_id)
        super()._release_limit_slot(flow_run_id)

    def return_devices(self, flow_run_id: UUID) -> None:
        """The run's devices go back to this host's pool (idempotent)."""
        self.inventory.give_back(flow_run_id)
        self.holds_until.pop(flow_run_id, None)

    async def _submit_adhoc_run(self, flow: Any, parameters: dict[str, Any] | None = None,
                                job_variables: dict[str, Any] | None = None,
                                task_status: anyio.abc.TaskStatus[FlowRun] | None = None,
                                flow_run: FlowRun | None = None) -> None:
        """Live an ``@e31`` flow's job here, from its source file (named in its job variables).

        Prefect's own ad hoc path uploads a bundle to the pool's storage; an E31 job's code is
        on this host already, so the run is created and lived like any other.
        """
        if flow_run is None:
            flow_run = await self.client.create_flow_run(
                flow, parameters=flow.serialize_parameters(parameters or {}), state=Pending(),
                job_variables=job_variables, work_pool_name=self.work_pool.name,
                tags=sorted(TagsContext.get().current_tags | {"e31"}))  # with the caller's `tags(...)`
        if task_status is not None:
            task_status.started(flow_run)
        configuration = await self.job_configuration.from_template_and_values(
            self.work_pool.base_job_template, job_variables or {}, client=self.client)
        configuration.prepare_for_flow_run(
            flow_run=flow_run, flow=SimpleNamespace(id=flow_run.flow_id, name=flow.name, labels={}),
            work_pool=self.work_pool, worker_name=self.name, worker_id=self.backend_id)
        await self.run(flow_run, configuration)

    # -- living one job ---------------------------------------------------------------------------

    async def run(
        self,
        flow_run: FlowRun,
        configuration: E31JobConfiguration,
        task_status: anyio.abc.TaskStatus[int] | None = None,
    ) -> E31WorkerResult:
        """Live one job: refuse, stage, rent, run, output, release; the meter closes whatever happens."""
        life = JobLife(self, flow_run, configuration, task_status or anyio.TASK_STATUS_IGNORED)
        self._living.add(flow_run.id)
        try:
            exit_code = await life.live()
        finally:
            self._living.discard(flow_run.id)
        return E31WorkerResult(status_code=exit_code, identifier=str(life.pid or 0))


def scheduled_start(flow_run: FlowRun) -> datetime:
    """When Prefect scheduled the run to start (its creation time if it has none)."""
    moment = flow_run.expected_start_time or flow_run.next_scheduled_start_time or flow_run.created
    return timing.utc(moment) if moment else datetime.now(timezone.utc)


class JobLife:
    """The life of one job on this host, from taking the run to closing its meter."""

    def __init__(self, worker: E31Worker, flow_run: FlowRun, configuration: E31JobConfiguration,
                 task_status: anyio.abc.TaskStatus[Any]):
        self.worker = worker
        self.flow_run = flow_run
        self.configuration = configuration
        self.task_status = task_status
        self.log = worker.get_flow_run_logger(flow_run)
        self.report = reporting.JobReport(
            worker.client, flow_run, worker._event_related_resources(configuration=configuration))
        self.meter = worker.meters.setdefault(flow_run.id, Meter())
        self.workspace = worker.settings.workspaces / str(flow_run.id)
        self.pid: int | str | None = None
        self.devices: list[Device] = []
        self.outcome: str | None = None
        self.outputs: str | None = None
        self.job_name = configuration._job_name
        self.holding: Holding | None = None
        self.lease: UUID | None = None
        self.storage: E31Storage | None = None  # the job's storage block, loaded before staging
        self.options: dict[str, Any] | None = None  # its fsspec options (None: the default credential chain)
        self.handed_back = False
        self._started = False

    def now(self) -> datetime:
        return datetime.now(timezone.utc)

    def _signal_started(self, value: int | str | Exception) -> None:
        # Prefect's worker waits for this signal once: the infrastructure id, or an exception
        # saying no infrastructure started.
        if not self._started:
            self._started = True
            self.task_status.started(value)

    async def live(self) -> int:
        self.meter.mark("submitted", scheduled_start(self.flow_run))
        self.meter.mark("picked", self.now())
        exit_code = 1
        try:
            exit_code = await self._live()
        except Exception as exc:
            self.log.exception("The e31 worker failed while running this job")
            await self.worker.client.set_flow_run_state(
                self.flow_run.id, Crashed(message=f"The e31 worker failed: {type(exc).__name__}: {exc}"), force=True)
            self._signal_started(exc)
        finally:
            # Whatever happened, and even while the worker is being stopped, nothing stays held.
            self.worker.return_devices(self.flow_run.id)
            await self._release_lease()
            with anyio.CancelScope(shield=True):
                await self._release()
        return exit_code

    async def _live(self) -> int:
        try:
            job = self.configuration.job()
        except JobError as exc:
            await self._refuse(reporting.INVALID_JOB, "The job is not valid:\n" + str(exc))
            return 1
        self.job_name = job.name
        self.meter.gpus, self.meter.team = job.request.gpus, job.team

        scheduled = scheduled_start(self.flow_run)
        deadline = timing.resolve_deadline(job.request.deadline, scheduled, job.tz)
        latest = timing.latest_start(deadline, job.request.admission_duration)
        if latest is not None and self.now() > latest:
            self.outcome = "deadline-missed"
            self.report.step("deadline-missed", latest_start=latest.isoformat())
            await self._refuse(reporting.DEADLINE_MISSED,
                               f"Deadline missed: the run had to start by {latest.isoformat()} to finish "
                               f"by {deadline.isoformat() if deadline else '?'}; it is now "
                               f"{self.now().isoformat(timespec='seconds')}. No GPU was rented.")
            return 1

        if job.work.image:
            try:
                send_gpus = await anyio.to_thread.run_sync(self._engine_takes_device_requests)
            except RuntimeError as exc:
                await self._refuse(reporting.NO_CONTAINER_ENGINE,
                                   f"The job runs in image {job.work.image!r} but this host's Docker engine "
                                   f"does not answer ({exc}); run it where Docker runs, or remove work.image "
                                   "to run it as a local process. No GPU was rented.")
                return 1

        data_dir, output_dir = self.workspace / "data", self.workspace / "output"
        output_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.storage = await load_storage(job.storage) if job.storage else None
            self.options = self.storage.fsspec_options() if self.storage else None
            staged = await anyio.to_thread.run_sync(stage_inputs, job.data, data_dir, self.options, self.log)
        except (StagingError, StorageBlockError) as exc:
            await self._refuse(reporting.STAGING_FAILED, f"Staging failed before any GPU was rented: {exc}")
            return 1
        self.meter.mark("staged", self.now())
        self.report.step("staged", files=staged.files, bytes=staged.bytes, seconds=round(staged.seconds, 3))

        devices = self._rent(job)
        if devices is None:
            await self._hand_back(f"No {job.request.gpus} free GPU(s) on worker {self.worker.name!r}; rescheduled.")
            return 0
        try:
            self.lease = await quotas.acquire(self.worker.client, quotas.limit_names(self.worker._work_pool_name,
                                                                                       job.team),
                                              len(devices), self.flow_run.id)
        except quotas.QuotaFull as exc:
            self.worker.return_devices(self.flow_run.id)
            await self._hand_back(f"Quota full: {exc}; rescheduled.", delay=timedelta(seconds=15))
            return 0
        except quotas.OverQuota as exc:
            self.worker.return_devices(self.flow_run.id)
            await self._refuse(reporting.OVER_QUOTA, f"Over quota: {exc}; raise it with `e31 quota set` "
                               "or ask for fewer GPUs. No GPU was rented.")
            return 1
        self.devices = devices
        self.meter.devices = [d.index for d in devices]
        self.meter.mark("rented", self.now())
        self.report.step("rented", devices, gpus=len(devices), devices=[d.index for d in devices])

        limit = timing.stop_at(self.now(), job.request.time_limit, deadline)
        if limit is not None:
            self.worker.holds_until[self.flow_run.id] = limit
        worker_pid, worker_started = this_process()
        self.holding = Holding(
            flow_run_id=str(self.flow_run.id), worker_pid=worker_pid, worker_started=worker_started,
            job_name=job.name, devices=[d.index for d in devices], workspace=str(self.workspace),
            destination=self._destination(job), runtime="docker" if job.work.image else "process",
            gpus=len(devices), team=job.team, lease=str(self.lease) if self.lease else None, storage=job.storage)
        self._record()
        seconds = None if limit is None else max(0.0, (limit - self.now()).total_seconds())
        stop = asyncio.Event()
        watcher = asyncio.ensure_future(self._watch_for_cancel(stop))
        try:
            if job.work.image:
                configuration = containers.prepare(self.configuration, job, devices, data_dir, output_dir,
                                                   self.configuration._job_folder, send_gpus)
                outcome = await containers.run_container(
                    self.worker, configuration, time_limit=seconds, stop=stop,
                    grace_seconds=self.worker.settings.stop_grace_seconds, on_started=self._on_started)
            else:
                outcome = await run_process(
                    [sys.executable, "-m", "prefect.engine"],
                    env=self._environment(job, devices, data_dir, output_dir), cwd=self.workspace,
                    time_limit=seconds, stop=stop,
                    grace_seconds=self.worker.settings.stop_grace_seconds, on_started=self._on_started)
        finally:
            watcher.cancel()
            self.meter.mark("run_ended", self.now())
            self.worker.return_devices(self.flow_run.id)
            await self._release_lease()
        self.log.info("Run ended (exit code %s); devices %s back in the pool",
                      outcome.exit_code, [d.index for d in devices] or "none")
        await self._judge(job, outcome, limit)
        await self._send_outputs(job, output_dir)
        return outcome.exit_code

    def _engine_takes_device_requests(self) -> bool:
        """Reach the Docker engine (RuntimeError if none answers); say whether to send GPU device requests."""
        client = self.worker._get_client()
        try:
            client.ping()
            choice = self.configuration.gpu_device_requests
            return choice == "on" or (choice == "auto" and containers.engine_runs_gpus(client))
        finally:
            client.close()

    async def _release_lease(self) -> None:
        if self.lease is not None:
            lease, self.lease = self.lease, None
            with anyio.CancelScope(shield=True):
                await quotas.release(self.worker.client, lease)

    def _record(self) -> None:
        """Write this run's ledger entry with the meter so far and a fresh heartbeat."""
        if self.holding is None:
            return
        self.holding.marks = {step: at.isoformat() for step, at in self.meter.marks.items()}
        self.holding.heartbeat = self.now().isoformat()
        self.worker.ledger.record(self.holding)

    async def _watch_for_cancel(self, stop: asyncio.Event) -> None:
        # Prefect marks a run Cancelling; whoever runs its infrastructure must stop it.
        # The same beat keeps the ledger's heartbeat fresh, for recovery should this worker die.
        renewed = self.now()
        while not stop.is_set():
            await asyncio.sleep(self.worker.settings.watch_seconds)
            self._record()
            if self.lease is not None and (self.now() - renewed).total_seconds() > quotas.LEASE_SECONDS / 3:
                with contextlib.suppress(Exception):
                    await quotas.renew(self.worker.client, self.lease)
                    renewed = self.now()
            with contextlib.suppress(Exception):
                state = (await self.worker.client.read_flow_run(self.flow_run.id)).state
                if state is not None and state.is_cancelling():
                    self.log.info("Cancellation requested: stopping the run")
                    stop.set()

    async def _judge(self, job: Job, outcome: RunOutcome, limit: datetime | None) -> None:
        """Give the run the final state its ending deserves, where the flow itself could not."""
        client = self.worker.client
        if outcome.timed_out:
            self.outcome = "timed-out"
            self.report.step("timed-out", self.devices, limit=str(limit))
            await self.report.fail(reporting.TIMED_OUT,
                                   f"Timed out: stopped at its time limit {limit.isoformat() if limit else ''} "
                                   f"after {self.meter.run_seconds:.0f} s; outputs written so far were kept.")
            return
        if outcome.stopped:
            self.outcome = "cancelled"
            self.report.step("cancelled", self.devices)
            await client.set_flow_run_state(self.flow_run.id, Cancelled(
                message="Cancelled while running: stopped, devices released, outputs so far kept."), force=True)
            return
        if outcome.out_of_memory:
            self.outcome = "out-of-memory"
            await self.report.fail(reporting.OUT_OF_MEMORY,
                                   f"Out of memory: the container was killed at its memory limit "
                                   f"(request.memory = {job.request.memory}); outputs written so far were kept.")
            return
        state = (await client.read_flow_run(self.flow_run.id)).state
        if state is None or not state.is_final():
            runtime = "container" if job.work.image else "process"
            self.outcome = "died"
            await self.report.fail(reporting.CONTAINER_DIED if job.work.image else reporting.PROCESS_DIED,
                                   f"The run's {runtime} died with exit code {outcome.exit_code} before the flow "
                                   "reported a final state; outputs written so far were kept.")

    def _rent(self, job: Job) -> list[Device] | None:
        inventory = self.worker.inventory
        held = inventory.held_by(self.flow_run.id)
        if len(held) == job.request.gpus:
            return held
        wanted = pick_devices(inventory.free(), job.request.gpus, job.request.gpu_type)
        if wanted is not None and inventory.hold(self.flow_run.id, wanted):
            return wanted
        return None

    async def _hand_back(self, message: str, delay: timedelta = timedelta(0)) -> None:
        # It cannot be rented now: put it back for this or another worker.
        self.log.warning(message)
        self.handed_back = True
        await self.worker.client.set_flow_run_state(
            self.flow_run.id, Scheduled(scheduled_time=self.now() + delay, message=message), force=True)
        self._signal_started(RuntimeError(message))

    def _on_started(self, pid: int | str) -> None:
        self.pid = pid
        self.meter.mark("running", self.now())
        if self.holding is not None:
            self.holding.infrastructure = str(pid)
            self._record()
        self.report.step("running", self.devices, infrastructure=str(pid))
        self._signal_started(pid)

    def _environment(self, job: Job, devices: list[Device], data_dir: Path, output_dir: Path) -> dict[str, str]:
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(_WITHHELD_PREFIXES)}
        prefect_env = {k: v for k, v in self.configuration.env.items() if v is not None}
        # prefect-docker rewrites a loopback API URL for containers; a local process uses the worker's own.
        prefect_env["PREFECT_API_URL"] = PREFECT_API_URL.value() or prefect_env.get("PREFECT_API_URL", "")
        return {**inherited, **prefect_env, **job_environment(job, devices, data_dir, output_dir)}

    async def _send_outputs(self, job: Job, output_dir: Path) -> None:
        destination = self._destination(job)
        try:
            sent = await anyio.to_thread.run_sync(upload_outputs, output_dir, destination, self.options, 3, 1.0,
                                                  self.log)
        except UploadError as exc:
            # Kept with a manifest (destination, storage block name, how the flow ended) for `e31 outputs retry`.
            state = (await self.worker.client.read_flow_run(self.flow_run.id)).state
            kept = await anyio.to_thread.run_sync(
                spooling.keep, output_dir, self.worker.settings.spool, str(self.flow_run.id), destination,
                job.storage, job.name, state.name if state else None, str(exc))
            self.outputs = kept.outputs_url
            await self.report.fail(reporting.OUTPUT_NOT_SENT, kept.message())
            await spooling.record_kept(self.worker.client, self.flow_run.id, kept)
            return
        self.outputs = destination
        self.meter.mark("output", self.now())
        self.report.step("output", files=sent.files, bytes=sent.bytes, destination=destination)
        missing = missing_outputs(output_dir, job.output.expect)
        state = (await self.worker.client.read_flow_run(self.flow_run.id)).state
        if missing and state is not None and state.is_completed():
            await self.report.fail(reporting.OUTPUT_MISSING,
                                   "Expected output missing: " + ", ".join(missing)
                                   + f" (the run wrote {sent.files} file(s) to {destination}).")
            return
        await results.point_result_at_outputs(self.worker.client, self.flow_run.id, output_dir, destination,
                                              self.storage, self.log)

    def _destination(self, job: Job) -> str:
        template = job.output.to or f"file://{self.worker.settings.home / 'outputs'}/{{flow_run.id}}/"
        return template.format(
            flow_run=SimpleNamespace(id=str(self.flow_run.id), name=self.flow_run.name),
            date=scheduled_start(self.flow_run).date().isoformat(),
            job=job.name,
        )

    async def _refuse(self, name: str, message: str) -> None:
        self.log.error(message)
        await self.report.fail(name, message)
        self._signal_started(RuntimeError(message))

    async def _release(self) -> None:
        self._signal_started(RuntimeError("The run ended before it started."))
        if self.handed_back:
            self.worker.meters.pop(self.flow_run.id, None)
            return
        self.meter.mark("released", self.now())
        if "rented" in self.meter.marks:
            # A run cut short by the worker itself stops billing here, never later.
            self.meter.mark("run_ended", self.meter.marks["released"])
        if self.worker._only_flow_run_ids is None:
            # A long-lived worker keeps no meter in memory once it is recorded in Prefect.
            self.worker.meters.pop(self.flow_run.id, None)
        try:
            await self.report.close(self.meter, self.job_name, self.outcome, self.outputs)
        except Exception:
            self.log.exception("Recording the meter of this run failed")
        self.report.step("released", self.devices, billed_seconds=round(self.meter.billed_seconds, 3),
                         billed_gpu_seconds=round(self.meter.billed_gpu_seconds, 3), gpus=self.meter.gpus)
        self.worker.ledger.forget(str(self.flow_run.id))
        if not self.worker.settings.keep_workspaces:
            remove_workspace(self.workspace)
