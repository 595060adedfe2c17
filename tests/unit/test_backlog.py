"""Paging through a whole backlog with a cursor, and evaluations kept while a run is unchanged."""

from __future__ import annotations

import asyncio
import random
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from uuid import UUID, uuid4

import pytest

from e31_prefect.backlog import Evaluations, page_through

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
