"""The recent work times of each deployment's runs, read from the Prefect server: what predictions learn from.

    E31_HISTORY_RUNS=20 prefect worker start --pool gpu --type e31

Every worker of a pool reads the same record: the meter tags its pool's workers put on each run at
release (``e31:run-s=742``, ``e31:team=vision``; :func:`e31_prefect.model.meter.tags`), on the last
completed runs of a deployment. Nothing is stored besides: the server is the store. A deployment
named after a job may serve several teams (``e31 submit`` deploys a job under its name), so a run
learns only from runs of its own team.

A poll must stay cheap at any backlog: each deployment is read once, then again only when its
record is older than ``refresh_seconds`` (reads are together, a few at a time); between reads the
kept times answer. :attr:`RunHistory.generation` changes only when what was read changed, so a
worker re-evaluates its waiting runs only then.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    FlowRunFilterTags,
)
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.sorting import FlowRunSort

from e31_prefect.model.prediction import Prediction, predict, run_seconds, team_of, usable

if TYPE_CHECKING:
    from prefect.client.orchestration import PrefectClient

READS_AT_ONCE = 4
# A deployment's runs of other teams share its record: read this many times the history's length,
# so a team's own runs are found among theirs.
OVERREAD = 3


class RunHistory:
    """The last ``runs`` work times of each deployment, per team, kept between polls."""

    def __init__(self, runs: int = 20, refresh_seconds: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.runs = runs
        self.refresh_seconds = refresh_seconds
        self.clock = clock
        # deployment -> (when read, [(team, seconds)] newest first)
        self._kept: dict[UUID, tuple[float, list[tuple[str | None, float]]]] = {}
        self._versions: dict[UUID, int] = {}  # deployment -> the generation its record last changed in
        self.generation = 0
        self._background: asyncio.Task | None = None

    def stale(self, deployment_ids: Iterable[UUID | None]) -> list[UUID]:
        """Those of ``deployment_ids`` never read, or read more than ``refresh_seconds`` ago."""
        now = self.clock()
        return sorted({d for d in deployment_ids if d is not None
                       and (d not in self._kept or now - self._kept[d][0] >= self.refresh_seconds)})

    def version(self, deployment_id: UUID | None) -> Any:
        """What a prediction for ``deployment_id`` stands on: equal while its record is unchanged."""
        return self._versions.get(deployment_id) if deployment_id is not None else None

    def keep(self, deployment_id: UUID, record: list[tuple[str | None, float]]) -> None:
        """Take in a deployment's record (team and work seconds of its runs, newest first)."""
        old = self._kept.get(deployment_id)
        if old is None or old[1] != record:
            self.generation += 1
            self._versions[deployment_id] = self.generation
        self._kept[deployment_id] = (self.clock(), record)

    def times(self, deployment_id: UUID | None, team: str | None) -> list[float]:
        """The last ``runs`` work times (seconds) of ``team``'s runs of the deployment, newest first."""
        kept = self._kept.get(deployment_id) if deployment_id is not None else None
        if kept is None:
            return []
        return [seconds for owner, seconds in kept[1] if owner == team][: self.runs]

    def predict(self, deployment_id: UUID | None, team: str | None, limit: timedelta | None) -> tuple[Prediction, int]:
        """The planned length of a run of the deployment and team with time limit ``limit``, and how many
        usable past times it had (for its basis)."""
        times = self.times(deployment_id, team)
        return predict(times, limit), len(usable(times))

    async def update(self, client: PrefectClient, deployment_ids: Iterable[UUID | None]) -> None:
        """Make the records of ``deployment_ids`` current: those never read are read now (a run's first plan
        needs them), those only stale are read again in the background (the poll goes on with the kept ones)."""
        stale = self.stale(deployment_ids)
        if not stale:
            return
        missing = [d for d in stale if d not in self._kept]
        known = [d for d in stale if d in self._kept]
        if known and (self._background is None or self._background.done()):
            self._background = asyncio.get_running_loop().create_task(self.refresh(client, known))
        if missing:
            await self.refresh(client, missing)

    async def refresh(self, client: PrefectClient, deployment_ids: Iterable[UUID]) -> None:
        """Read again the records of ``deployment_ids``, a few at a time. A read that fails keeps the old
        record (read again next time): a prediction never stops a poll."""
        at_once = asyncio.Semaphore(READS_AT_ONCE)

        async def one(deployment_id: UUID) -> None:
            async with at_once:
                try:
                    record = await read_record(client, deployment_id, self.runs * OVERREAD) if self.runs else []
                except Exception:
                    # Kept as it was (or empty: the limit plans) and read again after refresh_seconds.
                    record = self._kept[deployment_id][1] if deployment_id in self._kept else []
                self.keep(deployment_id, record)

        await asyncio.gather(*map(one, deployment_ids))


async def read_record(client: PrefectClient, deployment_id: UUID, limit: int) -> list[tuple[str | None, float]]:
    """The team and work seconds of the deployment's last ``limit`` completed, metered runs, newest first."""
    runs = await client.read_flow_runs(
        flow_run_filter=FlowRunFilter(
            deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.COMPLETED])),
            tags=FlowRunFilterTags(all_=["e31"])),
        sort=FlowRunSort.END_TIME_DESC, limit=limit)
    record = []
    for run in runs:
        seconds = run_seconds(run.tags or [])
        if seconds is not None:
            record.append((team_of(run.tags or []), seconds))
    return record
