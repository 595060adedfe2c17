"""The e31 worker: rents GPUs for each flow run, runs it unattended, returns its outputs, meters it.

    prefect work-pool create gpu --type e31
    E31_GPUS="2xH100" prefect worker start --pool gpu --type e31

The worker polls its pool, refuses runs that can no longer meet their
deadline, and takes the most urgent runs that fit its free devices; each one
it takes lives its life (:mod:`e31_prefect.life`) under a supervisor that
outlives the worker. On SIGTERM the worker takes no new run and exits at
once; runs in progress stay with their supervisors, and the next e31 worker
on the host adopts them. A job with an image runs in a container (the worker
extends prefect-docker's DockerWorker); one without runs as a local process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import socket
from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any
from uuid import UUID

import anyio
import anyio.abc
from prefect.client.schemas.objects import FlowRun
from prefect.context import TagsContext
from prefect.exceptions import InfrastructureNotAvailable, InfrastructureNotFound, ObjectNotFound
from prefect.states import Pending
from prefect.workers.base import BaseVariables, BaseWorkerResult
from prefect_docker.worker import DockerWorker, DockerWorkerJobConfiguration
from pydantic import Field, PrivateAttr, create_model

from e31_prefect import (
    backlog,
    endings,
    home_files,
    inventories,
    output_bounds,
    plan_artifact,
    quotas,
    reporting,
    timing,
)
from e31_prefect.backlog_watch import Page, WatchedBacklog
from e31_prefect.blocks import E31Storage
from e31_prefect.command_flow import COMMAND_FLOW_ENTRYPOINT
from e31_prefect.flow_shards import FLOW_SHARDS_ENTRYPOINT
from e31_prefect.inventory import Inventory, discover
from e31_prefect.job import JOB_VARIABLE_KEYS, Job, Problem, anchor, code_root, job_name
from e31_prefect.ledger import Holding, Ledger, RunFolder, this_process
from e31_prefect.life import JobLife, infrastructure_id, parse_infrastructure_id, scheduled_start
from e31_prefect.meter import Meter
from e31_prefect.run_history import RunHistory
from e31_prefect.run_states import RunStates, read_states
from e31_prefect.runtimes import SET_FOR_THE_RUN
from e31_prefect.runtimes import container as containers
from e31_prefect.scheduling import Busy, WaitingQueue, WaitingRun, decide, plan
from e31_prefect.settings import E31Settings
from e31_prefect.supervision import Supervisor

if TYPE_CHECKING:
    from prefect.client.schemas.objects import Flow as APIFlow
    from prefect.client.schemas.objects import WorkPool, WorkQueue
    from prefect.client.schemas.responses import DeploymentResponse, WorkerFlowRunResponse


def _job_fields(raw: bool) -> dict[str, Any]:
    """The job's own fields (team, work, data, request, output, ...), declared once, on the :class:`Job` model.

    The pool's form shows them as the model declares them; the job configuration takes them as
    raw values, checked by the model when a run is lived, so a bad one fails that run with the
    job file's own message instead of failing the poll.
    """
    fields: dict[str, Any] = {}
    for key in JOB_VARIABLE_KEYS:
        info = Job.model_fields[key]
        annotation = Any if raw else info.annotation | None
        fields[key] = (annotation, Field(default=None, title=info.title, description=info.description,
                                         examples=info.examples))
    return fields


def _docker_fields() -> dict[str, Any]:
    """prefect-docker's job variables, declared by prefect-docker, each described as it works on an e31 pool."""
    fields: dict[str, Any] = {}
    for name, meaning in containers.DOCKER_SETTINGS.items():
        info = DockerWorkerJobConfiguration.model_fields[name]
        # No default image: prefect-docker computes one (with a git subprocess) that an e31 job never uses.
        annotation, default = (str | None, None) if name == "image" else (
            info.annotation, info.get_default(call_default_factory=True))
        fields[name] = (annotation, Field(default=default, title=info.title, description=meaning,
                                          examples=info.examples))
    return fields


class _PoolSettings(BaseVariables):
    """The e31 work pool's form: the job's fields, prefect-docker's settings, and this one of e31's."""

    command: str | None = Field(
        default=None, title="Command",
        description="Refused: e31 runs Prefect's engine itself; a job's work is its work.flow or work.command.")
    env: dict[str, str | None] = Field(
        default_factory=dict, title="Environment Variables",
        description="Environment variables to set when starting a flow run (a job's own are its work.env). "
        "Refused: PREFECT_API_URL (a job reaches Prefect through its run's gateway), Prefect's credentials, "
        "server settings and home, and what e31 sets for each run: " + ", ".join(SET_FOR_THE_RUN) + ".")
    gpu_device_requests: containers.GpuRequests = Field(
        default="auto", title="GPU device requests",
        description="Send containers a device request for their GPUs: auto (when the engine has the NVIDIA "
        "runtime), on or off. The visible-devices variables are always set.",
        examples=["auto"])
    default_disk: str = Field(
        default=output_bounds.DEFAULT_DISK, title="Default disk",
        description="Disk a run may write in its output dir when its job sets no request.disk (bytes or 512m, "
        "16g, 2Gi). A run that fills it ends DiskLimit, keeping what it wrote.",
        examples=["20g"])
    max_output_files: int = Field(
        default=output_bounds.DEFAULT_MAX_OUTPUT_FILES, title="Most output files",
        description="Files and folders a run may leave in its output dir. A run past it ends TooManyOutputs and "
        "the first ones are sent.",
        examples=[100000])
    output_send_seconds: int = Field(
        default=output_bounds.DEFAULT_SEND_SECONDS, title="Time to send outputs",
        description="Seconds a run's outputs may take to send (on unbilled worker time); what is left then "
        "stays in the spool (e31 outputs retry), the run OutputNotSent.",
        examples=[3600])


