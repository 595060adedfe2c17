"""A backlog bigger than Prefect's page: the worker ranks every waiting run, not the first 200.

Runs the real ``e31 submit`` and ``prefect worker start --run-once`` against a real Prefect server.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from uuid import UUID, uuid4

import pytest
from prefect import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterNextScheduledStartTime,
    FlowRunFilterState,
    FlowRunFilterStateName,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.schedules import RRuleSchedule
from prefect.states import Scheduled

from e31_prefect.host.settings import E31Settings
from e31_prefect.surface.worker import E31Worker
from tests.integration.conftest import cli, flow_run_id
from tests.integration.test_jobs_end_to_end import MARK_FLOW, mark_job, read_run, write_job

pytestmark = pytest.mark.integration

BACKLOG = 250  # more than the server's page (PREFECT_SERVER_API_DEFAULT_LIMIT, 200)

def make_runs(deployment_id: UUID, count: int) -> None:
    """``count`` more runs of the deployment, all due, one a second over the past minutes, made in one call by
    Prefect's backfill route (the scheduler's bulk insert) from a schedule added for it: one by one, a few
    hundred runs take minutes of a loaded server. The schedule has exactly ``count`` dates, all past: an open
    interval schedule let Prefect's scheduler add runs due in the next seconds before it was paused, and those
    fell due during a test. It is then paused, not deleted: deleting it deletes the runs it made.

    Returns once Prefect has marked every run of the deployment Late (:func:`wait_until_all_late`)."""
    now = datetime.now(timezone.utc)
    start = (now - timedelta(seconds=count + 30)).replace(microsecond=0)  # the rrule counts whole seconds
    due = FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]),
                        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
                        next_scheduled_start_time=FlowRunFilterNextScheduledStartTime(before_=now))
    with get_client(sync_client=True) as client:
        before = client.count_flow_runs(flow_run_filter=due)
        schedule, = client.create_deployment_schedules(
            deployment_id, [(past_seconds(start, count), True)])
        try:
            client.request("POST", "/deployments/{id}/schedule", path_params={"id": deployment_id},
                           json={"start_time": start.isoformat(), "end_time": now.isoformat(), "max_runs": count})
        finally:
            client.update_deployment_schedule(deployment_id, schedule.id, active=False)
        made = client.count_flow_runs(flow_run_filter=due) - before
    assert made == count, f"the backfill made {made} runs, not {count}"
    wait_until_all_late(deployment_id)


def wait_until_all_late(deployment_id: UUID, timeout: float = 600) -> None:
    """Wait for Prefect's late-runs service to mark every waiting run of the deployment Late.

    It marks each due run in a transaction of its own. On SQLite (the README's test command; CI runs
    PostgreSQL) a commit between a request's read and its write fails that request at once ("database is
    locked", answered 503), and on a loaded machine marking a 250-run backlog took minutes, past the Prefect
    client's five retries (about a minute of back-off): `e31 submit` failed on POST /api/deployments/.
    Waited out here, the test's next calls find a quiet server, and no run changes state between two of a
    worker's polls."""
    not_late = FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]),
                             state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]),
                                                      name=FlowRunFilterStateName(not_any_=["Late"])))
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while (left := client.count_flow_runs(flow_run_filter=not_late)) > 0:
            assert time.monotonic() < deadline, f"{left} runs of the backlog still not Late after {timeout:.0f} s"
            time.sleep(1)


def past_seconds(start: datetime, count: int) -> RRuleSchedule:
    """A schedule of ``count`` dates one second apart from ``start``, and none after."""
    return RRuleSchedule(rrule=f"DTSTART:{start:%Y%m%dT%H%M%SZ}\nRRULE:FREQ=SECONDLY;COUNT={count}")


def relaxed_backlog(tmp_path: Path, pool: str) -> UUID:
    """BACKLOG runs of a relaxed job (its deadline 8 h away) waiting in ``pool``: one by ``e31 submit``, the rest
    of the batch by :func:`make_runs`; returns their deployment's id."""
    relaxed = mark_job(tmp_path / "relaxed", "relaxed", deadline="+8h")
    submitted = cli("e31", "submit", str(relaxed), "--pool", pool)
    assert submitted.returncode == 0, submitted.stderr
    with get_client(sync_client=True) as client:
        deployment_id = client.read_flow_run(flow_run_id(submitted.stdout)).deployment_id
    make_runs(deployment_id, BACKLOG - 1)
    return deployment_id


