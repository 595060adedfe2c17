"""The life of one E31 job on this host, as named steps: admit, stage, prepare, rent, hand over, run, judge,
send, release.

``E31Worker.run`` lives a job it took; ``E31Worker`` adopts a job whose worker
died (:meth:`JobLife.adopt`): its supervisor kept it bounded meanwhile, and the
life goes on from the step the ledger says it reached.

Each step hands the next what it needs, or ends the life with an
:class:`~e31_prefect.model.endings.Ending` (raised as :class:`Ends`). What a run
holds while its work runs (devices, the quota lease, the cancellation watcher)
is entered on one exit stack, so the order of release is written once; the
ledger folder lives until the meter is closed. When the worker itself is told
to stop, a life that rented leaves its work to the supervisor and its folder
to the next worker; one that had not rented yet hands its run back to the pool.

A process loads Prefect before the rent, with no device and nothing of the job's, holding nothing; then
the devices are rented from what is free and handed over with the job's environment: the meter starts
there. A container (its image is the job's code) is created once its devices are rented.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import anyio
import anyio.abc
from prefect.client.schemas.objects import FlowRun, State
from prefect.exceptions import ObjectNotFound

from e31_prefect.data import keyboard
from e31_prefect.data.blocks import StorageBlockError, load_job_storage
from e31_prefect.data.staging import (
    StagingError,
    remove_workspace,
    stage_inputs,
)
from e31_prefect.flows.command_flow import COMMAND_FLOW_ENTRYPOINT
from e31_prefect.flows.flow_shards import FLOW_SHARDS_ENTRYPOINT
from e31_prefect.host import disk, output_bounds
from e31_prefect.host.inventory import Device, gpu_minors
from e31_prefect.host.ledger import Holding, Record, now, output_tail, this_process
from e31_prefect.host.output_bounds import OutputBounds
from e31_prefect.host.supervision import Supervisor
from e31_prefect.model import endings, shards, timing
from e31_prefect.model.endings import Ending
from e31_prefect.model.job import Job
from e31_prefect.model.meter import Meter
from e31_prefect.runtimes import Placement, Runtime, hand_over_environment
from e31_prefect.surface import quotas, reporting
from e31_prefect.surface.life_adoption import Adoption
from e31_prefect.surface.life_attempts import Attempts
from e31_prefect.surface.life_sending import Sending
from e31_prefect.surface.life_terms import (
    Ends,
    LifeConfiguration,
    LifeWorker,
    Rental,
    RunRefused,
    admitted,
    infrastructure_id,
    never_ready,
    scheduled_start,
    transient,
)
from e31_prefect.surface.life_watch import GONE, Watching

QUOTA_RETRY = timedelta(seconds=15)
READY_SECONDS = 300.0  # how long a job's process may take to load Prefect before it is ended, unbilled
CLOSE_RETRY_SECONDS = (1, 2, 5, 10, 30)  # the meter is recorded in Prefect once the API answers again


def runtime_for(job: Job, worker: Any, configuration: Any) -> Runtime:
    """The run's runtime, chosen once: a container for a job with an image, else a local process."""
    if job.work.image:
        from e31_prefect.runtimes.container import ContainerRuntime

        return ContainerRuntime(worker, configuration)
    from e31_prefect.runtimes.process import ProcessRuntime, csrf_in_use

    return ProcessRuntime(worker.settings, configuration, worker.warm_interpreter(), csrf_in_use(worker.client))


