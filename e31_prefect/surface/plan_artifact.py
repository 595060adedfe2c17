"""The pool's plan in the Prefect UI: a table artifact ``e31-plan-<pool>``, each waiting run's planned start and end.

    prefect worker start --pool gpu --type e31      # writes it as the plan changes
    e31 queue --pool gpu                            # writes it too, and prints it

One key per pool, so the UI's Artifacts page shows the latest plan with its history of versions.
A worker writes it at most every ``E31_PLAN_ARTIFACT_SECONDS`` and only when the table changed
(:class:`PlanWriter`), never on a poll's path: a poll hands over what it knows and goes on.
:func:`table` is pure.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from prefect.client.schemas.actions import ArtifactCreate

from e31_prefect.model.prediction import human
from e31_prefect.planning.scheduling import Planned
from e31_prefect.surface.reporting import artifact_key

if TYPE_CHECKING:
    from prefect.client.orchestration import PrefectClient

MAX_ROWS = 500  # the UI's table is for reading: the most urgent runs, and a count of the rest


def key(pool: str) -> str:
    """The pool's plan artifact key: ``e31-plan-<pool>``."""
    return artifact_key("e31-plan", pool)


def _when(moment: datetime | None) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ") if moment else ""


def meets(entry: Planned) -> str:
    """Whether a planned run meets its deadline: ``yes``, ``yes, on prediction`` (not if it ran to its limit),
    ``no``, or ``-`` (it has none)."""
    if entry.meets_deadline is None:
        return "-"
    if not entry.meets_deadline:
        return "no"
    return "yes, on prediction" if entry.on_prediction else "yes"


def table(planned: Sequence[Planned], names: Mapping[Any, tuple[str, str]]) -> list[dict[str, str]]:
    """The artifact's rows in order of planned start (runs that fit nowhere last); ``names`` gives each run's
    flow-run name and job name."""
    ordered = sorted(planned, key=lambda p: (p.start is None, p.start or datetime.max.replace(tzinfo=timezone.utc)))
    rows = []
    for entry in ordered[:MAX_ROWS]:
        run_name, job = names.get(entry.run.id, (str(entry.run.id), "?"))
        rows.append({
            "run": run_name, "job": job, "gpus": str(entry.run.gpus),
            "planned start": _when(entry.start) or "never", "planned finish": _when(entry.finish) or "-",
            "planned length": human(entry.run.duration) if entry.run.duration is not None else "unknown",
            "latest start": _when(entry.run.latest_start) or "-", "meets deadline": meets(entry),
            "basis": entry.run.basis or "",
        })
    if len(ordered) > MAX_ROWS:
        rows.append({"run": f"... and {len(ordered) - MAX_ROWS} more (e31 queue shows them all)"})
    return rows


async def write(client: PrefectClient, pool: str, rows: list[dict[str, str]], now: datetime) -> None:
    """Write ``rows`` as the pool's plan artifact (a new version of its key)."""
    waiting = sum(1 for row in rows if "job" in row)
    await client.create_artifact(ArtifactCreate(
        key=key(pool), type="table", data=json.dumps(rows),
        description=f"E31 plan of pool {pool}: {waiting} waiting run(s), planned at {_when(now)}"))


class PlanWriter:
    """Writes a pool's plan artifact when it changed, at most every ``interval`` seconds, in the background."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self.clock = clock
        self._last_rows: str | None = None
        self._last_at = -float("inf")
        self._task: asyncio.Task | None = None

    def due(self) -> bool:
        """Whether a write may start now (none under way, and the interval since the last has passed)."""
        return (self._task is None or self._task.done()) and self.clock() - self._last_at >= self.interval

    def start(self, make: Callable[[], Awaitable[tuple[list[dict[str, str]], Callable[[list], Awaitable[None]]]]],
              ) -> None:
        """Run ``make`` in the background (it gives the rows and how to write them); write only changed rows."""
        if not self.due():
            return
        self._last_at = self.clock()

        async def run() -> None:
            try:
                rows, send = await make()
                text = json.dumps(rows, sort_keys=True)
                if text != self._last_rows:
                    await send(rows)
                    self._last_rows = text
            except Exception:
                return  # the plan is shown, not needed: the next change tries again

        self._task = asyncio.get_running_loop().create_task(run())