def test_a_run_submitted_behind_a_full_page_with_the_earliest_deadline_starts_first(prefect_server, tmp_path: Path,
                                                                                      pool):
    urgent = mark_job(tmp_path / "urgent", "urgent", deadline="+30m")
    deployment_id = relaxed_backlog(tmp_path, pool)
    submitted = cli("e31", "submit", str(urgent), "--pool", pool)  # last: behind the whole page
    assert submitted.returncode == 0, submitted.stderr
    urgent_id = flow_run_id(submitted.stdout)

    worker = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once", gpus="1xH100")

    assert worker.returncode == 0, worker.stdout + worker.stderr
    assert read_run(urgent_id).state.is_completed()
    assert (tmp_path / "urgent" / "out" / "ran").exists()
    with get_client(sync_client=True) as client:
        still_waiting = client.count_flow_runs(flow_run_filter=FlowRunFilter(
            deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))))
    assert still_waiting == BACKLOG  # the worker's one GPU went to the urgent run
    assert not (tmp_path / "relaxed" / "out").exists()


def test_a_poll_evaluates_again_only_the_runs_that_changed(prefect_server, tmp_path: Path, pool):
    job = write_job(tmp_path / "relaxed", """
        name: relaxed
        work: {flow: flow.py:mark}
        request: {gpus: 1, max_duration: 10m, deadline: +8h}
        """, flow=MARK_FLOW)
    submitted = cli("e31", "submit", str(job), "--pool", pool)
    assert submitted.returncode == 0, submitted.stderr
    with get_client(sync_client=True) as client:
        deployment_id = client.read_flow_run(flow_run_id(submitted.stdout)).deployment_id
        ids = [flow_run_id(submitted.stdout)] + [client.create_flow_run_from_deployment(deployment_id).id
                                                 for _ in range(4)]
    wait_until_late(ids)  # Prefect marks due runs Late once: a change of state, so wait for it first

    async def polls() -> list[list[UUID]]:
        async with E31Worker(work_pool_name=pool) as worker:
            evaluated: list[UUID] = []
            evaluate = worker._evaluate

            async def counting(flow_run, deployment, jobs):
                evaluated.append(flow_run.id)
                return await evaluate(flow_run, deployment, jobs)

            worker._evaluate = counting
            rounds = []
            for change in (None, None, ids[2]):
                if change is not None:
                    await worker.client.set_flow_run_state(change, Scheduled(), force=True)
                evaluated.clear()
                waiting = await worker.read_waiting()
                assert set(waiting) == set(ids)
                rounds.append(list(evaluated))
            return rounds

    first, unchanged, one_changed = asyncio.run(polls())
    assert sorted(first) == sorted(ids)
    assert unchanged == []
    assert one_changed == [ids[2]]


def test_a_pools_worker_keeps_its_backlog_and_learns_of_a_new_urgent_run_from_prefects_events(
        prefect_server, tmp_path: Path, pool):
    relaxed_backlog(tmp_path, pool)
    urgent = mark_job(tmp_path / "urgent", "urgent", deadline="+30m")
    settings = E31Settings(gpus="1xH100", device_locks=tmp_path / "locks", home=tmp_path / "e31",
                           backlog_heal_seconds=3600,  # no full read again during the test: events or nothing
                           queue_teams={"default": "vision"})

    async def serve() -> tuple[list[str], list[UUID], UUID]:
        async with E31Worker(work_pool_name=pool, settings=settings) as worker:
            elsewhere = uuid4()
            assert worker.inventory.hold(elsewhere, worker.inventory.free())  # its one GPU busy for now
            await worker.follow_backlog()
            assert worker.backlog_watch is not None and worker.backlog_watch.following
            assert await worker.get_and_submit_flow_runs() == []  # the first poll reads the whole backlog
            asked: list[str] = []

            async def note(request) -> None:
                asked.append(f"{request.method} {request.url.path}")

            worker.client._client.event_hooks["request"].append(note)
            assert await worker.get_and_submit_flow_runs() == []
            second_poll = list(asked)
            # Kept between polls, every waiting run is still there.
            assert len(await worker.read_waiting()) == BACKLOG
            done = await asyncio.to_thread(cli, "e31", "submit", str(urgent), "--pool", pool)
            assert done.returncode == 0, done.stderr
            urgent_id = flow_run_id(done.stdout)
            deadline = time.monotonic() + 60
            while urgent_id not in {r.flow_run.id for r in worker.backlog_watch.kept.runs()}:
                assert time.monotonic() < deadline, "the new run's event never came"
                assert await worker.get_and_submit_flow_runs() == []
                await asyncio.sleep(0.5)
            worker.inventory.give_back(elsewhere)
            started = await worker.get_and_submit_flow_runs()
            return second_poll, [run.id for run in started], urgent_id

    second_poll, started, urgent_id = asyncio.run(serve())
    # With every run evaluated and nothing changed, a poll reads one page, as Prefect's own worker does, not
    # the backlog's two.
    assert [path for path in second_poll if "flow_runs" in path] == \
        [f"POST /api/work_pools/{pool}/get_scheduled_flow_runs"], second_poll
    # Submitted after the whole backlog was read and behind a full page of earlier runs, the urgent run is
    # known from its event and starts first.
    assert started == [urgent_id]
    assert read_run(urgent_id).state.is_completed()
    assert "e31:team=vision" in read_run(urgent_id).tags  # metered to its work queue's team
    assert (tmp_path / "urgent" / "out" / "ran").exists()


