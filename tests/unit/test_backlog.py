"""Paging through a whole backlog with a cursor, and evaluations kept while a run is unchanged."""

from __future__ import annotations

import asyncio
import random
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from uuid import UUID, uuid4

import pytest
from prefect.events import Event

from e31_prefect.planning.backlog import Evaluations, KeptBacklog, page_through
from e31_prefect.planning.backlog_watch import WatchedBacklog

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def waiting(times: list[datetime]) -> list[SimpleNamespace]:
    """Scheduled runs (as the worker endpoint answers them) at ``times``, in the endpoint's order."""
    runs = [SimpleNamespace(flow_run=SimpleNamespace(id=uuid4(), next_scheduled_start_time=t)) for t in times]
    return sorted(runs, key=lambda r: r.flow_run.next_scheduled_start_time)


def server(runs: list[SimpleNamespace], size: int):
    """The two reads over ``runs`` as Prefect answers them; also counts the calls."""
    calls = []

    async def after(cursor: datetime | None) -> list[SimpleNamespace]:
        calls.append(("after", cursor))
        return [r for r in runs if cursor is None or r.flow_run.next_scheduled_start_time >= cursor][:size]

    async def at(moment: datetime, offset: int) -> list[SimpleNamespace]:
        calls.append(("at", moment, offset))
        tied = sorted((r for r in runs if r.flow_run.next_scheduled_start_time == moment),
                      key=lambda r: r.flow_run.id, reverse=True)
        return tied[offset:offset + size]

    return after, at, calls


def ids(responses: list[SimpleNamespace]) -> list[UUID]:
    return [r.flow_run.id for r in responses]


def test_every_run_of_a_backlog_larger_than_a_page_is_read_once():
    runs = waiting([T0 + timedelta(seconds=i) for i in range(450)])
    after, at, calls = server(runs, size=200)
    found = asyncio.run(page_through(after, at, size=200))
    assert sorted(ids(found)) == sorted(ids(runs))
    assert len(calls) == 3  # 200, 200 (from the last one's time), 50


def test_a_batch_bigger_than_a_page_at_one_instant_is_read_by_offset():
    runs = waiting([T0] * 5 + [T0 + timedelta(seconds=1)] * 450 + [T0 + timedelta(seconds=2)] * 3)
    after, at, _ = server(runs, size=200)
    found = asyncio.run(page_through(after, at, size=200))
    assert sorted(ids(found)) == sorted(ids(runs))


def test_a_short_first_page_is_the_only_call():
    runs = waiting([T0] * 3)
    after, at, calls = server(runs, size=200)
    assert len(asyncio.run(page_through(after, at, size=200))) == 3
    assert calls == [("after", None)]


@pytest.mark.parametrize("seed", range(200))
def test_paging_finds_every_run_whatever_the_ties(seed: int):
    rng = random.Random(seed)
    size = rng.randint(1, 7)
    seconds = [rng.randint(0, 6) for _ in range(rng.randint(0, 60))]
    runs = waiting([T0 + timedelta(seconds=s) for s in seconds])
    after, at, _ = server(runs, size=size)
    found = asyncio.run(page_through(after, at, size=size))
    assert sorted(ids(found)) == sorted(ids(runs))
    assert len(found) == len(set(ids(found)))


def test_an_evaluation_is_kept_while_its_version_holds():
    kept: Evaluations[str] = Evaluations()
    kept.keep("a", (1, "scheduled"), "evaluated")
    assert kept.get("a", (1, "scheduled")) == "evaluated"
    assert kept.get("a", (2, "scheduled")) is None  # the run was updated: evaluate it again
    assert kept.get("b", (1, "scheduled")) is None


def test_runs_gone_from_the_backlog_are_forgotten():
    kept: Evaluations[int] = Evaluations()
    for run_id in "abc":
        kept.keep(run_id, 0, 1)
    kept.retain(["b"])
    assert len(kept) == 1
    assert kept.get("a", 0) is None and kept.get("b", 0) == 1


# -- the backlog kept between polls ----------------------------------------------------------------