E31Variables = create_model("E31Variables", __base__=_PoolSettings, __module__=__name__, **_docker_fields(),
                            **_job_fields(raw=False))
E31Variables.__doc__ = "The e31 work pool's form: the job's team, work, data, request and output, and the pool's."


class _Configuration(DockerWorkerJobConfiguration):
    """One flow run's job as the worker receives it: raw job variables, validated in :meth:`job`."""

    gpu_device_requests: containers.GpuRequests = Field(default="auto")
    image: str | None = Field(default=None)  # a job's image is its work.image; no default is computed
    # The pool's bounds on outputs, raw: a bad value fails its run naming it (output_bounds.bounds_for).
    default_disk: Any = Field(default=None)
    max_output_files: Any = Field(default=None)
    output_send_seconds: Any = Field(default=None)

    _job_name: str = PrivateAttr(default="job")
    _command_given: str | None = PrivateAttr(default=None)
    _env_given: dict[str, Any] | None = PrivateAttr(default=None)
    _labels_given: dict[str, Any] | None = PrivateAttr(default=None)
    _job_folder: Path | None = PrivateAttr(default=None)
    _code_folder: Path | None = PrivateAttr(default=None)
    _entrypoint: str | None = PrivateAttr(default=None)
    _shards_start: tuple[list[str], str] | None = PrivateAttr(default=None)

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
        self._command_given, self._env_given, image = self.command, dict(self.env or {}), self.image
        self._labels_given = dict(self.labels or {})
        self.image = image or "unused"  # spares prefect-docker computing a default image (a git subprocess)
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id=worker_id)
        self.image = image
        self._job_name = job_name(deployment.name if deployment else flow_run.name)  # Prefect allows spaces
        self._job_folder = job_folder(deployment)
        self._code_folder = code_folder(deployment)
        self._entrypoint = deployment.entrypoint if deployment else None
        self._shards_start = shards_start(flow_run, deployment)
        entrypoint = (getattr(self, "work", None) or {}).get("flow")
        if deployment is None and entrypoint:
            # A run with no deployment (an @e31 flow) names its source file: the flow is loaded
            # from there, and the file's folder is its code (mounted read-only in a container).
            folder = Path(entrypoint.rsplit(":", 1)[0]).parent
            self.env["PREFECT__FLOW_ENTRYPOINT"] = self._entrypoint = entrypoint
            self._job_folder = self._code_folder = folder if folder.is_dir() else None
            if flow is not None:
                self._job_name = job_name(flow.name)

    @property
    def entrypoint(self) -> str | None:
        """The flow the run's deployment (or decorated flow) runs, where known."""
        return self._entrypoint

    @property
    def shards_start(self) -> tuple[list[str], str] | None:
        """What a sharded command's shards run and in which folder, where known before the work starts."""
        return self._shards_start

    def job(self, name: str | None = None) -> Job:
        """The validated job; raises :class:`JobError` naming each bad field.

        Relative local paths (as a hand-written deployment may give) are read from the deployment's folder.
        """
        job = Job.from_job_variables({k: getattr(self, k) for k in JOB_VARIABLE_KEYS}, name=name or self._job_name)
        return anchor(job, self._code_folder) if self._code_folder else job

    def setting_problems(self, allowed_volumes: list[Path]) -> list[Problem]:
        """The prefect-docker settings of this run that an e31 pool refuses, each with the e31 way instead."""
        settings = {name: getattr(self, name) for name in containers.DOCKER_SETTINGS}
        # As given, before Prefect adds its own.
        env = self.env if self._env_given is None else self._env_given
        labels = self.labels if self._labels_given is None else self._labels_given
        return containers.setting_problems({**settings, "command": self._command_given, "env": env,
                                            "labels": labels}, allowed_volumes)

    def code_mount(self) -> Path | None:
        """The folder of the job's code that its container sees read-only at its own path: the job's folder,
        or the project folder holding it and a flow file that lives beside it (``../flows/x.py``)."""
        if self._job_folder is None:
            return None
        source = (self._entrypoint or "").rsplit(":", 1)[0]
        if self._entrypoint == FLOW_SHARDS_ENTRYPOINT:  # e31's flow shards: the code is the job's work.flow
            source = ((getattr(self, "work", None) or {}).get("flow") or "").rsplit(":", 1)[0]
        if not source.endswith(".py"):
            return self._job_folder  # a module (e31's command flow): the command runs in the job's folder
        return code_root(self._job_folder, (self._job_folder / source).resolve()) or self._job_folder


E31JobConfiguration = create_model("E31JobConfiguration", __base__=_Configuration, __module__=__name__,
                                   **_job_fields(raw=True))


