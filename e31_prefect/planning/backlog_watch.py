"""A pool's backlog kept between polls: Prefect's flow-run events say what changed, a full read now and then heals.

    prefect worker start --pool gpu --type e31

Ranking every waiting run means knowing every waiting run. Read whole on each poll, a backlog of
10,000 runs is fifty pages of Prefect's worker endpoint per poll, and the poll grows with the
backlog. Instead a pool's worker follows the pool's ``prefect.flow-run.*`` events (the websocket
Prefect's own worker follows for cancellations) and keeps the backlog (:class:`KeptBacklog`): a poll
reads one page of the endpoint, as Prefect's stock worker does (it marks the queues ready and
brings the earliest runs fresh), plus the runs an event said changed; a full read at the start,
after the event stream was lost, and every ``E31_BACKLOG_HEAL_SECONDS`` in the background mends
whatever an event did not say. Where the stream cannot be followed, every poll reads the whole
backlog, as before.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any
from uuid import UUID

import anyio
from anyio.abc import TaskGroup, TaskStatus

from e31_prefect.planning.backlog import KeptBacklog, read_backlog, read_waiting_ids, with_queue_names, worker_page

if TYPE_CHECKING:
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.responses import WorkerFlowRunResponse
    from prefect.events import Event

RUN_RESOURCE = "prefect.flow-run."
# A page of Prefect's worker endpoint and when its read began (monotonic seconds).
Page = tuple[float, list["WorkerFlowRunResponse"]]
# After the stream failed for good (Prefect's subscriber retries itself first), the next try.
RECONNECT_SECONDS = 10.0


class WatchedBacklog:
    """The scheduled runs of one pool, kept current by its flow-run events while they can be followed."""

    def __init__(self, client: PrefectClient, pool: str, pool_id: UUID, heal_seconds: float,
                 logger: logging.Logger | logging.LoggerAdapter[Any]):
        self.kept = KeptBacklog()
        self._client, self._pool, self._pool_id = client, pool, pool_id
        self._heal_seconds = heal_seconds
        self._log = logger
        self.following = False  # whether the event stream is followed now (else every poll reads it all)
        self._followed_since = math.inf  # when it was last (re)joined: a full read begun before missed changes
        self._healed_at = -math.inf
        self._healing = False
        self._queues: tuple[str, ...] = ()  # the queues the kept runs were read for
        self._scope = anyio.CancelScope()
        self._tasks: TaskGroup | None = None

    # -- following the events ---------------------------------------------------------------------

    async def follow(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Follow the pool's flow-run events until :meth:`close`; started once the stream is joined (or
        could not be, the first time)."""
        from prefect.events.clients import get_events_subscriber
        from prefect.events.filters import EventAnyResourceFilter, EventFilter, EventNameFilter

        events_filter = EventFilter(event=EventNameFilter(prefix=[RUN_RESOURCE]),
                                    any_resource=EventAnyResourceFilter(id=[f"prefect.work-pool.{self._pool_id}"]))
        started = False
        with self._scope:
            async with anyio.create_task_group() as self._tasks:
                while True:
                    try:
                        async with get_events_subscriber(filter=events_filter) as events:
                            self.following, self._followed_since = True, time.monotonic()
                            self.kept.complete = False  # what changed while not following is unknown
                            if not started:
                                started = True
                                task_status.started()
                            async for event in events:
                                self.take(event)
                    except Exception as exc:
                        self._log.warning("Not following the pool's flow-run events (%s: %s); each poll reads "
                                          "the whole backlog until they are followed again", type(exc).__name__, exc)
                    self.following = False
                    if not started:
                        started = True
                        task_status.started()
                    await anyio.sleep(RECONNECT_SECONDS)

    def take(self, event: Event) -> None:
        """Note one flow-run event in the kept backlog; a malformed one is ignored (the next full read mends)."""
        resource = event.resource
        if not resource.id.startswith(RUN_RESOURCE):
            return
        try:
            run_id = UUID(resource.id.removeprefix(RUN_RESOURCE))
            stamp = resource.get("prefect.state-timestamp")
            at = datetime.fromisoformat(stamp) if stamp else None
        except ValueError:
            return
        if at is not None and at.tzinfo is None:
            return  # Prefect writes every state time with its zone; one without cannot be compared with them
        self.kept.changed(run_id, resource.get("prefect.state-type") or "", resource.get("prefect.state-name") or "",
                          at, time.monotonic())

    def close(self) -> None:
        """Stop following and healing."""
        self._scope.cancel()
        self.following = False

    # -- the poll's read ---------------------------------------------------------------------------

    async def page(self, due_by: datetime) -> Page | None:
        """Prefect's worker endpoint's page for the queues the kept runs were read for, which a poll reads
        beside its other reads and hands to :meth:`runs`; None where :meth:`runs` reads the whole backlog."""
        if not (self.following and self.kept.complete and self._queues):
            return None
        began = time.monotonic()
        return began, await worker_page(self._client, self._pool, list(self._queues), due_by)

    async def runs(self, names: Mapping[UUID, str], due_by: datetime,
                   page: Page | None = None) -> list[WorkerFlowRunResponse]:
        """The scheduled runs of the queues ``names`` (queue id to name) due by ``due_by``: the kept ones,
        brought up to date (by ``page`` where the poll read it), each with its queue's name."""
        queues = tuple(sorted(names.values()))
        if not self.following:
            return with_queue_names(await read_backlog(self._client, self._pool, queues, due_by), names)
        began = time.monotonic()
        if not self.kept.complete or queues != self._queues:
            self._queues = queues
            self.kept.replace(with_queue_names(await read_backlog(self._client, self._pool, queues, None), names),
                              began)
            self._healed_at = began
            page = None  # read before the whole backlog, or for other queues
        elif began - self._healed_at >= self._heal_seconds and not self._healing and self._tasks is not None:
            self._healing = True
            self._tasks.start_soon(self._heal, queues, dict(names))
        changed = self.kept.to_read()
        began = time.monotonic()
        if page is None:  # the page and the runs an event named, read at once
            responses, reread = await asyncio.gather(worker_page(self._client, self._pool, list(queues), due_by),
                                                     read_waiting_ids(self._client, self._pool, changed))
            page = began, responses
        else:
            reread = await read_waiting_ids(self._client, self._pool, changed)
        self.kept.confirm(with_queue_names(page[1], names), page[0])
        self.kept.confirm(with_queue_names(reread, names), began, asked=changed)
        return self.kept.due(names, due_by)

    async def _heal(self, queues: tuple[str, ...], names: Mapping[UUID, str]) -> None:
        began = time.monotonic()
        try:
            responses = await read_backlog(self._client, self._pool, queues, None)
        except Exception as exc:
            self._log.warning("Reading the whole backlog failed (%s: %s); the next poll tries again",
                              type(exc).__name__, exc)
            return
        finally:
            self._healing = False
        if queues == self._queues and began >= self._followed_since:
            self.kept.replace(with_queue_names(responses, names), began)
            self._healed_at = began

    def drop(self, run_id: UUID) -> None:
        """``run_id`` was taken or refused here: it waits no more."""
        self.kept.drop(run_id, time.monotonic())
