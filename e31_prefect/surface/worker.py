"""The e31 worker: rents GPUs for each flow run, runs it unattended, returns its outputs, meters it.

    prefect work-pool create gpu --type e31
    E31_GPUS="2xH100" prefect worker start --pool gpu --type e31

The worker polls its pool, refuses runs that can no longer meet their
deadline, and takes the most urgent runs that fit its free devices; each one
it takes lives its life (:mod:`e31_prefect.surface.life`) under a supervisor that
outlives the worker. On SIGTERM the worker takes no new run and exits at
once; runs in progress stay with their supervisors, and the next e31 worker
on the host adopts them. A job with an image runs in a container (the worker
extends prefect-docker's DockerWorker); one without runs as a local process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import os
import signal
import sys
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any
from uuid import UUID

import anyio
import anyio.abc
from prefect.client.schemas.objects import FlowRun
from prefect.context import TagsContext
from prefect.exceptions import Abort, InfrastructureNotAvailable, InfrastructureNotFound
from prefect.states import Pending
from prefect.utilities.engine import propose_state
from prefect.workers.base import BaseWorkerResult
from prefect_docker.worker import DockerWorker

from e31_prefect import job_entry
from e31_prefect.data.blocks import E31Storage
from e31_prefect.host import bytecode, home_files
from e31_prefect.host.inventory import Inventory, discover
from e31_prefect.host.ledger import Holding, Ledger, RunFolder, this_process
from e31_prefect.host.settings import E31Settings
from e31_prefect.host.supervision import Supervisor
from e31_prefect.model import attempts, endings
from e31_prefect.model.meter import Meter
from e31_prefect.planning import backlog
from e31_prefect.planning.backlog_watch import WatchedBacklog
from e31_prefect.planning.run_history import RunHistory
from e31_prefect.planning.scheduling import Busy, WaitingQueue, WaitingRun, decide
from e31_prefect.surface import inventories, plan_artifact
from e31_prefect.surface.host_watch import HostWatching
from e31_prefect.surface.life import JobLife
from e31_prefect.surface.life_terms import infrastructure_id, parse_infrastructure_id
from e31_prefect.surface.run_states import RunStates, read_states
from e31_prefect.surface.worker_backlog import BacklogReading
from e31_prefect.surface.worker_configuration import E31JobConfiguration, E31Variables

if TYPE_CHECKING:
    from prefect.client.schemas.responses import WorkerFlowRunResponse

try:
    VERSION = importlib.metadata.version("e31-prefect")
except importlib.metadata.PackageNotFoundError:  # a checkout run without installing it
    VERSION = "unknown"

# How long a poll's plan for a run whose work loads (holding nothing) is left to it by the next polls: past it
# the run delays no other; it rents from what is free once ready, or goes back to the pool (e31_prefect.surface.life).
LOADING_PLAN_SECONDS = 30.0
# How long a worker stopped by a signal may take to send the logs and events Prefect still has queued for the API:
# past it the worker leaves without them, rather than wait out the client's retries (about a minute) on an API
# that is down. Nothing of a run is lost: its supervisor and the next worker report it.
LEAVE_SECONDS = 5.0


class E31WorkerResult(BaseWorkerResult):
    """How a flow run's infrastructure ended."""


