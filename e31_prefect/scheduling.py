"""Which waiting runs a worker starts now: least slack first, then priority, then scheduled time.

Pure: the worker hands in the waiting runs, its devices (free now, or busy
until a running run's time limit) and ``now``; the decision says which runs to
start on which devices and which runs can no longer meet their deadline.
Prefect places runs in time (schedules, ``start``); this decides order and
admission among the runs that are due.

Backfill, in the manner of Slurm's conservative backfill: a run that cannot
start now is given a reservation at the earliest time enough devices will be
free (up to ``RESERVATION_DEPTH`` runs); a less urgent run may start now only
on devices it would leave before any reservation begins, so it never delays
a more urgent run's earliest possible start, and big runs are not starved by
a stream of small ones.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from e31_prefect.inventory import Device, matches

RESERVATION_DEPTH = 64
_NO_DEADLINE = datetime.max.replace(tzinfo=timezone.utc)
_FOREVER = timedelta(days=3650)
_END_OF_TIME = datetime.max.replace(tzinfo=timezone.utc) - timedelta(days=3651)


@dataclass(frozen=True)
class WaitingRun:
    """What the scheduler needs to know of a scheduled flow run."""

    id: Hashable
    gpus: int
    gpu_type: str | None
    scheduled: datetime
    latest_start: datetime | None = None
    priority: int = 0
    # How long it may hold its devices (its time limit, else its expected duration); None: unknown.
    duration: timedelta | None = None


@dataclass(frozen=True)
class Busy:
    """A device held by a running run until (at the latest) ``until``; None: no known end."""

    device: Device
    until: datetime | None


@dataclass
class Decision:
    """Runs to start now (each with its devices), runs whose deadline can no longer be met,
    and the start each blocked run was promised."""

    start: list[tuple[WaitingRun, list[Device]]] = field(default_factory=list)
    missed: list[WaitingRun] = field(default_factory=list)
    reserved: dict[Hashable, datetime] = field(default_factory=dict)


def urgency(run: WaitingRun) -> tuple:
    """Sort key: earliest latest start (no deadline last), then higher priority, then scheduled time."""
    return (run.latest_start or _NO_DEADLINE, -run.priority, run.scheduled)


class _Timeline:
    """Busy intervals per device, from running runs, runs started now and reservations."""

    def __init__(self, free: Sequence[Device], busy: Sequence[Busy], now: datetime):
        self.now = now
        self.intervals: dict[Device, list[tuple[datetime, datetime]]] = {d: [] for d in free}
        for held in busy:
            until = now + _FOREVER if held.until is None else max(held.until, now)
            bisect.insort(self.intervals.setdefault(held.device, []), (now, until))

    def earliest(self, run: WaitingRun, horizon: datetime | None) -> tuple[datetime, list[Device]] | None:
        """The earliest start (not after ``horizon``) at which ``run.gpus`` devices are free for its duration."""
        if run.gpus == 0:
            return self.now, []
        length = run.duration or _FOREVER
        windows = {d: self._windows(d, length) for d in self.intervals if matches(d, run.gpu_type)}
        if len(windows) < run.gpus:
            return None
        # Sweep the windows' edges in time order: the first moment inside `gpus` windows is the start.
        edges = sorted((moment, kind) for ranges in windows.values() for first, last in ranges
                       for moment, kind in ((first, 0), (last, 1)))
        inside = 0
        for moment, kind in edges:
            if horizon is not None and moment > horizon:
                return None
            if kind == 0:
                inside += 1
                if inside >= run.gpus:
                    fitting = sorted(d for d, ranges in windows.items()
                                     if any(first <= moment <= last for first, last in ranges))
                    return moment, fitting[: run.gpus]
            else:
                inside -= 1
        return None

    def _windows(self, device: Device, length: timedelta) -> list[tuple[datetime, datetime]]:
        """The ranges of start times at which ``device`` stays free for ``length``."""
        ranges, free_from = [], self.now
        for start, end in self.intervals[device]:
            if end <= free_from:
                continue
            if start - length >= free_from:
                ranges.append((free_from, start - length))
            free_from = max(free_from, end)
        ranges.append((free_from, _END_OF_TIME))
        return ranges

    def hold(self, devices: Sequence[Device], start: datetime, run: WaitingRun) -> None:
        for device in devices:
            bisect.insort(self.intervals[device], (start, start + (run.duration or _FOREVER)))


def decide(
    waiting: Iterable[WaitingRun],
    free: Sequence[Device],
    now: datetime,
    busy: Sequence[Busy] = (),
    *,
    order: Callable[[WaitingRun], tuple] = urgency,
    backfill: bool = True,
    refuse_missed: bool = True,
    reservation_depth: int = RESERVATION_DEPTH,
) -> Decision:
    """Start, in order of urgency, every run that fits now without delaying a more urgent run's reservation.

    With ``backfill=False`` it is plain first fit in the given order: whatever fits now starts.
    ``order`` and ``refuse_missed`` exist so the simulator can replay other policies.
    """
    decision = Decision()
    timeline = _Timeline(free, busy, now)
    idle = set(free)  # devices nothing occupies at this moment
    reservations = 0
    ordered = sorted(waiting, key=order)
    for position, run in enumerate(ordered):
        if refuse_missed and run.latest_start is not None and run.latest_start < now:
            decision.missed.append(run)
            continue
        promising = backfill and reservations < reservation_depth
        if not idle and not promising:
            # No GPU can start now and no more promises are made: what remains is missed deadlines
            # and runs that need no GPU.
            for rest in ordered[position:]:
                if refuse_missed and rest.latest_start is not None and rest.latest_start < now:
                    decision.missed.append(rest)
                elif rest.gpus == 0:
                    decision.start.append((rest, []))
            break
        found = timeline.earliest(run, horizon=None if promising else now)
        if found is None:
            continue
        start, devices = found
        timeline.hold(devices, start, run)
        if start == now:
            decision.start.append((run, devices))
            idle.difference_update(devices)
        else:
            decision.reserved[run.id] = start
            reservations += 1
    return decision


# -- replaying a trace ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceJob:
    """One job of a trace: when it is submitted, what it asks for, how long it really runs."""

    id: int
    submit: datetime
    gpus: int
    duration: timedelta
    deadline: datetime | None = None
    priority: int = 0


@dataclass(frozen=True)
class SimulationResult:
    """What a policy achieved on a trace."""

    policy: str
    jobs: int
    with_deadline: int
    deadlines_met: int
    utilisation: float
    mean_wait: timedelta
    refused: int

    @property
    def percent_met(self) -> float:
        """Deadlines met, in percent of the jobs that had one."""
        return 100.0 * self.deadlines_met / self.with_deadline if self.with_deadline else 100.0


POLICIES: dict[str, dict] = {
    # Prefect's own order: scheduled time, whatever fits, late runs still run.
    "fifo": {"order": lambda r: (r.scheduled,), "backfill": False, "refuse_missed": False},
    # Earliest deadline first, whatever fits, late runs still run.
    "edf": {"order": lambda r: ((r.latest_start + r.duration) if r.latest_start and r.duration else _NO_DEADLINE,
                                r.scheduled),
            "backfill": False, "refuse_missed": False},
    # e31: least slack, priority, conservative backfill, runs that can no longer make it refused.
    "e31": {"order": urgency, "backfill": True, "refuse_missed": True},
}


def simulate(trace: Sequence[TraceJob], policy: str, gpus: int) -> SimulationResult:
    """Replay ``trace`` on a pool of ``gpus`` identical GPUs with the same decision function the worker uses.

    Time jumps from event to event (a submission or a run ending); at each, the policy decides.
    A job's time limit is its real duration, so reservations are exact.
    """
    settings = POLICIES[policy]
    devices = [Device(i, "GPU") for i in range(gpus)]
    arrivals = sorted(trace, key=lambda j: (j.submit, j.id))
    by_id = {job.id: job for job in trace}
    waiting: dict[int, WaitingRun] = {}
    ends: list[tuple[datetime, int]] = []  # heap of (end, job id)
    held: dict[int, tuple[list[Device], datetime]] = {}
    met = refused = 0
    busy_seconds = 0.0
    waits: list[float] = []
    now = arrivals[0].submit if arrivals else datetime.now(timezone.utc)
    start_of_trace, last_end = now, now
    index = 0
    while index < len(arrivals) or waiting or ends:
        while ends and ends[0][0] <= now:
            _, finished = heapq.heappop(ends)
            del held[finished]
        while index < len(arrivals) and arrivals[index].submit <= now:
            job = arrivals[index]
            index += 1
            waiting[job.id] = WaitingRun(
                job.id, job.gpus, None, job.submit,
                latest_start=None if job.deadline is None else job.deadline - job.duration,
                priority=job.priority, duration=job.duration)
        in_use = {d for devs, _ in held.values() for d in devs}
        busy = [Busy(d, until) for devs, until in held.values() for d in devs]
        decision = decide(waiting.values(), [d for d in devices if d not in in_use], now, busy,
                          **settings)
        for run in decision.missed:
            del waiting[run.id]
            refused += 1
        for run, chosen in decision.start:
            job = by_id[run.id]
            del waiting[run.id]
            end = now + job.duration
            held[job.id] = (chosen, end)
            heapq.heappush(ends, (end, job.id))
            busy_seconds += job.gpus * job.duration.total_seconds()
            waits.append((now - job.submit).total_seconds())
            last_end = max(last_end, end)
            if job.deadline is not None and end <= job.deadline:
                met += 1
        upcoming = [t for t in (ends[0][0] if ends else None,
                                arrivals[index].submit if index < len(arrivals) else None) if t is not None]
        if not upcoming:
            break  # what still waits can never fit this pool
        now = min(upcoming)
    span = (last_end - start_of_trace).total_seconds() or 1.0
    return SimulationResult(
        policy=policy,
        jobs=len(trace),
        with_deadline=sum(1 for job in trace if job.deadline is not None),
        deadlines_met=met,
        utilisation=busy_seconds / (gpus * span),
        mean_wait=timedelta(seconds=sum(waits) / len(waits)) if waits else timedelta(0),
        refused=refused,
    )
