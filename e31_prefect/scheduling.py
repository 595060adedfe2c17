"""Which waiting runs a worker starts now: least slack first, then priority, then scheduled time.

Pure: the worker hands in the waiting runs, its free devices and ``now``; the
decision says which runs to start on which devices and which runs can no
longer meet their deadline. Prefect places runs in time (schedules, ``start``);
this decides order and admission among the runs that are due.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone

from e31_prefect.inventory import Device, pick_devices


@dataclass(frozen=True)
class WaitingRun:
    """What the scheduler needs to know of a scheduled flow run."""

    id: Hashable
    gpus: int
    gpu_type: str | None
    scheduled: datetime
    latest_start: datetime | None = None
    priority: int = 0


@dataclass
class Decision:
    """Runs to start now (each with its devices) and runs whose deadline can no longer be met."""

    start: list[tuple[WaitingRun, list[Device]]] = field(default_factory=list)
    missed: list[WaitingRun] = field(default_factory=list)


_NO_DEADLINE = datetime.max.replace(tzinfo=timezone.utc)


def urgency(run: WaitingRun) -> tuple:
    """Sort key: earliest latest start (no deadline last), then higher priority, then scheduled time."""
    return (run.latest_start or _NO_DEADLINE, -run.priority, run.scheduled)


def decide(waiting: Iterable[WaitingRun], free: Sequence[Device], now: datetime) -> Decision:
    """Start, in order of urgency, every run that fits the devices still free; skip the rest."""
    decision = Decision()
    remaining = list(free)
    for run in sorted(waiting, key=urgency):
        if run.latest_start is not None and run.latest_start < now:
            decision.missed.append(run)
            continue
        devices = pick_devices(remaining, run.gpus, run.gpu_type)
        if devices is None:
            continue
        decision.start.append((run, devices))
        remaining = [d for d in remaining if d not in devices]
    return decision