SET_WORKING_DIRECTORY = "prefect.deployments.steps.set_working_directory"  # a local deployment's pull step


def shards_start(flow_run: FlowRun, deployment: DeploymentResponse | None) -> tuple[list[str], str] | None:
    """The command a run of e31's command flow gives its shards (its parameter) and the folder they run in,
    where nothing but moving into that folder comes first (the deployment's only pull step, as e31 submit
    and a local ``prefect deploy`` write): the job's entry can start them before Prefect loads. Else None.
    """
    if deployment is None or deployment.entrypoint != COMMAND_FLOW_ENTRYPOINT:
        return None
    steps = deployment.pull_steps or []
    if len(steps) != 1 or list(steps[0]) != [SET_WORKING_DIRECTORY]:
        return None
    folder, command = steps[0][SET_WORKING_DIRECTORY].get("directory"), flow_run.parameters.get("command")
    if not (isinstance(command, list) and command and all(isinstance(part, str) for part in command)):
        return None
    return (command, folder) if isinstance(folder, str) and os.path.isabs(folder) and os.path.isdir(folder) else None


def code_folder(deployment: DeploymentResponse | None) -> Path | None:
    """Where a deployment's code lives on this host: the folder its pull step moves into (``prefect deploy``
    of local code writes a ``set_working_directory`` step, as e31 does), else its path.

    The pull step first: it is where the flow really runs, and ``prefect deploy`` over a deployment
    that e31 made keeps the old ``path``.
    """
    if deployment is None:
        return None
    folders = [step[SET_WORKING_DIRECTORY].get("directory")
               for step in deployment.pull_steps or [] if SET_WORKING_DIRECTORY in step]
    folders += [deployment.path] if deployment.path else []
    return next((Path(folder) for folder in folders if folder and Path(folder).is_dir()), None)


def job_folder(deployment: DeploymentResponse | None) -> Path | None:
    """The job file's folder on this host, for a deployment made from a job file (its code lives there)."""
    if deployment is None or not deployment.path:
        return None
    steps = deployment.pull_steps or []
    made_by_e31 = steps == [{SET_WORKING_DIRECTORY: {"directory": deployment.path}}]
    folder = Path(deployment.path)
    return folder if made_by_e31 and folder.is_dir() else None


