"""When will my job start? Every waiting run of a pool with its planned start and finish: ``e31 queue``.

    e31 queue --pool gpu

Like Slurm's ``squeue --start``. The waiting runs are read and evaluated exactly as a worker of the
pool reads them (:mod:`e31_prefect.planning.backlog`, the worker's own evaluation), and planned with
:func:`e31_prefect.planning.scheduling.plan` (the worker's order and reservations) over the devices and holds
the pool's ONLINE workers last published (:mod:`e31_prefect.surface.inventories`, one Prefect variable
per worker, written on each heartbeat). :func:`rows` is pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any
from uuid import UUID

from prefect import get_client

from e31_prefect.model.prediction import human
from e31_prefect.planning.scheduling import Planned, plan
from e31_prefect.surface import inventories, plan_artifact
from e31_prefect.surface.inventories import HostInventory

COLUMNS = ("RUN", "JOB", "GPUS", "PLANNED START", "PLANNED FINISH", "LATEST START", "MEETS DEADLINE", "PLANNED FOR",
           "BASIS")


def _when(moment: datetime | None, never: str) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ") if moment else never


def rows(planned: Sequence[Planned], names: Mapping[Any, tuple[str, str]], now: datetime) -> list[tuple[str, ...]]:
    """The table's rows, in order of planned start (runs that fit nowhere last); ``names`` gives each run's
    flow-run name and job name. A run with no start fits no live worker, or is past its latest start."""
    ordered = sorted(planned, key=lambda p: (p.start is None, p.start or datetime.max.replace(tzinfo=timezone.utc)))
    table = []
    for entry in ordered:
        run_name, job = names.get(entry.run.id, (str(entry.run.id), "?"))
        meets = plan_artifact.meets(entry)
        past = entry.run.latest_start is not None and entry.run.latest_start < now
        table.append((run_name, job, str(entry.run.gpus),
                      _when(entry.start, "deadline missed" if past else "never"),
                      _when(entry.finish, "-" if entry.start else "never"),
                      _when(entry.run.latest_start, "-"), meets,
                      human(entry.run.duration) if entry.run.duration is not None else "unknown",
                      entry.run.basis or "-"))
    return table


def render(table: Sequence[tuple[str, ...]], hosts: Sequence[HostInventory]) -> str:
    """The table as text, under one line on the pool's live devices."""
    devices = sum(len(h.models) or len(h.free) + len(h.busy) for h in hosts)
    free = sum(len(h.free) for h in hosts)
    drained = [f"{h.host} GPU {index}: {why}" for h in hosts for index, why in sorted(h.drained.items())]
    lines = [f"{len(hosts)} live worker(s), {devices} GPU(s), {free} free now; {len(table)} waiting run(s)"]
    if drained:
        lines.append(f"{len(drained)} drained, taking no run: " + "; ".join(drained))
    widths = [max(len(str(row[i])) for row in [COLUMNS, *table]) for i in range(len(COLUMNS))]
    for row in [COLUMNS, *table]:
        lines.append("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def planned_line(planned: Sequence[Planned], run_id: Any, hosts: Sequence[HostInventory], scheduled: datetime,
                 now: datetime) -> str:
    """What ``e31 submit`` says of when its run starts, from the pool's plan (``run_id`` may not be in it: a run
    not yet due is planned when it is)."""
    if scheduled > now:
        return f"planned start: at its start, {_when(scheduled, '')}, or when GPUs free up after it"
    entry = next((p for p in planned if p.run.id == run_id), None)
    if entry is None or entry.start is None:
        if entry is not None and entry.run.latest_start is not None and entry.run.latest_start < now:
            return "planned start: never; its latest start has passed"
        return (f"planned start: none yet; no live worker of the pool ({len(hosts)} live) has the GPUs it asks "
                "for, so it waits for one (e31 queue shows the pool)")
    ahead = sum(1 for p in planned if p.start is not None and p.start < entry.start)
    return (f"planned start: {_when(entry.start, '')}, behind {ahead} run(s) on {len(hosts)} live worker(s) "
            "(e31 queue shows the pool)")


def length_line(planned: Sequence[Planned], run_id: Any) -> str | None:
    """What ``e31 submit`` says of how long its run is planned for and why ("planned for 14 min: your last 20
    runs took 12-14 min of a 2 h limit"), and whether its deadline is met only on that; None: not planned yet."""
    entry = next((p for p in planned if p.run.id == run_id), None)
    if entry is None or entry.run.basis is None:
        return None
    length = human(entry.run.duration) if entry.run.duration is not None else "an unknown length"
    line = f"planned for {length}: {entry.run.basis}"
    if entry.on_prediction:
        line += (f"; it meets its deadline only on this prediction (run to its {human(entry.run.limit)} limit "
                 "it would not)")
    return line


async def read_plan(pool: str) -> tuple[list[Planned], dict[UUID, tuple[str, str]], list[HostInventory], datetime]:
    """The pool's waiting runs planned over its live inventories, their names, those inventories, and now."""
    from e31_prefect.surface.worker import E31Worker

    async with E31Worker(work_pool_name=pool) as worker:
        waiting = await worker.read_waiting()
        hosts = await inventories.read(worker.client, pool)
    now = datetime.now(timezone.utc)
    names: dict[UUID, tuple[str, str]] = {run_id: (run_name, job) for run_id, (_, run_name, job) in waiting.items()}
    planned = plan([run for run, _, _ in waiting.values()], [(h.free, h.busy) for h in hosts], now)
    try:  # shown in the Prefect UI too, as the pool's workers show it
        async with get_client() as client:
            await plan_artifact.write(client, pool, plan_artifact.table(planned, names), now)
    except Exception:
        pass  # only the UI's copy is missing
    return planned, names, hosts, now


async def forecast(pool: str) -> str:
    """Read the pool's waiting runs and live inventories, plan them, and render the table."""
    planned, names, hosts, now = await read_plan(pool)
    return render(rows(planned, names, now), hosts)
