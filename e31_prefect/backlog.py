"""A pool's whole backlog: every waiting run, page by page, and each run's evaluation kept between polls.

    prefect worker start --pool gpu --type e31

Prefect's worker endpoint (``POST /work_pools/{name}/get_scheduled_flow_runs``, what
``client.get_scheduled_flow_runs_for_work_pool`` calls) answers one page, at most the server's
``PREFECT_SERVER_API_DEFAULT_LIMIT`` (200) runs, and has no offset; a worker that reads only that
page ranks only those runs. Asked for one work queue at a time its order is the runs' next
scheduled start alone, so ``scheduled_after`` (inclusive) is a cursor: each page starts at the last
one's latest time. A full page all at one time (a batch submitted for one instant) cannot move
the cursor; those runs are paged by offset through the flow-run filter instead. The endpoint's
own rules still hold: paused queues and pools give nothing, and a queue or pool concurrency limit
caps a page below its size, which ends the paging.

:class:`Evaluations` is pure: the worker keeps what each run was evaluated to (templated,
parsed, its deadline resolved) and evaluates it again only when its version changes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Iterable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar
from uuid import UUID

from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterNextScheduledStartTime,
    FlowRunFilterState,
    FlowRunFilterStateType,
    FlowRunFilterWorkQueueName,
    WorkPoolFilter,
    WorkPoolFilterName,
)
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.sorting import FlowRunSort
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_DEFAULT_LIMIT

if TYPE_CHECKING:
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.responses import WorkerFlowRunResponse

T = TypeVar("T")

# A page after a cursor time: the runs scheduled at or after it (None: from the first).
PageAfter = Callable[[datetime | None], Awaitable[list["WorkerFlowRunResponse"]]]
# A page of the runs scheduled exactly at a time, from an offset.
PageAt = Callable[[datetime, int], Awaitable[list["WorkerFlowRunResponse"]]]


async def page_through(after: PageAfter, at: PageAt, size: int) -> list[WorkerFlowRunResponse]:
    """Every run the pages give, each once, in order of scheduled time.

    A page shorter than ``size`` is the last. A full page ends at its latest time, the next page
    starts there (its runs already seen are skipped); a full page all at one time is read by
    offset at that time, and the cursor moves just past it.
    """
    seen: dict[UUID, WorkerFlowRunResponse] = {}
    cursor: datetime | None = None
    while True:
        page = await after(cursor)
        for response in page:
            seen.setdefault(response.flow_run.id, response)
        if len(page) < size:
            return list(seen.values())
        first, last = (page[0].flow_run.next_scheduled_start_time, page[-1].flow_run.next_scheduled_start_time)
        if last is None:  # a scheduled run always has one; without it there is no cursor
            return list(seen.values())
        if first == last:
            offset = 0
            while True:
                tied = await at(last, offset)
                for response in tied:
                    seen.setdefault(response.flow_run.id, response)
                if len(tied) < size:
                    break
                offset += size
            # Timestamps are kept to the microsecond, so nothing lies between `last` and this.
            last += timedelta(microseconds=1)
        cursor = last


async def read_backlog(client: PrefectClient, pool: str, queues: Iterable[str],
                       scheduled_before: datetime) -> list[WorkerFlowRunResponse]:
    """Every scheduled run of ``pool``'s ``queues`` due by ``scheduled_before``, through Prefect's worker
    endpoint (which also marks the queues and their deployments ready, as a stock worker's poll does)."""
    from prefect.client.schemas.responses import WorkerFlowRunResponse

    size = PREFECT_API_DEFAULT_LIMIT.value()
    found: list[WorkerFlowRunResponse] = []
    for queue in queues:
        async def after(cursor: datetime | None, queue: str = queue) -> list[WorkerFlowRunResponse]:
            body: dict[str, Any] = {"work_queue_names": [queue], "scheduled_before": str(scheduled_before),
                                    "limit": size}
            if cursor is not None:
                body["scheduled_after"] = str(cursor)
            try:
                response = await client.request("POST", "/work_pools/{name}/get_scheduled_flow_runs",
                                                path_params={"name": pool}, json=body)
            except Exception as exc:
                if getattr(getattr(exc, "response", None), "status_code", None) == 404:
                    return []  # the pool or queue is gone: nothing waits in it
                raise
            return WorkerFlowRunResponse.model_validate_list(response.json())

        async def at(moment: datetime, offset: int, queue: str = queue) -> list[WorkerFlowRunResponse]:
            runs = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
                    work_queue_name=FlowRunFilterWorkQueueName(any_=[queue]),
                    next_scheduled_start_time=FlowRunFilterNextScheduledStartTime(before_=moment, after_=moment)),
                work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])),
                sort=FlowRunSort.ID_DESC, limit=size, offset=offset)
            return [WorkerFlowRunResponse(work_pool_id=run.work_pool_id or UUID(int=0),
                                          work_queue_id=run.work_queue_id or UUID(int=0), flow_run=run)
                    for run in runs]

        try:
            found += await page_through(after, at, size)
        except ObjectNotFound:
            continue
    return found


class Evaluations(Generic[T]):
    """What each run was evaluated to, kept while its version (anything whose change could change
    the evaluation: the run's ``updated`` and state, its deployment's, the pool's template) stays the same."""

    def __init__(self) -> None:
        self._kept: dict[Hashable, tuple[Hashable, T]] = {}

    def get(self, run_id: Hashable, version: Hashable) -> T | None:
        """The kept evaluation of ``run_id`` at ``version``; None if there is none or it is stale."""
        kept = self._kept.get(run_id)
        return kept[1] if kept is not None and kept[0] == version else None

    def keep(self, run_id: Hashable, version: Hashable, value: T) -> None:
        """Remember ``value`` as ``run_id``'s evaluation at ``version`` (replacing an older one)."""
        self._kept[run_id] = (version, value)

    def retain(self, run_ids: Iterable[Hashable]) -> None:
        """Forget every run not in ``run_ids`` (started, refused, gone): memory follows the backlog."""
        keep = set(run_ids)
        self._kept = {run_id: kept for run_id, kept in self._kept.items() if run_id in keep}

    def __len__(self) -> int:
        return len(self._kept)