class E31Worker(HostWatching, BacklogReading, DockerWorker):
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
        self._warm: Any = None  # the warm interpreter process jobs' entries are forked from (started at need)
        self._init_host_watch()

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

    async def __aexit__(self, *exc_info: Any) -> None:
        """Prefect's exit (the teardown, which re-raises the cancellation that stopped a pool's worker); then
        a pool's worker stopped by a signal sends what is queued for the API for at most ``LEAVE_SECONDS``,
        and where the API did not take it all, the process leaves at once, saying so."""
        try:
            await super().__aexit__(*exc_info)
        finally:
            if self._serving and self._stopping:
                await self._leave()

    async def _leave(self) -> None:
        """Send what is queued for the API, bounded; leave the process at once where it did not all go."""
        if await asyncio.to_thread(job_entry.send_queued, LEAVE_SECONDS):
            return
        print(f"The Prefect API did not take this worker's last logs and events within {LEAVE_SECONDS:g} s: "
              "left without sending them", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        # Prefect's services would otherwise wait out their client's retries as the interpreter exits.
        os._exit(0)

    async def setup(self) -> None:
        """Connect, register the E31 Storage block type (so the UI offers it), then adopt the runs any
        e31 worker on this host left when it died or stopped. Its files in E31_HOME and the host's device
        lock folder are closed to jobs first (:mod:`e31_prefect.host.home_files`): one it cannot close stops it."""
        for line in home_files.close_home(self.settings.home):
            self._logger.warning("E31_HOME: %s", line)
        self.inventory.prepare()  # says what it closed itself
        await asyncio.to_thread(bytecode.compile_own_modules)  # each run's supervisor loads them, never compiles
        await super().setup()
        try:
            await E31Storage.aregister_type_and_schema(client=self.client)
        except Exception as exc:  # the worker runs jobs without it; only the UI's block catalog misses it
            self._logger.warning("Could not register the E31 Storage block type: %s", exc)
        self.adopt_orphans()
        if self._serving and self._runs_task_group is not None:
            # This host's heartbeat, its GPUs' health and drains; the pool's lost hosts.
            self._runs_task_group.start_soon(self.watch_hosts)

    async def teardown(self, *exc_info: Any) -> None:
        """Stop following the pool's events and watching the hosts and the warm interpreter (runs it forked go
        on), then Prefect's teardown."""
        self.stop_watching_hosts()
        if self._warm is not None:
            await asyncio.to_thread(self._warm.stop)
            self._warm = None
        if self.backlog_watch is not None:
            self.backlog_watch.close()
            self.backlog_watch = None
        await super().teardown(*exc_info)

    def warm_interpreter(self) -> Any:
        """This worker's warm interpreter (:mod:`e31_prefect.host.warm_interpreter`), where process jobs run as
        users of their own; None elsewhere (each job's entry is then a new interpreter)."""
        from e31_prefect.runtimes import process

        if self._warm is None and process.isolated(self.settings):
            self._warm = process.warm_interpreter(self.settings.home.expanduser())
        return self._warm

    async def follow_backlog(self) -> None:
        """Keep the pool's backlog between polls from its flow-run events (:mod:`e31_prefect.planning.backlog_watch`);
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
        """Publish this worker's devices and their holds for ``e31 queue`` (:mod:`e31_prefect.surface.inventories`),
        on each heartbeat. Only a pool's worker publishes: ``e31 run`` and ``@e31`` serve one run."""
        if not self._serving or self._work_pool is None:
            return
        free, drained = set(self.inventory.free()), self.inventory.drained()
        taken = {**self.inventory.planned(), **self.inventory.holders()}  # a loading run's plan, as the poll's
        holds: dict[Any, datetime | None] = {device: self.planned_end(holder) for device, holder in taken.items()}
        for device in self.inventory.devices:
            if device not in free and device not in holds and device not in drained:
                holds[device] = None  # held by another process on this host, end unknown
        value = inventories.describe(self._work_pool_name, self.name, self.settings.host_name,
                                     self.inventory.devices, holds, drained, taken, VERSION,
                                     datetime.now(timezone.utc))
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
        for folder, owner in self.ledger.claim_orphans(self.settings.host_name):
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
        # Runs whose work still loads hold nothing; their planned devices are left to them a while.
        taken = {**self.inventory.planned(), **self.inventory.holders()}
        busy = [Busy(device, self.planned_end(holder)) for device, holder in taken.items()]
        changed = waiting is not self._queued
        if changed:  # else the queue holds these very runs already
            self.queue.sync(run for run, _, _ in waiting.values())
            self._queued = waiting
        free = [device for device in self.inventory.free() if device not in taken]
        decision = decide(self.queue, free, now, busy, promised=self._promised)
        self._promised = decision.reserved
        by_id = {r.flow_run.id: r for r in responses} if decision.missed or decision.start else {}
        for run in decision.missed:
            await self._refuse_missed(by_id[run.id].flow_run, *waiting[run.id][1:], run.latest_start, now)
            if self.backlog_watch is not None:
                self.backlog_watch.drop(run.id)
        chosen: list[WorkerFlowRunResponse] = []
        for run, devices in decision.start:
            # Planned, not held: the run rents from what is free once its work is ready.
            self.inventory.plan(run.id, devices, LOADING_PLAN_SECONDS)
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
            if response.flow_run.id not in submitted:  # Prefect's limiter (--limit) said no: plan nothing for it
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
        return {r.flow_run.id: (waiting[r.flow_run.id][0], attempts.shown_name(r.flow_run.name, r.flow_run.labels),
                                 waiting[r.flow_run.id][1]) for r in responses}

    def planned_end(self, run_id: UUID) -> datetime | None:
        """When a run holding devices here is planned to let them go: its predicted end if sooner, else its limit."""
        limit, predicted = self.holds_until.get(run_id), self.predicted_until.get(run_id)
        return predicted if predicted is not None and (limit is None or predicted < limit) else limit

    def rented(self, run_id: UUID, at: datetime) -> None:
        """The run's devices are rented at ``at``: its predicted end counts from there, as its limit does."""
        if run_id in self.predicted_length:
            self.predicted_until[run_id] = at + self.predicted_length[run_id]


    @property
    def busy(self) -> bool:
        """Whether a run is being submitted or lived on this worker now."""
        return bool(self._submitting_flow_run_ids or self._living)

    async def _propose_pending_state(self, flow_run: FlowRun) -> bool:
        """Take the run in this host's ledger before Prefect marks it Pending: if this worker dies before
        the run starts, the next worker on the host hands it back to the pool (Prefect would keep it
        Pending for ever). The Pending state is the attempt's own: a requeue after it (its host lost) tells
        this attempt, from the run's history, that the run is no longer its (:meth:`superseded`)."""
        folder = self.ledger.folder(str(flow_run.id))
        owner = folder.own()
        if owner is None:
            return False  # another worker on this host has it
        pid, started = this_process()
        folder.write_holding(Holding(flow_run_id=str(flow_run.id), worker_pid=pid, worker_started=started,
                                     job_name=flow_run.name, devices=[],
                                     workspace=str(self.settings.workspaces / str(flow_run.id)),
                                     host=self.settings.host_name))
        self._owners[flow_run.id] = owner
        taken = await self._propose_pending(flow_run)
        if taken is not None:
            self.taken_states[flow_run.id] = taken
            return True
        self._drop_claim(flow_run.id)
        return False

    async def _propose_pending(self, flow_run: FlowRun) -> str | None:
        """Prefect's own proposal of Pending (as its worker makes it), keeping the state's id; None: not taken."""
        run_logger = self.get_flow_run_logger(flow_run)
        try:
            state = await propose_state(self.client, Pending(), flow_run_id=flow_run.id)
        except Abort as exc:
            run_logger.info(f"Aborted submission of flow run '{flow_run.id}'. Server sent an abort signal: {exc}")
            return None
        except Exception:
            run_logger.exception(f"Failed to update state of flow run '{flow_run.id}'")
            return None
        if not state.is_pending():
            run_logger.info(f"Aborted submission of flow run '{flow_run.id}': Server returned a non-pending state "
                            f"{state.type.value!r}")
            return None
        return str(state.id)

    def _drop_claim(self, flow_run_id: UUID) -> None:
        """A run this worker took in its ledger but never lived: forget it."""
        owner = self._owners.pop(flow_run_id, None)
        if owner is not None:
            self.ledger.forget(str(flow_run_id))
            os.close(owner)

    def _release_limit_slot(self, flow_run_id: UUID) -> None:
        # Called by Prefect whenever a run stops occupying this worker, including a submission
        # another worker won: the devices planned or held for it go back too, and a claim never lived.
        self.return_devices(flow_run_id)
        self._drop_claim(flow_run_id)
        self.taken_states.pop(flow_run_id, None)
        super()._release_limit_slot(flow_run_id)

    async def _give_worker_labels_to_flow_run(self, flow_run_id: UUID) -> None:
        # Prefect's labels name this worker on the run; a pool's worker adds its host's (the pool ends the run's
        # attempt if that host is lost) and clears an earlier attempt's hand-over. A Prefect API too busy to set
        # them now must not fail the run before it starts (Prefect's own worker reports it crashed): a run
        # without its host's label is one the pool never judges lost.
        labels: dict[str, Any] = {"prefect.worker.name": self.name, "prefect.worker.type": self.type}
        if self._work_pool is not None:
            labels.update({"prefect.work-pool.name": self._work_pool.name,
                           "prefect.work-pool.id": str(self._work_pool.id)})
        if self._serving:  # `e31 run` and @e31 live their own run, and keep no heartbeat while they stage it
            labels.update({attempts.HOST_LABEL: self.settings.host_name, attempts.RENTED_LABEL: "",
                           attempts.LEASE_LABEL: ""})
        try:
            await self.client.update_flow_run_labels(flow_run_id, labels)
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
        if host != self.settings.host_name:
            raise InfrastructureNotAvailable(f"flow run {run_id} runs on host {host!r}; this worker is on "
                                             f"{self.settings.host_name!r}")
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
        return E31WorkerResult(status_code=1 if failed else 0,
                               identifier=infrastructure_id(flow_run.id, self.settings.host_name))
