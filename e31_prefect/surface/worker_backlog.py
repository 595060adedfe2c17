"""The pool's backlog as the e31 worker reads it: the waiting runs, each evaluated as a job, planned together.

:class:`BacklogReading` is a part of :class:`e31_prefect.surface.worker.E31Worker`.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any
from uuid import UUID

from prefect.client.schemas.objects import FlowRun
from prefect.exceptions import ObjectNotFound

from e31_prefect.model import attempts, endings, timing
from e31_prefect.model.job import Job
from e31_prefect.model.job_values import job_name
from e31_prefect.model.meter import Meter
from e31_prefect.planning import backlog
from e31_prefect.planning.backlog_watch import Page
from e31_prefect.planning.scheduling import WaitingRun, plan
from e31_prefect.surface import inventories, plan_artifact, quotas, reporting
from e31_prefect.surface.life_terms import scheduled_start

if TYPE_CHECKING:
    from prefect.client.schemas.objects import WorkQueue
    from prefect.client.schemas.responses import DeploymentResponse, WorkerFlowRunResponse


LOWEST_QUEUE_PRIORITY = 2**31  # a run whose work queue is unknown goes after every known queue's
DEPLOYMENT_READS_AT_ONCE = 8  # a backlog from many deployments reads them together, not all at one instant


class BacklogReading:
    """The part of :class:`e31_prefect.surface.worker.E31Worker` that reads and plans the pool's backlog."""

    async def _pool_plan(self, waiting: dict[UUID, tuple[WaitingRun, str, str | None]],
                         responses: list[WorkerFlowRunResponse]) -> tuple[list[dict[str, str]], Any]:
        """The pool's plan artifact rows (its waiting runs over the live workers' published devices), and
        how to write them."""
        hosts = await inventories.read(self.client, self._work_pool_name)
        now = datetime.now(timezone.utc)
        planned = plan([run for run, _, _ in waiting.values()], [(h.free, h.busy) for h in hosts], now)
        names = {r.flow_run.id: (attempts.shown_name(r.flow_run.name, r.flow_run.labels), waiting[r.flow_run.id][1])
                 for r in responses if r.flow_run.id in waiting}
        return plan_artifact.table(planned, names), functools.partial(
            plan_artifact.write, self.client, self._work_pool_name, now=now)

    def _due_by(self) -> datetime:
        """The latest scheduled start a poll takes: now and Prefect's prefetch."""
        return datetime.now(timezone.utc) + timedelta(seconds=int(self._prefetch_seconds))

    async def _backlog(self, queues: dict[UUID, WorkQueue] | None,
                       page: Page | None = None) -> list[WorkerFlowRunResponse]:
        """Every due run of the pool's (or this worker's) work queues: kept between polls where the pool's
        events are followed (:mod:`e31_prefect.planning.backlog_watch`), else read page by page
        (:mod:`e31_prefect.planning.backlog`).

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
        deadline = timing.job_deadline(job.request.deadline, job.request.start, scheduled, job.tz)
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
        report = reporting.JobReport(self.client, flow_run, [], self.settings.host_name)
        message = (f"Deadline missed: the run had to start by {latest.isoformat() if latest else '?'} "
                   f"to finish in time; it is now {now.isoformat(timespec='seconds')}. No GPU was rented.")
        report.step("deadline-missed", latest_start=str(latest), now=now.isoformat())
        await report.end(endings.DEADLINE_MISSED.saying(message))
        meter = Meter(team=team)
        meter.mark("submitted", scheduled_start(flow_run))
        meter.mark("released", now)
        await report.close(meter, job_name, endings.DEADLINE_MISSED.event, None)
        self.get_flow_run_logger(flow_run).warning(message)