QUEUE = uuid4()


def run_response(run_id: UUID, state_type: str, at: float, name: str = "Scheduled", *,
                 queue: UUID = QUEUE, start: datetime | None = T0) -> SimpleNamespace:
    """A run as a read gives it: its state's type, name and time (seconds after T0), its work queue and its
    next scheduled start."""
    state = SimpleNamespace(type=SimpleNamespace(value=state_type), name=name, timestamp=T0 + timedelta(seconds=at))
    return SimpleNamespace(flow_run=SimpleNamespace(id=run_id, state=state, next_scheduled_start_time=start,
                                                    updated=state.timestamp, state_id=(state_type, name, at)),
                           work_queue_id=queue)


class Pool:
    """A pool's runs as the server holds them, each change an event delivered later (perhaps twice, out of
    order); reads of it as the worker makes them (a read sees each run at some moment while it lasts)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.now = 0.0
        self.runs: dict[UUID, tuple[str, str, float]] = {}  # run -> (state type, name, since)
        self.history: dict[UUID, list[tuple[float, str, str]]] = {}
        self.events: list[tuple[float, UUID, str, str, float]] = []  # (delivered at, run, type, name, at)

    def set(self, run_id: UUID, state_type: str, name: str) -> None:
        self.now += 1
        self.runs[run_id] = (state_type, name, self.now)
        self.history.setdefault(run_id, []).append((self.now, state_type, name))
        for _ in range(2 if self.rng.random() < 0.2 else 1):
            self.events.append((self.now + self.rng.uniform(0, 8), run_id, state_type, name, self.now))

    def seen(self, run_id: UUID, at: float) -> tuple[str, str, float] | None:
        """The run's state as a read at ``at`` saw it."""
        past = [entry for entry in self.history.get(run_id, []) if entry[0] <= at]
        return (past[-1][1], past[-1][2], past[-1][0]) if past else None

    def read(self, began: float, ended: float, ids: list[UUID] | None = None) -> list[SimpleNamespace]:
        """The scheduled runs (of ``ids``, or all) as a read lasting from ``began`` to ``ended`` saw them."""
        found = []
        for run_id in (ids if ids is not None else list(self.history)):
            state = self.seen(run_id, self.rng.uniform(began, ended))
            if state is not None and state[0] == "SCHEDULED":
                found.append(run_response(run_id, state[0], state[2], state[1]))
        return found

    def deliver(self, backlog: KeptBacklog, until: float) -> None:
        due = [event for event in self.events if event[0] <= until]
        self.events = [event for event in self.events if event[0] > until]
        for _, run_id, state_type, name, at in sorted(due, key=lambda e: (e[0], self.rng.random())):
            backlog.changed(run_id, state_type, name, T0 + timedelta(seconds=at), until)

    def waiting(self) -> set[UUID]:
        return {run_id for run_id, (state_type, _, _) in self.runs.items() if state_type == "SCHEDULED"}


def poll(pool: Pool, backlog: KeptBacklog, ended: float) -> None:
    """A poll's reads (after the events that came before it): the runs an event said changed, each seen at
    some moment of the read."""
    pool.now += 0.001
    began = pool.now
    changed = backlog.to_read()
    backlog.confirm(pool.read(began, ended, changed), began, asked=changed)


