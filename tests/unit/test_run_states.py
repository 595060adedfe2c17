"""The living runs' states: one read for all of them per interval, not one per run."""

from __future__ import annotations

import anyio
import pytest

from e31_prefect.surface.run_states import RunStates


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def reader(states: dict):
    calls: list[list] = []

    async def read_many(ids: list) -> dict:
        calls.append(list(ids))
        return {run_id: states[run_id] for run_id in ids if run_id in states}

    return read_many, calls


@pytest.mark.anyio
async def test_every_living_run_watching_at_once_costs_one_read():
    living = ["a", "b", "c"]
    read_many, calls = reader({"a": "Running", "b": "Cancelling", "c": "Running"})
    states = RunStates(read_many, lambda: living, max_age=3600)
    seen = {}

    async def watch(run_id: str) -> None:
        seen[run_id] = await states.state(run_id)

    async with anyio.create_task_group() as group:
        for run_id in living:
            group.start_soon(watch, run_id)
    assert seen == {"a": "Running", "b": "Cancelling", "c": "Running"}
    assert calls == [["a", "b", "c"]]


@pytest.mark.anyio
async def test_a_stale_snapshot_or_a_run_not_in_it_is_read_again():
    living = ["a"]
    backing = {"a": "Running", "b": "Running"}
    read_many, calls = reader(backing)
    states = RunStates(read_many, lambda: living, max_age=0)  # always stale: every watch reads
    assert await states.state("a") == "Running"
    backing["a"] = "Cancelling"
    assert await states.state("a") == "Cancelling"
    fresh = RunStates(read_many, lambda: ["a"], max_age=3600)
    await fresh.state("a")
    assert await fresh.state("b") == "Running"  # a run that began living after the last read
    assert calls[-1] == ["a", "b"]


@pytest.mark.anyio
async def test_a_run_the_server_does_not_know_has_no_state():
    read_many, _ = reader({})
    assert await RunStates(read_many, lambda: [], max_age=1).state("gone") is None
