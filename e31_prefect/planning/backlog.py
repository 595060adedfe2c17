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

:class:`KeptBacklog` and :class:`Evaluations` are pure: a worker keeps the waiting runs between
polls (a full read now and then, Prefect's flow-run events for what changed in between) and what
each run was evaluated to (templated, parsed, its deadline resolved), evaluated again only when
its version changes.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar
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


async def worker_page(client: PrefectClient, pool: str, queues: list[str], scheduled_before: datetime | None,
                      scheduled_after: datetime | None = None) -> list[WorkerFlowRunResponse]:
    """One page of the pool's scheduled runs from Prefect's worker endpoint, in order of scheduled time
    (the read also marks the queues and their deployments ready, as a stock worker's poll does)."""
    from prefect.client.schemas.responses import WorkerFlowRunResponse

    body: dict[str, Any] = {"work_queue_names": queues, "limit": PREFECT_API_DEFAULT_LIMIT.value()}
    if scheduled_before is not None:
        body["scheduled_before"] = str(scheduled_before)
    if scheduled_after is not None:
        body["scheduled_after"] = str(scheduled_after)
    try:
        response = await client.request("POST", "/work_pools/{name}/get_scheduled_flow_runs",
                                        path_params={"name": pool}, json=body)
    except Exception as exc:
        if getattr(getattr(exc, "response", None), "status_code", None) == 404:
            return []  # the pool or queue is gone: nothing waits in it
        raise
    return WorkerFlowRunResponse.model_validate_list(response.json())


def with_queue_names(responses: list[WorkerFlowRunResponse], names: Mapping[UUID, str]) -> list[WorkerFlowRunResponse]:
    """``responses``, each flow run given its work queue's name from ``names`` (queue id to name).

    Prefect's worker endpoint leaves a flow run's ``work_queue_name`` empty, and a run's queue says
    its team (``E31_QUEUE_TEAMS``) and which kept runs a poll of some queues gives.
    """
    for response in responses:
        if response.flow_run.work_queue_name is None and response.work_queue_id in names:
            response.flow_run.work_queue_name = names[response.work_queue_id]
    return responses


def retrying_in_process(run: Any) -> bool:
    """Whether a scheduled run waits for a retry in its own, still living, process: no worker's to take.

    Prefect's worker endpoint skips these (``retry_type: in_process``, set by the server as a flow with
    retries left fails); the flow-run filter does not, so the runs read through it are judged here.
    """
    return getattr(getattr(run, "empirical_policy", None), "retry_type", None) == "in_process"


def as_worker_responses(runs: Iterable[Any]) -> list[WorkerFlowRunResponse]:
    """Flow runs read through the flow-run filter, in the worker endpoint's shape."""
    from prefect.client.schemas.responses import WorkerFlowRunResponse

    return [WorkerFlowRunResponse(work_pool_id=run.work_pool_id or UUID(int=0),
                                  work_queue_id=run.work_queue_id or UUID(int=0), flow_run=run) for run in runs]


async def read_backlog(client: PrefectClient, pool: str, queues: Iterable[str],
                       scheduled_before: datetime | None) -> list[WorkerFlowRunResponse]:
    """Every scheduled run of ``pool``'s ``queues`` due by ``scheduled_before`` (None: whenever due),
    through Prefect's worker endpoint."""
    size = PREFECT_API_DEFAULT_LIMIT.value()
    found: list[WorkerFlowRunResponse] = []
    for queue in queues:
        async def after(cursor: datetime | None, queue: str = queue) -> list[WorkerFlowRunResponse]:
            return await worker_page(client, pool, [queue], scheduled_before, cursor)

        async def at(moment: datetime, offset: int, queue: str = queue) -> list[WorkerFlowRunResponse]:
            return as_worker_responses(await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
                    work_queue_name=FlowRunFilterWorkQueueName(any_=[queue]),
                    next_scheduled_start_time=FlowRunFilterNextScheduledStartTime(before_=moment, after_=moment)),
                work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])),
                sort=FlowRunSort.ID_DESC, limit=size, offset=offset))

        try:
            found += await page_through(after, at, size)
        except ObjectNotFound:
            continue
    # After paging, which counts a page's runs to find its end.
    return [response for response in found if not retrying_in_process(response.flow_run)]


async def read_waiting_ids(client: PrefectClient, pool: str, ids: list[UUID]) -> list[WorkerFlowRunResponse]:
    """Those of ``ids`` that are scheduled runs of ``pool`` now, read in pages of the server's limit."""
    from prefect.client.schemas.filters import FlowRunFilterId

    size = PREFECT_API_DEFAULT_LIMIT.value()
    found: list[WorkerFlowRunResponse] = []
    for first in range(0, len(ids), size):
        found += as_worker_responses(await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=ids[first:first + size]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])), limit=size))
    return [response for response in found if not retrying_in_process(response.flow_run)]


class _Kept(NamedTuple):
    """A kept waiting run: when it was read, as read, and what a poll filters it by, computed once."""

    read_at: float
    response: WorkerFlowRunResponse
    queue_id: UUID
    due_at: float  # its next scheduled start, POSIX seconds (-inf: none given)

    @classmethod
    def of(cls, response: WorkerFlowRunResponse, read_at: float) -> _Kept:
        start = response.flow_run.next_scheduled_start_time
        return cls(read_at, response, response.work_queue_id, -math.inf if start is None else start.timestamp())