@pytest.mark.parametrize("seed", range(300))
def test_the_kept_backlog_is_the_pools_once_every_event_has_come(seed: int):
    rng = random.Random(seed)
    pool, backlog = Pool(rng), KeptBacklog()
    heal: tuple[float, float] | None = None  # a full read under way: (began, ends at)
    backlog.replace([], 0.0)
    for _ in range(rng.randint(1, 120)):
        action = rng.random()
        if action < 0.25 or not pool.runs:
            pool.set(uuid4(), "SCHEDULED", "Scheduled")
        elif action < 0.6:
            run_id = rng.choice(list(pool.runs))
            state_type, name, _ = pool.runs[run_id]
            if state_type == "SCHEDULED":
                pool.set(run_id, *rng.choice([("PENDING", "Pending"), ("SCHEDULED", "Late"), ("CANCELLED", "Cancelled"),
                                              ("SCHEDULED", "Scheduled")]))  # the last: moved to another time
                if pool.runs[run_id][0] == "PENDING" and rng.random() < 0.5:
                    backlog.drop(run_id, pool.now)  # this worker took it
            elif state_type == "PENDING":
                pool.set(run_id, *rng.choice([("RUNNING", "Running"), ("SCHEDULED", "Scheduled")]))
            elif state_type == "RUNNING":
                pool.set(run_id, *rng.choice([("COMPLETED", "Completed"), ("SCHEDULED", "AwaitingRetry")]))
        elif action < 0.8:
            pool.deliver(backlog, pool.now)
            poll(pool, backlog, pool.now + rng.uniform(0, 2))
        elif heal is None:
            heal = (pool.now, pool.now + rng.uniform(0, 10))
        if heal is not None and pool.now >= heal[1]:
            backlog.replace(pool.read(*heal), heal[0])
            heal = None
        pool.now += rng.uniform(0, 1)
    pool.now += 100  # every event has come by then
    pool.deliver(backlog, pool.now)
    poll(pool, backlog, pool.now)
    assert {r.flow_run.id for r in backlog.runs()} == pool.waiting()
    for response in backlog.runs():  # each as it now asks: read since its last change (a rename to Late aside)
        changes = [at for at, _, name in pool.history[response.flow_run.id] if name != "Late"]
        assert response.flow_run.state.timestamp >= T0 + timedelta(seconds=changes[-1])


def test_a_late_or_replayed_event_of_a_kept_run_reads_nothing_again():
    backlog, run_id = KeptBacklog(), uuid4()
    backlog.replace([run_response(run_id, "SCHEDULED", 10)], 0.0)
    backlog.changed(run_id, "SCHEDULED", "Scheduled", T0 + timedelta(seconds=10), 1.0)  # replayed
    backlog.changed(run_id, "PENDING", "Pending", T0 + timedelta(seconds=5), 1.0)  # older than what is kept
    backlog.changed(run_id, "SCHEDULED", "Late", T0 + timedelta(seconds=20), 1.0)  # renamed only
    assert backlog.to_read() == []
    backlog.changed(run_id, "PENDING", "Pending", T0 + timedelta(seconds=30), 2.0)
    assert backlog.to_read() == [run_id]
    assert backlog.to_read() == []  # given once


def test_an_event_is_a_hint_a_read_decides():
    backlog, run_id = KeptBacklog(), uuid4()
    backlog.replace([run_response(run_id, "SCHEDULED", 10)], 0.0)
    backlog.changed(run_id, "PENDING", "Pending", T0 + timedelta(seconds=30), 1.0)  # forged, say
    changed = backlog.to_read()
    backlog.confirm([run_response(run_id, "SCHEDULED", 10)], 2.0, asked=changed)  # the server says it waits
    assert [r.flow_run.id for r in backlog.runs()] == [run_id]
    backlog.confirm([], 3.0, asked=[run_id])
    assert backlog.runs() == []


def test_a_poll_gets_the_kept_runs_of_its_queues_due_by_its_time():
    backlog, other = KeptBacklog(), uuid4()
    due, later, elsewhere, unscheduled = uuid4(), uuid4(), uuid4(), uuid4()
    backlog.replace([run_response(due, "SCHEDULED", 1, start=T0 + timedelta(seconds=10)),
                     run_response(later, "SCHEDULED", 1, start=T0 + timedelta(seconds=11)),
                     run_response(elsewhere, "SCHEDULED", 1, queue=other),
                     run_response(unscheduled, "SCHEDULED", 1, start=None)], 0.0)
    assert {r.flow_run.id for r in backlog.due({QUEUE}, T0 + timedelta(seconds=10))} == {due, unscheduled}
    assert {r.flow_run.id for r in backlog.due({QUEUE, other}, T0 + timedelta(seconds=11))} == \
        {due, later, elsewhere, unscheduled}
    assert backlog.due(set(), T0 + timedelta(days=1)) == []