def wait_until_late(ids: list[UUID], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            if all(client.read_flow_run(run_id).state.name == "Late" for run_id in ids):
                return
            time.sleep(1)
    raise AssertionError("Prefect never marked the runs Late")


def test_queue_lists_every_waiting_run_with_its_planned_start_and_whether_it_meets_its_deadline(
        prefect_server, tmp_path: Path, pool):
    # A worker with one H100 comes online, publishes its inventory, finds nothing due and exits; it counts as
    # live for three heartbeat intervals, as Prefect says of any worker.
    worker = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once", gpus="1xH100",
                 env={"PREFECT_WORKER_HEARTBEAT_SECONDS": "600"})
    assert worker.returncode == 0, worker.stdout + worker.stderr
    for name, deadline in (("third", "+8h"), ("second", "+105m"), ("first", "+90m")):
        job = mark_job(tmp_path / name, name, deadline=deadline, max_duration="1h")
        submitted = cli("e31", "submit", str(job), "--pool", pool)
        assert submitted.returncode == 0, submitted.stderr
    # The last one submitted has the earliest deadline: e31 submit says it goes first, and by when it must.
    assert "  latest start: " in submitted.stdout, submitted.stdout
    assert "  planned start: " in submitted.stdout and "behind 0 run(s) on 1 live worker(s)" in submitted.stdout

    shown = cli("e31", "queue", "--pool", pool)

    assert shown.returncode == 0, shown.stdout + shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == "1 live worker(s), 1 GPU(s), 1 free now; 3 waiting run(s)", shown.stdout
    rows = [line.split() for line in lines[2:]]
    # [run, job, gpus, start date, start time, finish date, finish time, latest date, latest time, meets,
    #  planned for (2 words), basis (words)]
    assert [(row[1], row[9]) for row in rows] == [("first", "yes"), ("second", "no"), ("third", "yes")]
    first = rows[0]
    assert (datetime.fromisoformat(f"{first[5]}T{first[6]}") - datetime.fromisoformat(f"{first[3]}T{first[4]}")
            == timedelta(hours=1))
    assert rows[1][3:5] == first[5:7]  # the second waits for the first's hour on the one GPU


def test_a_run_awaiting_a_retry_in_its_own_process_is_no_workers_to_take(prefect_server, tmp_path: Path, pool):
    """A flow that fails with retries left waits in Scheduled (AwaitingRetry) for its own process to run it
    again; a worker that took it would start the work a second time, billed again (Prefect's worker endpoint
    skips it; e31 reads its kept backlog through the flow-run filter too)."""
    from prefect.states import Failed, Running

    from e31_prefect.planning import backlog

    job = mark_job(tmp_path / "retrying", "retrying")
    result = cli("e31", "submit", str(job), "--pool", pool)
    assert result.returncode == 0, result.stdout + result.stderr
    retrying = flow_run_id(result.stdout)
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(retrying)
        other = client.create_flow_run_from_deployment(run.deployment_id, state=Scheduled())
        client.update_flow_run(retrying, empirical_policy={"retries": 1, "retry_delay": 0})
        client.set_flow_run_state(retrying, Running())
        answer = client.set_flow_run_state(retrying, Failed())
        assert client.read_flow_run(retrying).state.name == "AwaitingRetry", answer

    async def read() -> tuple[set[UUID], set[UUID]]:
        async with get_client() as client:
            whole = await backlog.read_backlog(client, pool, ["default"], None)
            asked = await backlog.read_waiting_ids(client, pool, [retrying, other.id])
        return {r.flow_run.id for r in whole}, {r.flow_run.id for r in asked}

    whole, asked = asyncio.run(read())
    assert other.id in whole and other.id in asked
    assert retrying not in whole and retrying not in asked