class KeptBacklog:
    """A pool's waiting runs kept between polls, and which of them to read again.

    A full read (:meth:`replace`) gives every waiting run. Between full reads, Prefect's flow-run
    events (:meth:`changed`) say which runs changed, and those are read again (:meth:`to_read`, then
    :meth:`confirm`): an event is only a hint, so one that comes late, twice (a rejoined stream
    replays the last minute) or forged costs a read and changes nothing by itself. A change not
    newer than a kept run's state is ignored, as is Prefect renaming a kept run Late.

    A full read takes a while and runs change meanwhile: it replaces the kept runs except what is
    known to be newer than its start, runs confirmed since (kept) and runs that left since (left
    out). Times are the caller's monotonic seconds.
    """

    def __init__(self) -> None:
        self._runs: dict[UUID, _Kept] = {}
        self._left: dict[UUID, float] = {}  # run -> when it was seen to wait no more
        self._to_read: set[UUID] = set()
        self.complete = False  # whether a full read was taken in (and no change missed since)
        self._generation = 0  # counts changes to the kept runs: while it stands, a poll's answer stands
        # The last due() answer: (generation, queues, due by from, until, runs); good until a kept run comes due.
        self._answer: tuple[int, frozenset[UUID], float, float, list[WorkerFlowRunResponse]] | None = None

    def runs(self) -> list[WorkerFlowRunResponse]:
        """Every kept waiting run."""
        return [kept.response for kept in self._runs.values()]

    def due(self, queue_ids: Iterable[UUID], due_by: datetime) -> list[WorkerFlowRunResponse]:
        """The kept runs of the queues ``queue_ids`` due by ``due_by``: what a poll ranks. While no kept run
        changed, came or left, or came due, it is the very list of the last call."""
        by, queues = due_by.timestamp(), frozenset(queue_ids)
        answer = self._answer
        if answer is not None and answer[:2] == (self._generation, queues) and answer[2] <= by < answer[3]:
            return answer[4]  # the same list: a poll sees at a glance that nothing changed
        mine = [kept for kept in self._runs.values() if kept.queue_id in queues]
        due = [kept.response for kept in mine if kept.due_at <= by]
        until = min((kept.due_at for kept in mine if kept.due_at > by), default=math.inf)
        self._answer = (self._generation, queues, by, until, due)
        return due

    def replace(self, responses: Iterable[WorkerFlowRunResponse], began: float) -> None:
        """Take in a full read that began at ``began``."""
        fresh = {r.flow_run.id: _Kept.of(r, began) for r in responses
                 if self._left.get(r.flow_run.id, -math.inf) < began}
        fresh.update((run_id, kept) for run_id, kept in self._runs.items() if kept.read_at >= began)
        self._runs = fresh
        self._generation += 1
        # A run that left before this read began is not in it: the mark has said what it could.
        self._left = {run_id: at for run_id, at in self._left.items() if at >= began}
        self.complete = True

    def changed(self, run_id: UUID, state_type: str, state_name: str, state_at: datetime | None, now: float) -> None:
        """A flow-run event, noted at ``now``: ``run_id`` entered a state of ``state_type`` and ``state_name`` at
        ``state_at``."""
        kept = self._runs.get(run_id)
        if kept is None:
            if state_type == StateType.SCHEDULED.value:
                self._to_read.add(run_id)  # perhaps newly waiting
            else:
                # Not waiting now: a read already under way may still have seen it waiting.
                self._left[run_id] = now
            return
        state = kept.response.flow_run.state
        if state is not None and state_at is not None and state_at <= state.timestamp:
            return  # no newer than what is kept
        if state_type == StateType.SCHEDULED.value and state_name == "Late":
            return  # the same run, renamed: nothing it asks changed
        self._to_read.add(run_id)

    def drop(self, run_id: UUID, now: float) -> None:
        """``run_id`` is no longer waiting (taken, refused, ended)."""
        if self._runs.pop(run_id, None) is not None:
            self._generation += 1
        self._left[run_id] = now

    def to_read(self) -> list[UUID]:
        """The runs to read again (an event said they changed); given once, then forgotten."""
        ids, self._to_read = sorted(self._to_read), set()
        return ids

    def confirm(self, responses: Iterable[WorkerFlowRunResponse], began: float, asked: Iterable[UUID] = ()) -> None:
        """Take in runs read by a read that began at ``began``: the scheduled ones are kept (unless seen to
        leave since), and any of ``asked`` not among them is no longer waiting."""
        found = set()
        for response in responses:
            found.add(response.flow_run.id)
            if self._left.get(response.flow_run.id, -math.inf) >= began:
                continue
            kept = self._runs.get(response.flow_run.id)
            if kept is not None and (kept.response.flow_run.updated, kept.response.flow_run.state_id) == (
                    response.flow_run.updated, response.flow_run.state_id):
                self._runs[response.flow_run.id] = kept._replace(read_at=began)  # read again, unchanged
            else:
                self._runs[response.flow_run.id] = _Kept.of(response, began)
                self._generation += 1
        for run_id in asked:
            if run_id not in found:
                self.drop(run_id, began)

    def __len__(self) -> int:
        return len(self._runs)


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