LOWEST_QUEUE_PRIORITY = 2**31  # a run whose work queue is unknown goes after every known queue's
DEPLOYMENT_READS_AT_ONCE = 8  # a backlog from many deployments reads them together, not all at one instant


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
                 only_flow_run_ids: set[UUID] | None = None, at_keyboard: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.settings = settings or E31Settings()
        self.inventory = Inventory(discover(self.settings.gpus), self.settings.device_locks, self._logger)
        self.meters: dict[UUID, Meter] = {}  # the meters of runs in progress (and, for `e31 run`, its own)
        self.ledger = Ledger(self.settings.home.expanduser() / "ledger")
        self._living: set[UUID] = set()
        # Every living run's state in one read per watch interval (cancellation requests), not one per run.
        self.run_states = RunStates(lambda ids: read_states(self.client, ids), lambda: self._living,
                                    self.settings.watch_seconds)
        # When each run holding devices here must have let them go (its time limit), for backfill.
        self.holds_until: dict[UUID, datetime] = {}
        # When each run started here is predicted to end (its deployment's past runs), if before its limit:
        # backfill plans with it; a run that outlives it is not stopped, the next poll plans around it.
        self.predicted_until: dict[UUID, datetime] = {}
        self.predicted_length: dict[UUID, timedelta] = {}  # counted again from the rent (staging came between)
        # The latest start a poll judged a run by when it took it on a predicted length: the run's admission
        # judges it the same way (by its limit, it may be past already).
        self.admitted_latest: dict[UUID, datetime] = {}
        # Recent work times of the waiting runs' deployments (the Prefect server's record), and the last
        # decision's reservations: a run a misprediction kept waiting past its promise is placed first.
        self.history = RunHistory(self.settings.history_runs, self.settings.history_refresh_seconds)
        self._promised: dict[UUID, datetime] = {}
        self.plan_writer = plan_artifact.PlanWriter(self.settings.plan_artifact_seconds)
        # The pool's waiting runs in order of urgency, kept across polls so a decision never sorts.
        self.queue = WaitingQueue()
        # Each waiting run as evaluated (templated, parsed, deadline resolved), kept until it changes.
        self.evaluations: backlog.Evaluations[tuple[WaitingRun, str, str | None]] = backlog.Evaluations()
        # `e31 run` drives a worker for its own run only; `prefect worker start` takes the whole pool.
        self._only_flow_run_ids = only_flow_run_ids
        # `e31 run`: the one who submits runs this host too; their job's file:// inputs they may read are staged.
        self.at_keyboard = at_keyboard
        self._stopping = False
        self._serving = False  # a pool's worker (`prefect worker start`), which adopts what dead workers left
        self._follows_events = False  # a pool's worker that polls more than once keeps its backlog between polls
        self.backlog_watch: WatchedBacklog | None = None
        self._deployments: set[UUID] = set()  # those the last poll's waiting runs came from, read with the queues
        # The last poll's runs, what their evaluation stood on, and the evaluation (see _waiting_runs).
        self._last_waiting: tuple[list[WorkerFlowRunResponse], Any, dict[UUID, Any]] | None = None
        self._queued: dict[UUID, Any] | None = None  # the evaluation the waiting queue was last synced to
        self._owners: dict[UUID, int] = {}  # ledger owner locks of runs taken but not yet lived

    # -- starting and stopping --------------------------------------------------------------------

    async def start(self, *args: Any, **kwargs: Any) -> None:
        """``prefect worker start``: poll until told to stop. SIGTERM (or Ctrl-C) stops it at once.

        Prefect's CLI turns SIGTERM into a SIGINT to the worker's own process, which its handler
        answers with another SIGINT, so a stock worker never stops; the e31 worker handles both
        itself: it takes no new run, leaves runs in progress to their supervisors, and exits.
        """
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        signals = (signal.SIGTERM, signal.SIGINT)

        def stop() -> None:
            if not self._stopping:
                self._logger.info("Stopping: no new runs; runs in progress stay with their supervisors")
            self._stopping = True
            if main is not None:
                main.cancel()

        self._serving = True
        self._follows_events = not (args[0] if args else kwargs.get("run_once", False))
        installed = []
        for sig in signals:
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread
                loop.add_signal_handler(sig, stop)
                installed.append(sig)
        try:
            await super().start(*args, **kwargs)
        except asyncio.CancelledError:
            if not self._stopping:
                raise
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    async def setup(self) -> None:
        """Connect, register the E31 Storage block type (so the UI offers it), then adopt the runs any
        e31 worker on this host left when it died or stopped. Its files in E31_HOME and the host's device
        lock folder are closed to jobs first (:mod:`e31_prefect.home_files`): one it cannot close stops it."""
        for line in home_files.close_home(self.settings.home):
            self._logger.warning("E31_HOME: %s", line)
        self.inventory.prepare()  # says what it closed itself
        await super().setup()
        try:
            await E31Storage.aregister_type_and_schema(client=self.client)
        except Exception as exc:  # the worker runs jobs without it; only the UI's block catalog misses it
            self._logger.warning("Could not register the E31 Storage block type: %s", exc)
        self.adopt_orphans()

    async def teardown(self, *exc_info: Any) -> None:
        """Stop following the pool's events, then Prefect's teardown."""
        if self.backlog_watch is not None:
            self.backlog_watch.close()
            self.backlog_watch = None
        await super().teardown(*exc_info)

    async def follow_backlog(self) -> None:
        """Keep the pool's backlog between polls from its flow-run events (:mod:`e31_prefect.backlog_watch`);
        returns once the events are followed, or could not be (then each poll reads the whole backlog)."""
        if self.backlog_watch is not None or self._work_pool is None or self._runs_task_group is None:
            return
        self.backlog_watch = WatchedBacklog(self.client, self._work_pool_name, self._work_pool.id,
                                            self.settings.backlog_heal_seconds, self._logger)
        await self._runs_task_group.start(self.backlog_watch.follow)

    async def _sync_and_initialize(self) -> None:
        await super()._sync_and_initialize()
        self.adopt_orphans()  # a worker sharing this host's ledger may have died since
        await self.publish_inventory()

    async def publish_inventory(self) -> None:
        """Publish this worker's devices and their holds for ``e31 queue`` (:mod:`e31_prefect.inventories`),
        on each heartbeat. Only a pool's worker publishes: ``e31 run`` and ``@e31`` serve one run."""
        if not self._serving or self._work_pool is None:
            return
        free = set(self.inventory.free())
        holds: dict[Any, datetime | None] = {device: self.planned_end(holder)
                                             for device, holder in self.inventory.holders().items()}
        for device in self.inventory.devices:
            if device not in free and device not in holds:
                holds[device] = None  # held by another process on this host, end unknown
        value = inventories.describe(self._work_pool_name, self.name, socket.gethostname(),
                                     self.inventory.devices, holds)
        try:
            await inventories.publish(self.client, self._work_pool_name, self.name, value)
        except Exception as exc:  # only `e31 queue` misses it; the worker works without
            self._logger.warning("Could not publish this worker's inventory for `e31 queue`: %s", exc)

    def adopt_orphans(self) -> list[str]:
        """Adopt every run in this host's ledger that no live worker owns; returns their ids.

        Only a pool's worker adopts: ``e31 run`` and an ``@e31`` call live their own run and return.
        """
        if self._runs_task_group is None or self._stopping or not self._serving:
            return []
        adopted = []
        for folder, owner in self.ledger.claim_orphans():
            self._living.add(UUID(folder.run_id))
            self._runs_task_group.start_soon(self._adopt, folder, owner)
            adopted.append(folder.run_id)
        if adopted:
            self._logger.warning("Adopting %d run(s) left by a worker that is gone: %s", len(adopted),
                                 ", ".join(adopted))
        return adopted

    async def _adopt(self, folder: RunFolder, owner: int) -> None:
        run_id = UUID(folder.run_id)
        try:
            await JobLife.adopt(self, folder, owner)
        except Exception:
            self._logger.exception("Adopting run %s failed; its ledger folder stays for the next try", run_id)
        finally:
            self._living.discard(run_id)

    # -- choosing runs ----------------------------------------------------------------------------

    async def get_and_submit_flow_runs(self) -> list[FlowRun]:
        """Poll the pool; refuse missed deadlines; take the most urgent runs that fit free devices.

        Nothing one run carries stops the poll: a run that cannot be read is taken to fail with
        its reason, and any other fault is logged and the next poll tries again.
        """
        if self._stopping:
            return []
        if not self._has_successfully_synced:
            return await super().get_and_submit_flow_runs()
        try:
            return await self._poll()
        except Exception:
            self._logger.exception("This poll failed; the next one tries again")
            return []

    async def _poll(self) -> list[FlowRun]:
        if self._follows_events and self._only_flow_run_ids is None:
            await self.follow_backlog()
        # The queues and the deployments the last poll's runs came from, read at once: a poll waits on the
        # server for these and for the backlog's page, not for one read after another.
        reads = [self._pool_queues(), self._read_deployments(self._deployments)]
        if self.backlog_watch is not None:
            reads.append(self.backlog_watch.page(self._due_by()))
        queues, deployments, *page = await asyncio.gather(*reads)
        responses = await self._backlog(queues, page[0] if page else None)
        self._last_polled_time = datetime.now(timezone.utc)
        # As Prefect's worker does, a run still being submitted is listed again, not submitted again.
        in_flight = [r.flow_run for r in responses if r.flow_run.id in self._submitting_flow_run_ids
                     and (self._only_flow_run_ids is None or r.flow_run.id in self._only_flow_run_ids)]
        if self._submitting_flow_run_ids or self._only_flow_run_ids is not None:
            responses = [r for r in responses if r.flow_run.id not in self._submitting_flow_run_ids
                         and (self._only_flow_run_ids is None or r.flow_run.id in self._only_flow_run_ids)]
        if not responses:
            return in_flight
        waiting = await self._waiting_runs(responses, queues, deployments)
        now = datetime.now(timezone.utc)
        busy = [Busy(device, self.planned_end(holder)) for device, holder in self.inventory.holders().items()]
        changed = waiting is not self._queued
        if changed:  # else the queue holds these very runs already
            self.queue.sync(run for run, _, _ in waiting.values())
            self._queued = waiting
        decision = decide(self.queue, self.inventory.free(), now, busy, promised=self._promised)
        self._promised = decision.reserved
        by_id = {r.flow_run.id: r for r in responses} if decision.missed or decision.start else {}
        for run in decision.missed:
            await self._refuse_missed(by_id[run.id].flow_run, *waiting[run.id][1:], run.latest_start, now)
            if self.backlog_watch is not None:
                self.backlog_watch.drop(run.id)
        chosen: list[WorkerFlowRunResponse] = []
        for run, devices in decision.start:
            if self.inventory.hold(run.id, devices):
                chosen.append(by_id[run.id])
                if run.duration is not None:
                    self.holds_until[run.id] = now + run.duration
                    if run.limit is not None:  # planned by a prediction: the limit still stops it
                        self.predicted_until[run.id] = now + run.duration
                        self.predicted_length[run.id] = run.duration
                        if run.latest_start is not None:
                            self.admitted_latest[run.id] = run.latest_start
        if self._serving and (changed or decision.start) and self.plan_writer.due():
            self.plan_writer.start(functools.partial(self._pool_plan, waiting, responses))
        submitted = {run.id for run in await self._submit_scheduled_flow_runs(flow_run_response=chosen)}
        for response in chosen:
            if response.flow_run.id not in submitted:  # Prefect's limiter (--limit) said no: hold nothing for it
                self.return_devices(response.flow_run.id)
            elif self.backlog_watch is not None:
                self.backlog_watch.drop(response.flow_run.id)
        return in_flight + [response.flow_run for response in chosen if response.flow_run.id in submitted]

    async def read_waiting(self) -> dict[UUID, tuple[WaitingRun, str, str]]:
        """Every due run of the pool, evaluated as a poll evaluates it, with its flow run's and job's names
        (``e31 queue``). Reads the pool without a heartbeat: the reader is not a worker of the pool."""
        self._work_pool = await self.client.read_work_pool(self._work_pool_name)
        queues = await self._pool_queues()
        responses = await self._backlog(queues)
        waiting = await self._waiting_runs(responses, queues)
        return {r.flow_run.id: (waiting[r.flow_run.id][0], r.flow_run.name, waiting[r.flow_run.id][1])
                for r in responses}

    def planned_end(self, run_id: UUID) -> datetime | None:
        """When a run holding devices here is planned to let them go: its predicted end if sooner, else its limit."""
        limit, predicted = self.holds_until.get(run_id), self.predicted_until.get(run_id)
        return predicted if predicted is not None and (limit is None or predicted < limit) else limit

    def rented(self, run_id: UUID, at: datetime) -> None:
        """The run's devices are rented at ``at``: its predicted end counts from there, as its limit does."""
        if run_id in self.predicted_length:
            self.predicted_until[run_id] = at + self.predicted_length[run_id]

    async def _pool_plan(self, waiting: dict[UUID, tuple[WaitingRun, str, str | None]],
                         responses: list[WorkerFlowRunResponse]) -> tuple[list[dict[str, str]], Any]:
        """The pool's plan artifact rows (its waiting runs over the live workers' published devices), and
        how to write them."""
        hosts = await inventories.read(self.client, self._work_pool_name)
        now = datetime.now(timezone.utc)
        planned = plan([run for run, _, _ in waiting.values()], [(h.free, h.busy) for h in hosts], now)
        names = {r.flow_run.id: (r.flow_run.name, waiting[r.flow_run.id][1]) for r in responses
                 if r.flow_run.id in waiting}
        return plan_artifact.table(planned, names), functools.partial(
            plan_artifact.write, self.client, self._work_pool_name, now=now)

    def _due_by(self) -> datetime:
        """The latest scheduled start a poll takes: now and Prefect's prefetch."""
        return datetime.now(timezone.utc) + timedelta(seconds=int(self._prefetch_seconds))

    async def _backlog(self, queues: dict[UUID, WorkQueue] | None,
                       page: Page | None = None) -> list[WorkerFlowRunResponse]:
        """Every due run of the pool's (or this worker's) work queues: kept between polls where the pool's
        events are followed (:mod:`e31_prefect.backlog_watch`), else read page by page (:mod:`e31_prefect.backlog`).

        Without the pool's queues (their read failed) it is Prefect's own single page, as a stock worker reads.
        Prefect's worker endpoint gives nothing of a paused queue or pool and caps a queue or pool with a
        concurrency limit at its free slots; such queues (few runs by their limit) are read whole on each poll.
        """
        if queues is None and not self._work_queues:
            return await self._get_scheduled_flow_runs()
        names = sorted(self._work_queues) if self._work_queues else [queue.name for queue in queues.values()]
        due_by = self._due_by()
        pool = self._work_pool
        watch = self.backlog_watch
        queue_names = {queue.id: queue.name for queue in (queues or {}).values()}
        if watch is None or queues is None or pool is None or pool.concurrency_limit is not None:
            return backlog.with_queue_names(
                await backlog.read_backlog(self.client, self._work_pool_name, names, due_by), queue_names)
        if pool.is_paused:
            return []
        by_name = {queue.name: queue for queue in queues.values()}
        limited = [name for name in names if name in by_name and by_name[name].concurrency_limit is not None]
        kept = {by_name[name].id: name for name in names
                if name in by_name and name not in limited and not by_name[name].is_paused}
        found = await watch.runs(kept, due_by, page) if kept else []
        if limited:
            found += backlog.with_queue_names(
                await backlog.read_backlog(self.client, self._work_pool_name, limited, due_by), queue_names)
        return found

    async def _read_deployments(self, ids: Iterable[UUID]) -> dict[UUID, DeploymentResponse | None]:
        """The deployments ``ids``, read at once; None for one that is gone."""
        at_once = asyncio.Semaphore(DEPLOYMENT_READS_AT_ONCE)

        async def read(deployment_id: UUID) -> DeploymentResponse | None:
            async with at_once:
                try:
                    return await self.client.read_deployment(deployment_id)
                except ObjectNotFound:
                    return None

        ids = list(ids)
        return dict(zip(ids, await asyncio.gather(*map(read, ids)), strict=True))

    async def _waiting_runs(self, responses: list[WorkerFlowRunResponse], queues: dict[UUID, WorkQueue] | None = None,
                            deployments: dict[UUID, DeploymentResponse | None] | None = None,
                            ) -> dict[UUID, tuple[WaitingRun, str, str | None]]:
        """Each scheduled run as the scheduler sees it, with its job's name and team.

        A run is templated and parsed once and kept (:attr:`evaluations`) until it, its work queue's
        priority, its deployment or the pool's template changes. Given the very list of runs of the last
        call (a kept backlog where nothing changed) and the same queues, deployments and template, it is
        the very answer of the last call, found without a look at each run.
        """
        deployments = dict(deployments or {})
        priorities = {queue_id: queue.priority for queue_id, queue in (queues or {}).items()}
        template = json.dumps(self.work_pool.base_job_template, sort_keys=True, default=str)

        def around() -> tuple[Any, ...]:
            """What the evaluations stand on besides the runs themselves."""
            return (priorities, {key: d.updated if d else None for key, d in deployments.items()}, template,
                    self.history.generation)

        await self.history.update(self.client, self._deployments)  # a few ids: the last poll's runs' deployments
        last = self._last_waiting
        if last is not None and last[0] is responses and last[1] == around():
            return last[2]
        flow_runs = [response.flow_run for response in responses]
        waiting = {}
        jobs: dict[str, Job | Exception] = {}
        deployments.update(await self._read_deployments(
            {run.deployment_id for run in flow_runs if run.deployment_id and run.deployment_id not in deployments}))
        self._deployments = {run.deployment_id for run in flow_runs if run.deployment_id}
        await self.history.update(self.client, self._deployments)  # a new deployment's record, before its runs' plan
        for flow_run in flow_runs:
            deployment = deployments.get(flow_run.deployment_id) if flow_run.deployment_id else None
            queue_priority = priorities.get(flow_run.work_queue_id, LOWEST_QUEUE_PRIORITY)
            version = (flow_run.updated, flow_run.state_id, flow_run.work_queue_id, queue_priority,
                       deployment.updated if deployment else None, template,
                       self.history.version(flow_run.deployment_id))
            evaluated = self.evaluations.get(flow_run.id, version)
            if evaluated is None:
                run, name, team = await self._evaluate(flow_run, deployment, jobs)
                evaluated = (replace(run, queue_priority=queue_priority), name, team)
                self.evaluations.keep(flow_run.id, version, evaluated)
            # The same object poll after poll while nothing changed: the queue's sync sees that at a glance.
            waiting[flow_run.id] = evaluated
        self.evaluations.retain(waiting)
        self._last_waiting = (responses, around(), waiting)  # with the deployments read since the check
        return waiting

    async def _evaluate(self, flow_run: FlowRun, deployment: DeploymentResponse | None,
                        jobs: dict[str, Job | Exception]) -> tuple[WaitingRun, str, str | None]:
        name = job_name(deployment.name if deployment else flow_run.name)
        try:
            run, team = await self._waiting_run(flow_run, deployment, name, jobs)
        except Exception as exc:
            # Whatever this run carries (a job variable of the wrong shape, a date out of any
            # range), it is taken at once, on no device, so that its life fails it with the reason.
            self._logger.warning("Flow run %s cannot be read as a job (%s: %s); it is taken to fail",
                                 flow_run.id, type(exc).__name__, exc)
            run, team = WaitingRun(flow_run.id, 0, None, scheduled_start(flow_run)), None
        return run, name, team

    async def _pool_queues(self) -> dict[UUID, WorkQueue] | None:
        """The pool's work queues by id (their priorities order runs, 1 first), read once per poll;
        None if they cannot be read now."""
        try:
            return {queue.id: queue for queue in await self.client.read_work_queues(
                work_pool_name=self._work_pool_name)}
        except Exception as exc:
            self._logger.warning("Could not read the pool's work queues (%s); their priorities are ignored", exc)
            return None

    async def _job(self, values: dict[str, Any], name: str, jobs: dict[str, Job | Exception]) -> Job:
        """The job named ``name`` that ``values`` make of the pool's template; ``jobs`` holds those made this poll,
        so the runs of one batch (one deployment, the same variables) are templated once between them."""
        key = json.dumps([name, values], sort_keys=True, default=str)
        if key not in jobs:
            try:
                configuration = await self.job_configuration.from_template_and_values(
                    self.work_pool.base_job_template, values, client=self.client)
                jobs[key] = configuration.job(name)
            except Exception as exc:
                jobs[key] = exc
        job = jobs[key]
        if isinstance(job, Exception):
            raise job
        return job

    async def _waiting_run(self, flow_run: FlowRun, deployment: DeploymentResponse | None,
                           name: str, jobs: dict[str, Job | Exception]) -> tuple[WaitingRun, str | None]:
        scheduled = scheduled_start(flow_run)
        values = {**(deployment.job_variables if deployment else {}), **(flow_run.job_variables or {})}
        job = await self._job(values, name, jobs)
        deadline = timing.resolve_deadline(job.request.deadline, scheduled, job.tz)
        team = quotas.team_by_queue(self.settings.queue_teams, flow_run.work_queue_name, job.team)
        limit = job.request.time_limit or job.expected_duration
        # Planned (and its deadline judged) by what its deployment's recent runs of its team took, not by its limit.
        prediction, seen = self.history.predict(flow_run.deployment_id, team, limit)
        return WaitingRun(
            id=flow_run.id,
            gpus=job.request.gpus,
            gpu_type=job.request.gpu_type,
            scheduled=scheduled,
            latest_start=timing.latest_start(deadline, prediction.duration if prediction.learned
                                             else job.admission_duration),
            priority=job.request.priority,
            duration=prediction.duration,
            limit=limit if prediction.learned else None,
            basis=prediction.basis(seen),
        ), team

    async def _refuse_missed(self, flow_run: FlowRun, job_name: str, team: str | None, latest: datetime | None,
                             now: datetime) -> None:
        report = reporting.JobReport(self.client, flow_run, [])
        message = (f"Deadline missed: the run had to start by {latest.isoformat() if latest else '?'} "
                   f"to finish in time; it is now {now.isoformat(timespec='seconds')}. No GPU was rented.")
        report.step("deadline-missed", latest_start=str(latest), now=now.isoformat())
        await report.end(endings.DEADLINE_MISSED.saying(message))
        meter = Meter(team=team)
        meter.mark("submitted", scheduled_start(flow_run))
        meter.mark("released", now)
        await report.close(meter, job_name, endings.DEADLINE_MISSED.event, None)
        self.get_flow_run_logger(flow_run).warning(message)

    @property
    def busy(self) -> bool:
        """Whether a run is being submitted or lived on this worker now."""
        return bool(self._submitting_flow_run_ids or self._living)

    async def _propose_pending_state(self, flow_run: FlowRun) -> bool:
        """Take the run in this host's ledger before Prefect marks it Pending: if this worker dies before
        the run starts, the next worker on the host hands it back to the pool (Prefect would keep it
        Pending for ever)."""
        folder = self.ledger.folder(str(flow_run.id))
        owner = folder.own()
        if owner is None:
            return False  # another worker on this host has it
        pid, started = this_process()
        folder.write_holding(Holding(flow_run_id=str(flow_run.id), worker_pid=pid, worker_started=started,
                                     job_name=flow_run.name, devices=[],
                                     workspace=str(self.settings.workspaces / str(flow_run.id))))
        self._owners[flow_run.id] = owner
        if await super()._propose_pending_state(flow_run):
            return True
        self._drop_claim(flow_run.id)
        return False

    def _drop_claim(self, flow_run_id: UUID) -> None:
        """A run this worker took in its ledger but never lived: forget it."""
        owner = self._owners.pop(flow_run_id, None)
        if owner is not None:
            self.ledger.forget(str(flow_run_id))
            os.close(owner)

    def _release_limit_slot(self, flow_run_id: UUID) -> None:
        # Called by Prefect whenever a run stops occupying this worker, including a submission
        # another worker won: the devices reserved for it go back too, and a claim never lived.
        self.return_devices(flow_run_id)
        self._drop_claim(flow_run_id)
        super()._release_limit_slot(flow_run_id)

    async def _give_worker_labels_to_flow_run(self, flow_run_id: UUID) -> None:
        # Labels only name this worker on the run: a Prefect API too busy to set them now must not
        # fail the run before it starts (Prefect's own worker reports it crashed).
        try:
            await super()._give_worker_labels_to_flow_run(flow_run_id)
        except Exception as exc:
            self._logger.warning("Could not label flow run %s with this worker: %s", flow_run_id, exc)

    def return_devices(self, flow_run_id: UUID) -> None:
        """The run's devices go back to this host's pool (idempotent)."""
        self.inventory.give_back(flow_run_id)
        self.holds_until.pop(flow_run_id, None)
        self.predicted_until.pop(flow_run_id, None)
        self.predicted_length.pop(flow_run_id, None)
        self.admitted_latest.pop(flow_run_id, None)

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
        else:
            # A retry of an existing run (`flow.retry(...)`): Pending again, as Prefect's own ad hoc path does.
            await self.client.set_flow_run_state(flow_run.id, Pending(message="Retrying on an e31 worker"),
                                                 force=True)
            flow_run = await self.client.read_flow_run(flow_run.id)
        if task_status is not None:
            task_status.started(flow_run)
        configuration = await self.job_configuration.from_template_and_values(
            self.work_pool.base_job_template, job_variables or {}, client=self.client)
        configuration.prepare_for_flow_run(
            flow_run=flow_run, flow=SimpleNamespace(id=flow_run.flow_id, name=flow.name, labels={}),
            work_pool=self.work_pool, worker_name=self.name, worker_id=self.backend_id)
        await self.run(flow_run, configuration)

    async def _initiate_run(self, flow_run: FlowRun, configuration: Any) -> None:
        """Start a run's whole life on this worker (admit, stage, rent, run, send, release) and return as soon
        as its work started, or its life ended first, as Prefect's contract for this method says.

        prefect-docker's own would only create a container (and fail on a job with no image): the life goes
        on in the worker's task group, as a polled run's does, and its infrastructure id is recorded.
        """
        if self._runs_task_group is None:
            raise RuntimeError("Worker not properly initialized")
        started = await self._runs_task_group.start(functools.partial(self.run, flow_run, configuration))
        if isinstance(started, str):  # its infrastructure id: Prefect's cancellation path finds the work from it
            await self.client.update_flow_run(flow_run.id, infrastructure_pid=started)

    async def kill_infrastructure(self, infrastructure_pid: str, configuration: Any, grace_seconds: int = 30) -> None:
        """Stop a run's work from its infrastructure id (Prefect's cancellation path), in either runtime.

        The id names the host and the flow run (:func:`infrastructure_id`): the run's supervisor
        stops the work (SIGTERM, then SIGKILL after its grace, or docker stop, kill, remove).
        """
        host, run_id = parse_infrastructure_id(infrastructure_pid)
        if host != socket.gethostname():
            raise InfrastructureNotAvailable(f"flow run {run_id} runs on host {host!r}; this worker is on "
                                             f"{socket.gethostname()!r}")
        supervisor = Supervisor(self.ledger.folder(run_id))
        if not supervisor.alive():
            raise InfrastructureNotFound(f"flow run {run_id} has no running work on this host")
        supervisor.stop()
        with anyio.move_on_after(grace_seconds + 10):
            await supervisor.wait()

    # -- living one job ---------------------------------------------------------------------------

    async def run(
        self,
        flow_run: FlowRun,
        configuration: Any,
        task_status: anyio.abc.TaskStatus[Any] | None = None,
    ) -> E31WorkerResult:
        """Live one job: admit, stage, rent, run, judge, send, release; the meter closes whatever happens."""
        life = JobLife(self, flow_run, configuration, task_status or anyio.TASK_STATUS_IGNORED,
                       owner=self._owners.pop(flow_run.id, None))
        self._living.add(flow_run.id)
        try:
            ending = await life.live()
        finally:
            self._living.discard(flow_run.id)
        failed = ending is not None and ending.is_(endings.WORKER_FAILED)
        return E31WorkerResult(status_code=1 if failed else 0, identifier=infrastructure_id(flow_run.id))