class JobLife(Adoption, Attempts, Sending, Watching):
    """The life of one job on this host, from taking the run to closing its meter."""

    def __init__(self, worker: LifeWorker, flow_run: FlowRun, configuration: LifeConfiguration | None,
                 task_status: anyio.abc.TaskStatus[Any] = anyio.TASK_STATUS_IGNORED, owner: int | None = None):
        self.worker = worker
        self.flow_run = flow_run
        self.run_id = flow_run.id
        self.configuration = configuration
        self.task_status = task_status
        self.log = worker.get_flow_run_logger(flow_run)
        related = worker._event_related_resources(configuration=configuration) if configuration else []
        self.report = reporting.JobReport(worker.client, flow_run, related, worker.settings.host_name)
        self.meter = worker.meters.setdefault(flow_run.id, Meter())
        self.folder = worker.ledger.folder(str(flow_run.id))
        self.workspace = worker.settings.workspaces / str(flow_run.id)
        self.job_name = configuration._job_name if configuration else flow_run.name
        self.holding: Holding | None = None  # from renting on: what the ledger keeps of the run
        self.devices: list[Device] = []
        self.lease: UUID | None = None
        self.options: dict[str, Any] | None = None  # the storage block's fsspec options (None: default chain)
        self.storage: Any = None
        self.infrastructure: str | None = None
        self.start_error: str | None = None  # why the runtime could not start the work (a Docker error)
        self._started = False
        self._detached = False
        self._owner = owner  # the run's owner lock in the ledger folder, from taking the run to release
        self.bounds: OutputBounds | None = None  # what it may write and send (admit, or its ledger entry)
        self._passed: Ending | None = None  # a bound the worker's watch stopped the work for
        # This attempt of the run (e31_prefect.surface.life_attempts): the Pending state its worker took it with,
        # when, its number, and whether the pool requeued the run since (then nothing of it is reported).
        self.taken: str | None = worker.taken_states.pop(flow_run.id, None)
        self.taken_at = time.monotonic()
        self.attempt = self.attempt_of(flow_run)
        self.superseded = False
        self.supervisor_died = False  # adopted: its supervisor died with its work (its host went down)
        self.device_failure: tuple[int, str, datetime] | None = None  # a GPU of it failed: its work was stopped
        # The run as read once its work ended: its state is judged, its outputs sent and its meter closed by it,
        # one read for all three (nothing but this worker changes the run between them).
        self.after_work_run: FlowRun | None = None

    # -- the whole life ---------------------------------------------------------------------------

    async def live(self) -> Ending | None:
        """Live the job: every step in turn, then release; the meter closes whatever happens."""
        self.meter.mark("submitted", scheduled_start(self.flow_run))
        self.meter.mark("picked", now())
        try:
            self._take()
            ending = await self._live()
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await self._leave()
            raise
        except Exception as exc:
            if isinstance(exc, Ends):
                ending = exc.ending
            elif isinstance(exc, ObjectNotFound) and await self._gone_from_prefect():
                # Deleted while this worker had it: nothing is left in Prefect to tell, and no later try
                # would find it; what it held goes back now.
                self._signal_started(RuntimeError(GONE))
                with anyio.CancelScope(shield=True):
                    await self.release(None)
                return None
            elif transient(exc) and self.holding is not None and self.infrastructure is not None:
                # The work ran; only Prefect did not answer. The ledger keeps the run, and this host's
                # next sweep for runs no worker owns (every heartbeat) finishes its life.
                self.log.warning("The Prefect API failed (%s: %s); this run is finished from the ledger later",
                                 type(exc).__name__, exc)
                self._let_go()
                return None
            elif transient(exc):
                ending = endings.HANDED_BACK.saying(f"The Prefect API failed ({type(exc).__name__}: {exc}); "
                                                    "rescheduled.", QUOTA_RETRY.total_seconds())
            else:
                self.log.exception("The e31 worker failed while living this job")
                ending = endings.WORKER_FAILED.saying(f"The e31 worker failed: {type(exc).__name__}: {exc}")
            self._signal_started(RuntimeError(ending.message))
            with anyio.CancelScope(shield=True):
                try:
                    await self._set_state(ending)
                except ObjectNotFound:
                    self.log.warning("The run's state could not be set to %s: %s", ending.name, GONE)
                except Exception as unset:
                    self.log.error("The run's state could not be set to %s: %s", ending.name, unset)
        self._signal_started(RuntimeError("The run ended before it started."))
        with anyio.CancelScope(shield=True):
            await self.release(ending)
        return ending

    async def _live(self) -> Ending | None:
        job = self.admit()
        runtime = runtime_for(job, self.worker, self.configuration)
        await self.check(job, runtime)
        async with self.output_disk():
            await self.stage(job)
            async with AsyncExitStack() as held:
                if runtime.loads_before_rent:  # nothing of the job's in it until the hand-over; nothing held
                    supervisor = await held.enter_async_context(self.prepare(job, runtime, []))
                    rental = await held.enter_async_context(self.rent(job, runtime))
                else:  # the job's own code from its start (a container's image): rented first, billed from then
                    rental = await held.enter_async_context(self.rent(job, runtime))
                    self.meter.mark("rented", now())
                    self._save()
                    supervisor = await held.enter_async_context(self.prepare(job, runtime, rental.devices))
                await self.hand_over(job, supervisor, rental)
                await held.enter_async_context(self.watching(supervisor, labelled=True))
                record = await supervisor.wait()
            runtime.ended()
            if record is not None and record.ending == "not-started" and self.start_error:
                record.message = self.start_error
            self.log.info("Work ended (%s, exit code %s); devices %s back in the pool",
                          record.ending if record else "no record", record.exit_code if record else "?",
                          [d.index for d in self.devices] or "none")
            if (lost := await self.lost_here(record)) is not None:
                return lost  # its fence stopped it: this host was cut off
            if not await self.still_ours():
                return self.stand_down()  # requeued while this worker was cut off or stopped
            return await self.after_work(job, record, runtime.died)

    async def _leave(self) -> None:
        """The worker is stopping: a rented run stays with its supervisor (the next worker adopts it);
        one not rented yet goes back to the pool."""
        self._detached = True
        if self.holding is not None:
            self.log.info("This worker is stopping: the run stays with its supervisor for the next e31 worker")
            return
        self.worker.meters.pop(self.run_id, None)
        remove_workspace(self.workspace)
        with contextlib.suppress(Exception):
            await self._set_state(endings.HANDED_BACK.saying("The e31 worker that took it stopped; rescheduled."))

    # -- admit ------------------------------------------------------------------------------------

    def admit(self) -> Job:
        """The valid job, if it can still meet its deadline; else the run is refused (nothing rented)."""
        assert self.configuration is not None
        try:
            job, unused = admitted(self.configuration, self.worker.settings.allowed_volumes)
            team = quotas.team_by_queue(self.worker.settings.queue_teams, self.flow_run.work_queue_name, job.team)
        except RunRefused as exc:  # every problem of the run at once: its job's and its settings'
            raise Ends(endings.INVALID_JOB.saying(str(exc))) from None
        except ValueError as exc:
            raise Ends(endings.INVALID_JOB.saying("The job is not valid:\n" + str(exc))) from None
        job = job.model_copy(update={"team": team})
        unshardable = shards.entrypoint_problem(job.work.shards, getattr(self.configuration, "entrypoint", None),
                                                COMMAND_FLOW_ENTRYPOINT, FLOW_SHARDS_ENTRYPOINT)
        if unshardable:
            raise Ends(endings.INVALID_JOB.saying("The job is not valid:\n" + unshardable))
        self.job_name = job.name
        self.meter.gpus, self.meter.team = job.request.gpus, job.team
        if unused:
            self.log.warning("Container settings a process job does not use: %s", "; ".join(map(str, unused)))
        try:
            pool = {name: getattr(self.configuration, name, None)
                    for name in ("default_disk", "max_output_files", "output_send_seconds")}
            self.bounds = output_bounds.bounds_for(job.request.disk, **pool)
        except ValueError as exc:
            raise Ends(endings.INVALID_JOB.saying(f"The run's worker settings are not valid:\n{exc}")) from None
        self._destination(job)  # a destination the run may not write ends it here, before anything is held
        code = getattr(self.configuration, "code_mount", lambda: None)() if job.work.image else None
        home = self.worker.settings.home.expanduser().resolve()
        if code is not None and (home == code.resolve() or code.resolve() in home.parents):
            # A process job is shown its own workspace there and nothing else (e31_prefect.host.sandbox); a
            # container is given the whole folder, and one run as root would read every run's files in it.
            raise Ends(endings.INVALID_JOB.saying(
                f"The job's code folder {code}, which its container sees, holds this worker's E31_HOME ({home}): "
                "every run's workspace and kept outputs are there. Move E31_HOME out of it (set E31_HOME on the "
                "worker), or the job's files into a folder of their own. No GPU was rented."))
        deadline = timing.job_deadline(job.request.deadline, job.request.start, scheduled_start(self.flow_run), job.tz)
        latest = timing.latest_start(deadline, job.admission_duration)
        # A run the poll took on its predicted length (e31_prefect.model.prediction) is judged on it here too.
        latest = self.worker.admitted_latest.get(self.run_id, latest) if latest is not None else None
        if latest is not None and now() > latest:
            self.report.step("deadline-missed", latest_start=latest.isoformat())
            raise Ends(endings.DEADLINE_MISSED.saying(
                f"Deadline missed: the run had to start by {latest.isoformat()} to finish by "
                f"{deadline.isoformat() if deadline else '?'}; it is now {now().isoformat(timespec='seconds')}. "
                "No GPU was rented."))
        return job

    async def check(self, job: Job, runtime: Runtime) -> None:
        """The host can run the job (its container engine answers), before anything is staged or rented."""
        problem = await runtime.check()
        if problem is not None and job.work.image:
            raise Ends(endings.NO_CONTAINER_ENGINE.saying(
                f"The job runs in image {job.work.image!r} but {problem}; run it where Docker runs, or remove "
                "work.image to run it as a local process. No GPU was rented."))
        if problem is not None:
            raise Ends(endings.HOST_CANNOT_RUN.saying(f"This host cannot run the job: {problem}. No GPU was rented."))

    # -- stage ------------------------------------------------------------------------------------

    async def stage(self, job: Job) -> None:
        """Copy the job's data into its workspace, verified and read-only, before any GPU is held."""
        (self.workspace / "output").mkdir(parents=True, exist_ok=True)
        try:
            self.storage = await load_job_storage(job.storage, job.team) if job.storage else None
            self.options = self.storage.fsspec_options() if self.storage else None
            roots = self._file_roots(job)
            if self.worker.at_keyboard:  # e31 run: the one who submits runs the host (e31_prefect.data.keyboard)
                roots = keyboard.widened_roots([item.source for item in job.data], roots, self.log)
            stage = functools.partial(stage_inputs, roots=roots, team=job.team)
            staged = await anyio.to_thread.run_sync(stage, job.data, self.workspace / "data", self.options,
                                                    self.log, abandon_on_cancel=True)
        except (StagingError, StorageBlockError) as exc:
            raise Ends(endings.STAGING_FAILED.saying(f"Staging failed before any GPU was rented: {exc}")) from None
        self.meter.mark("staged", now())
        self.report.step("staged", files=staged.files, bytes=staged.bytes, seconds=round(staged.seconds, 3))

    # -- rent -------------------------------------------------------------------------------------

    @asynccontextmanager
    async def rent(self, job: Job, runtime: Runtime) -> AsyncIterator[Rental]:
        """Hold the job's devices and quota slots, and write its ledger entry (the meter starts at the
        hand-over, a moment later where the work was prepared first).

        On leaving, the devices and slots go back (the devices are free on the host once the
        supervisor, which holds their locks too, has ended). A worker that is stopping keeps the
        slots' lease for the worker that adopts the run.
        """
        if not await self.still_ours():  # this worker was cut off or stopped as the run loaded: the pool requeued it
            raise Ends(self.stand_down())
        inventory = self.worker.inventory
        # From what is free now: the run held nothing as its work loaded. None fits: back to the pool, unbilled.
        devices = inventory.choose(self.run_id, job.request.gpus, job.request.gpu_type)
        if devices is None or not inventory.hold(self.run_id, devices):
            when = " when its work was ready (rented to others as it loaded)" if runtime.loads_before_rent else ""
            raise Ends(endings.HANDED_BACK.saying(
                f"No {job.request.gpus} free GPU(s) on worker {self.worker.name!r}{when}; nothing of it ran and "
                "nothing was billed. Rescheduled."))
        try:
            self.lease = await self._acquire(job, len(devices))
            self.devices = devices
            self.meter.devices = [d.index for d in devices]
            self.worker.rented(self.run_id, now())
            self._write_holding(job, runtime, None)
            yield Rental(devices)
        except anyio.get_cancelled_exc_class():
            self._detached = True  # the worker is stopping: the lease stays for the worker that adopts the run
            raise
        finally:
            self.worker.return_devices(self.run_id)
            if not self._detached:
                await self._release_lease()

    async def _acquire(self, job: Job, gpus: int) -> UUID | None:
        names = quotas.limit_names(self.worker._work_pool_name, job.team)
        try:
            return await quotas.acquire(self.worker.client, names, gpus, self.run_id)
        except quotas.QuotaFull as exc:
            raise Ends(endings.HANDED_BACK.saying(f"Quota full: {exc}; rescheduled.",
                                                  QUOTA_RETRY.total_seconds())) from None
        except quotas.OverQuota as exc:
            raise Ends(endings.OVER_QUOTA.saying(f"Over quota: {exc}; raise it with `e31 quota set` or ask for "
                                                 "fewer GPUs. No GPU was rented.")) from None

    async def _release_lease(self) -> None:
        if self.lease is not None:
            lease, self.lease = self.lease, None
            with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                await quotas.release(self.worker.client, lease)

    def _take(self) -> None:
        """Own the run's ledger folder from the start: a worker that dies before renting leaves a run that
        the next worker hands back to the pool, instead of one Prefect keeps Pending for ever."""
        if self._owner is None:
            self._owner = self.folder.own()  # before the entry exists: no other worker takes it for an orphan
        if self.folder.holding() is None:
            pid, started = this_process()
            self.folder.write_holding(Holding(flow_run_id=str(self.run_id), worker_pid=pid, worker_started=started,
                                              job_name=self.job_name, devices=[], workspace=str(self.workspace),
                                              host=self.worker.settings.host_name, taken=self.taken,
                                              attempt=self.attempt))

    def _write_holding(self, job: Job, runtime: Runtime, stop_at: datetime | None) -> None:
        pid, started = this_process()
        self.holding = Holding(
            flow_run_id=str(self.run_id), worker_pid=pid, worker_started=started, job_name=job.name,
            devices=[d.index for d in self.devices], workspace=str(self.workspace),
            job=job.model_dump(mode="json", by_alias=True), pool=self.worker._work_pool_name,
            destination=self._destination(job), lease=str(self.lease) if self.lease else None,
            runtime=runtime.name, gpus=len(self.devices), team=job.team, storage=job.storage,
            stop_at=stop_at.isoformat() if stop_at else None,
            output_bounds=dataclasses.asdict(self.bounds) if self.bounds else {}, host=self.worker.settings.host_name,
            taken=self.taken, attempt=self.attempt)
        self._save()

    def _save(self) -> None:
        """Rewrite the ledger entry with the meter so far."""
        if self.holding is not None:
            self.holding.marks = {step: at.isoformat() for step, at in self.meter.marks.items()}
            self.folder.write_holding(self.holding)

    # -- run --------------------------------------------------------------------------------------

    @asynccontextmanager
    async def prepare(self, job: Job, runtime: Runtime, devices: list[Device]) -> AsyncIterator[Supervisor]:
        """Start the run's supervisor and its work (a container through the runtime), which loads Prefect
        and waits to be handed its devices. Leaving before the hand-over ends the work, unbilled."""
        assert self.configuration is not None
        placement = Placement(str(self.run_id), job, devices, self.workspace, self.folder, self.configuration,
                              self.worker.settings)
        spec = runtime.spec(placement)
        if self.bounds is not None and not os.path.ismount(placement.output_dir):
            # No disk of its own: its supervisor counts the output dir, whether or not this worker lives.
            spec.output_dir, spec.output_max_entries = str(placement.output_dir), self.bounds.max_files
            spec.output_max_bytes = self.bounds.disk_bytes
        supervisor = await Supervisor.start(self.folder, spec)
        try:
            try:
                await runtime.start(placement, supervisor)
            except Exception as exc:
                self.log.error("The work could not be started: %s: %s", type(exc).__name__, exc)
                self.start_error = f"{type(exc).__name__}: {exc}"  # the run's state quotes it (the engine's error)
                supervisor.let_go()  # nothing to wait for: its supervisor ends whatever was made
            record: Record | None = None
            with anyio.move_on_after(READY_SECONDS):
                record = await supervisor.ready()
            if record is None or record.finished:
                why = self.start_error or (record and record.message) or f"it did not say ready in {READY_SECONDS} s"
                raise Ends(never_ready(why, "rented" in self.meter.marks, output_tail(self.folder.output_log)))
            self.meter.mark("ready", datetime.fromisoformat(record.ready or record.started or now().isoformat()))
            yield supervisor
        finally:
            if supervisor.control is not None:  # never handed over: its supervisor ends the work as it waits
                supervisor.let_go()
                with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                    await supervisor.wait()

    async def hand_over(self, job: Job, supervisor: Supervisor, rental: Rental) -> None:
        """Hand the rented devices to the waiting work: the meter starts, the time limit counts from here,
        and its supervisor holds the devices whatever becomes of this worker."""
        self.meter.mark("rented", now())
        deadline = timing.job_deadline(job.request.deadline, job.request.start, scheduled_start(self.flow_run), job.tz)
        stop_at = timing.stop_at(now(), job.request.time_limit, deadline)
        if stop_at is not None:
            self.worker.holds_until[self.run_id] = stop_at
        assert self.holding is not None
        self.holding.stop_at = stop_at.isoformat() if stop_at else None
        self._save()  # before the hand-over: a worker that dies next leaves a run its adopter resumes
        supervisor.hand_over(hand_over_environment(rental.devices, self.worker.settings.report_seconds), stop_at,
                             self.meter.marks["rented"], self.worker.inventory.lock_files(self.run_id),
                             gpu_minors(rental.devices))
        self.report.step("rented", rental.devices, gpus=len(rental.devices), devices=[d.index for d in rental.devices])
        record = await supervisor.started()
        if record.started:
            self._on_started(record)

    def _on_started(self, record: Record) -> None:
        self.infrastructure = record.infrastructure
        assert record.started
        self.meter.mark("running", datetime.fromisoformat(record.started))
        self._save()
        for note in record.notes:
            self.log.warning("Supervisor: %s", note)
        self.report.step("running", self.devices, infrastructure=str(record.infrastructure))
        self._signal_started(infrastructure_id(self.run_id, self.worker.settings.host_name))

    # -- release ----------------------------------------------------------------------------------

    async def _set_state(self, ending: Ending | None) -> State | None:
        """Give the run the state of ``ending`` (saying why where it is not Completed); the state set, if any."""
        if ending is None or self.superseded:  # an attempt the pool requeued says nothing of the run
            return None
        if ending.handed_back:
            self.log.warning(ending.message)
        elif ending.state.value != "COMPLETED":
            self.log.error(ending.message)
        return await self.report.end(ending)

    async def release(self, ending: Ending | None) -> None:
        """Close the meter (tags, artifacts, event), forget the ledger entry, remove the workspace.

        A run handed back to the pool is not closed: it has not ended. The meter's record in Prefect
        is retried until the API answers; if the worker stops first, the ledger keeps it for the next.
        """
        if ending is not None and ending.handed_back:
            self.worker.meters.pop(self.run_id, None)
            self._forget()
            return
        self.meter.mark("released", now())
        if "rented" in self.meter.marks:
            # Work that never started stopped billing when its devices went back.
            self.meter.mark("run_ended", self.meter.marks["released"])
        self._save()
        if self.worker._only_flow_run_ids is None:
            # A long-lived worker keeps no meter in memory once it is recorded in Prefect.
            self.worker.meters.pop(self.run_id, None)
        sent_or_kept = "output" in self.meter.marks or (ending is not None and ending.is_(endings.OUTPUT_NOT_SENT))
        outputs = self.holding.destination if self.holding and sent_or_kept else None
        if not await self._close(ending, outputs):
            return
        self.report.step("released", self.devices, billed_seconds=round(self.meter.billed_seconds, 3),
                         billed_gpu_seconds=round(self.meter.billed_gpu_seconds, 3), gpus=self.meter.gpus)
        self._forget()

    def _let_go(self) -> None:
        """Give up the run's owner lock, leaving its ledger folder for a worker's sweep to adopt."""
        if self._owner is not None:
            os.close(self._owner)
            self._owner = None

    def _forget(self) -> None:
        """The run is done here: its ledger folder, owner lock and workspace go."""
        self.worker.ledger.forget(str(self.run_id))
        if self._owner is not None:
            os.close(self._owner)
            self._owner = None
        if not self.worker.settings.keep_workspaces:
            remove_workspace(self.workspace)
        else:
            disk.unmount_under(self.workspace)  # a kept workspace keeps its image file, not a loop device

    async def _close(self, ending: Ending | None, outputs: str | None) -> bool:
        for pause in (*CLOSE_RETRY_SECONDS, None):
            try:
                await self.report.close(self.meter, self.job_name, ending.event if ending else None, outputs,
                                        self.after_work_run)
                return True
            except ObjectNotFound:
                # A 404 is no outage: the run was deleted, and the ledger would keep its meter for nobody.
                self.log.warning("The meter is not recorded in Prefect: %s", GONE)
                return True
            except Exception as exc:
                if pause is None:
                    self.log.error("The meter could not be recorded in Prefect (%s); the ledger keeps it for the "
                                   "next e31 worker on this host", exc)
                    return False
                await anyio.sleep(pause)
        return False

    def _signal_started(self, value: str | Exception) -> None:
        # Prefect's worker waits for this signal once: the infrastructure id, or an exception
        # saying no infrastructure started.
        if not self._started:
            self._started = True
            self.task_status.started(value)
