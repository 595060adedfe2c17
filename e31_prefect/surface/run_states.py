"""The states of the runs living on a worker, read for all of them in one call, at most once per interval.

    prefect worker start --pool gpu --type e31

Each running job watches its flow run for a cancellation request every ``E31_WATCH_SECONDS``. Read
one by one that is a call per run per interval; here the first watcher to find the snapshot older
than the interval reads every living run's state in one ``read_flow_runs`` call, and the others
answer from it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any
from uuid import UUID

import anyio

ReadMany = Callable[[list[UUID]], Awaitable[dict[UUID, Any]]]


class RunStates:
    """A snapshot of the living runs' states, refreshed in one read when older than ``max_age`` seconds."""

    def __init__(self, read_many: ReadMany, living: Callable[[], Collection[UUID]], max_age: float):
        self._read_many = read_many
        self._living = living
        self._max_age = max_age
        self._states: dict[UUID, Any] = {}
        self._read_at = -float("inf")
        self._lock = anyio.Lock()

    async def state(self, run_id: UUID) -> Any:
        """``run_id``'s state, at most ``max_age`` seconds old (None if the server does not know the run)."""
        async with self._lock:  # one refresh at a time; whoever waited reads the fresh snapshot
            if time.monotonic() - self._read_at >= self._max_age or run_id not in self._states:
                ids = sorted({*self._living(), run_id})
                self._states = await self._read_many(ids)
                self._read_at = time.monotonic()
        return self._states.get(run_id)


async def read_states(client: Any, ids: list[UUID]) -> dict[UUID, Any]:
    """The states of ``ids`` in one call (in pages of the server's limit, for a host with very many runs)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_DEFAULT_LIMIT

    size = PREFECT_API_DEFAULT_LIMIT.value()
    states: dict[UUID, Any] = {}
    for at in range(0, len(ids), size):
        chunk = ids[at:at + size]
        for run in await client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=chunk)),
                                               limit=size):
            states[run.id] = run.state
    return states