def test_the_due_runs_are_the_same_list_until_a_run_changes_comes_or_leaves_or_comes_due():
    backlog, now, later = KeptBacklog(), uuid4(), uuid4()
    backlog.replace([run_response(now, "SCHEDULED", 1, start=T0),
                     run_response(later, "SCHEDULED", 1, start=T0 + timedelta(seconds=60))], 0.0)
    first = backlog.due({QUEUE}, T0 + timedelta(seconds=5))
    assert [r.flow_run.id for r in first] == [now]
    backlog.confirm([run_response(now, "SCHEDULED", 1, start=T0)], 1.0)  # read again, unchanged
    assert backlog.due({QUEUE}, T0 + timedelta(seconds=30)) is first
    due = backlog.due({QUEUE}, T0 + timedelta(seconds=60))  # the later run came due
    assert {r.flow_run.id for r in due} == {now, later}
    backlog.confirm([run_response(now, "SCHEDULED", 2, start=T0)], 2.0)  # changed on the server
    changed = backlog.due({QUEUE}, T0 + timedelta(seconds=60))
    assert changed is not due and {r.flow_run.state.timestamp for r in changed} == {T0 + timedelta(seconds=1),
                                                                                     T0 + timedelta(seconds=2)}
    backlog.drop(later, 3.0)
    assert [r.flow_run.id for r in backlog.due({QUEUE}, T0 + timedelta(seconds=60))] == [now]
    assert backlog.due({uuid4()}, T0 + timedelta(seconds=60)) == []  # other queues: asked anew


def test_a_full_read_keeps_what_changed_while_it_lasted():
    backlog = KeptBacklog()
    started, created, kept = uuid4(), uuid4(), uuid4()
    backlog.replace([run_response(kept, "SCHEDULED", 1), run_response(started, "SCHEDULED", 1)], 0.0)
    # A full read begins at 10; meanwhile one run is taken here and one is created (its event read at 12).
    backlog.drop(started, 11.0)
    backlog.confirm([run_response(created, "SCHEDULED", 12)], 12.0)
    backlog.replace([run_response(kept, "SCHEDULED", 1), run_response(started, "SCHEDULED", 1)], 10.0)
    assert {r.flow_run.id for r in backlog.runs()} == {kept, created}


def run_event(resource_id: str, **labels: str) -> Event:
    """A flow-run event as Prefect's stream gives it (a job may emit its own, malformed ones, about its run)."""
    return Event(event="prefect.flow-run.Scheduled", resource={"prefect.resource.id": resource_id, **labels})


def test_a_malformed_flow_run_event_is_ignored_and_a_good_one_names_its_run():
    import logging

    async def taken() -> tuple[list[UUID], list[UUID]]:
        watch = WatchedBacklog(None, "pool", uuid4(), 300, logging.getLogger("test"))  # type: ignore[arg-type]
        watch.kept.replace([run_response(run_id, "SCHEDULED", 1)], 0.0)
        for event in (run_event("prefect.flow-run.not-a-uuid", **{"prefect.state-type": "PENDING"}),
                      run_event(f"prefect.flow-run.{run_id}", **{"prefect.state-timestamp": "yesterday"}),
                      # no zone: compared with the kept state's time it would raise, and end the stream
                      run_event(f"prefect.flow-run.{run_id}", **{"prefect.state-type": "PENDING",
                                                                 "prefect.state-timestamp": "2026-01-02T00:00:00"}),
                      run_event(f"prefect.task-run.{uuid4()}")):
            watch.take(event)
        malformed = watch.kept.to_read()
        watch.take(run_event(f"prefect.flow-run.{run_id}", **{
            "prefect.state-type": "PENDING", "prefect.state-timestamp": "2026-01-02T00:00:00+00:00"}))
        return malformed, watch.kept.to_read()

    run_id = uuid4()
    assert asyncio.run(taken()) == ([], [run_id])
