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

A run's devices are all one model (a job split across H100s and A100s runs at
the slower one's pace), so free capacity is planned per model as a count of
free devices over time. The worker keeps its waiting runs in a
:class:`WaitingQueue` across polls, so a decision never sorts: the runs past
their latest start are a prefix of it, and the walk stops once no device is
idle and no more reservations are made.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from e31_prefect.host.inventory import Device, matches

RESERVATION_DEPTH = 64
_OVERDUE_HOLD_SECONDS = 1.0
_NO_DEADLINE = datetime.max.replace(tzinfo=timezone.utc)


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
    # Its Prefect work queue's priority: 1 is the most important queue, as in Prefect.
    queue_priority: int = 0
    # Its hard time limit where ``duration`` is a prediction learned from past runs (e31_prefect.model.prediction);
    # None: ``duration`` is the limit itself.
    limit: timedelta | None = None
    # What ``duration`` stands on, for a user ("your last 20 runs took 12-14 min of a 2 h limit").
    basis: str | None = field(default=None, compare=False)


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
    """Sort key: its work queue's priority (Prefect's order of queues), then earliest latest start (no
    deadline last), then higher ``request.priority``, then scheduled time."""
    return (run.queue_priority, run.latest_start or _NO_DEADLINE, -run.priority, run.scheduled)


class WaitingQueue:
    """Waiting runs kept in order (urgency by default) as runs come and go, so deciding never sorts.

    Runs that need no GPU are kept apart: they start at once, whatever their place.
    """

    def __init__(self, runs: Iterable[WaitingRun] = (), order: Callable[[WaitingRun], tuple] = urgency):
        self.order = order
        self._keys: list[tuple] = []
        self._runs: list[WaitingRun] = []
        self._gpuless: dict[Hashable, WaitingRun] = {}
        self._by_id: dict[Hashable, WaitingRun] = {}
        self._queues: Counter[int] = Counter()  # how many ordered runs each work-queue priority has
        self._added = 0
        self.sync(runs)

    def add(self, run: WaitingRun) -> None:
        """Put ``run`` in its place (replacing an older version of it)."""
        if run.id in self._by_id:
            if self._by_id[run.id] == run:
                return
            self.discard(run.id)
        key = self._remember(run)
        if key is not None:
            at = bisect.bisect(self._keys, key)
            self._keys.insert(at, key)
            self._runs.insert(at, run)

    def _remember(self, run: WaitingRun) -> tuple | None:
        """Know ``run``; its place in the order, or None for a run kept apart (it needs no GPU)."""
        self._by_id[run.id] = run
        if run.gpus == 0:
            self._gpuless[run.id] = run
            return None
        self._added += 1
        self._queues[run.queue_priority] += 1
        return (*self.order(run), self._added)  # the count keeps equal keys in arrival order

    def discard(self, run_id: Hashable) -> None:
        """Take a run out (started, missed or gone from the pool); unknown ids are ignored."""
        run = self._by_id.pop(run_id, None)
        if run is None or self._gpuless.pop(run_id, None) is not None:
            return
        at = bisect.bisect_left(self._keys, self.order(run))
        while self._runs[at].id != run_id:
            at += 1
        del self._keys[at], self._runs[at]
        self._queues[run.queue_priority] -= 1
        if not self._queues[run.queue_priority]:
            del self._queues[run.queue_priority]

    def sync(self, runs: Iterable[WaitingRun]) -> None:
        """Make the queue hold exactly ``runs``: new ones are placed, vanished ones dropped."""
        current = {run.id: run for run in runs}
        for gone in [run_id for run_id, run in self._by_id.items()
                     if (given := current.get(run_id)) is not run and given != run]:
            self.discard(gone)
        new = [run for run_id, run in current.items() if run_id not in self._by_id]
        if len(new) > len(self._runs) // 8:
            # Many newcomers: one sort beats many inserts.
            for run in new:
                key = self._remember(run)
                if key is not None:
                    self._keys.append(key)
                    self._runs.append(run)
            placed = sorted(zip(self._keys, self._runs, strict=True), key=lambda pair: pair[0])
            self._keys, self._runs = [k for k, _ in placed], [r for _, r in placed]
        else:
            for run in new:
                self.add(run)

    def overdue(self, now: datetime) -> list[WaitingRun]:
        """The runs past their latest start: in urgency order they lead each work queue's runs."""
        if self.order is not urgency:
            raise ValueError("only a queue in urgency order keeps its overdue runs in front")
        late: list[WaitingRun] = []
        for queue in sorted(self._queues):
            first = bisect.bisect_left(self._keys, (queue,))
            late += self._runs[first:bisect.bisect_left(self._keys, (queue, now))]
        return late

    def get(self, run_id: Hashable) -> WaitingRun | None:
        """The waiting run ``run_id``; None if it is not waiting."""
        return self._by_id.get(run_id)

    @property
    def gpuless(self) -> list[WaitingRun]:
        """Waiting runs that need no GPU, in order (few: sorted when asked)."""
        return sorted(self._gpuless.values(), key=self.order)

    def __iter__(self) -> Iterator[WaitingRun]:
        return iter(self._runs)

    def __len__(self) -> int:
        return len(self._by_id)


class _Model:
    """The devices of one model and how many of them are free from now on: a step function of seconds."""

    def __init__(self, devices: list[Device], idle: list[Device], busy_seconds: list[float]):
        self.first = min(devices)  # stands for the model: its name, and its place among models
        self.size = len(devices)
        self.idle = sorted(idle)  # free at this moment, lowest index first
        self.times = [0.0]  # seconds from now where the free count changes
        self.free = [len(idle)]
        for end in sorted(busy_seconds):
            if end == self.times[-1]:
                self.free[-1] += 1
            else:
                self.times.append(end)
                self.free.append(self.free[-1] + 1)

    def earliest(self, gpus: int, length: float, horizon: float) -> float | None:
        """The first time (not after ``horizon``) from which ``gpus`` devices stay free for ``length``."""
        times, free = self.times, self.free
        count, index = len(times), 0
        while index < count:
            if free[index] < gpus:
                index += 1
                continue
            start = times[index]
            if start > horizon or start == math.inf:
                return None  # never, or not soon enough
            end = start + length
            index += 1
            while index < count and times[index] < end and free[index] >= gpus:
                index += 1
            if index == count or times[index] >= end:
                return start
        return None

    def hold(self, gpus: int, start: float, length: float) -> None:
        """Count ``gpus`` devices as taken from ``start`` for ``length`` seconds."""
        first = self._breakpoint(start)
        last = self._breakpoint(start + length) if length != math.inf else len(self.times)
        for index in range(first, last):
            self.free[index] -= gpus

    def _breakpoint(self, moment: float) -> int:
        index = bisect.bisect_left(self.times, moment)
        if index == len(self.times) or self.times[index] != moment:
            self.times.insert(index, moment)
            self.free.insert(index, self.free[index - 1])
        return index


def _models(free: Sequence[Device], busy: Sequence[Busy], now: datetime) -> list[_Model]:
    """The host's devices grouped by model, each with its free count over time."""
    groups: dict[str, tuple[list[Device], list[Device], list[float]]] = {}
    for device in free:
        group = groups.setdefault(device.name, ([], [], []))
        group[0].append(device)
        group[1].append(device)
    for held in busy:
        group = groups.setdefault(held.device.name, ([], [], []))
        group[0].append(held.device)
        # A hold past its end (a run over its expected duration) still holds: it ends any moment, not now.
        group[2].append(math.inf if held.until is None else max(_OVERDUE_HOLD_SECONDS,
                                                                 (held.until - now).total_seconds()))
    return sorted((_Model(devices, idle, ends) for devices, idle, ends in groups.values()),
                  key=lambda model: model.first)


def _seconds(duration: timedelta | None) -> float:
    return math.inf if duration is None else duration.total_seconds()


def decide(
    waiting: WaitingQueue | Iterable[WaitingRun],
    free: Sequence[Device],
    now: datetime,
    busy: Sequence[Busy] = (),
    *,
    order: Callable[[WaitingRun], tuple] = urgency,
    backfill: bool = True,
    refuse_missed: bool = True,
    reservation_depth: int = RESERVATION_DEPTH,
    promised: Mapping[Hashable, datetime] | None = None,
) -> Decision:
    """Start, in order of urgency, every run that fits now without delaying a more urgent run's reservation.

    ``waiting`` is a :class:`WaitingQueue` kept across polls, or any runs (then sorted by ``order``).
    With ``backfill=False`` it is plain first fit in the given order: whatever fits now starts.
    ``order`` and ``refuse_missed`` exist so the simulator can replay other policies.

    ``promised`` is the last decision's reservations. A run whose promised start has passed was delayed
    by a run that outlived its predicted length: it is placed first (in order of urgency among such runs),
    so the devices that run frees go to it, not to a run that came since.
    """
    queue = waiting if isinstance(waiting, WaitingQueue) else WaitingQueue(waiting, order)
    decision = Decision()
    for run in queue.gpuless:
        late = refuse_missed and run.latest_start is not None and run.latest_start < now
        (decision.missed.append(run) if late else decision.start.append((run, [])))
    models = _models(free, busy, now)
    idle = sum(len(model.idle) for model in models)
    late: set[Hashable] = set()
    if refuse_missed and queue.order is urgency:
        decision.missed.extend(queue.overdue(now))  # found by bisection, so the loop below may stop early
        late = {run.id for run in decision.missed}
    if (not refuse_missed or queue.order is urgency) and all(
            model.earliest(1, 0.0, math.inf) is None for model in models):
        return decision  # every device held with no known end: nothing starts, nothing can be promised
    reservations = 0
    delayed = sorted((run for run_id, at in (promised or {}).items()
                      if at <= now and run_id not in late and (run := queue.get(run_id)) is not None
                      and run.gpus), key=queue.order)
    first = {run.id for run in delayed}
    # Lazily: the walk stops early, and a list of every waiting run would cost what the walk saves.
    for run in itertools.chain(delayed, (run for run in queue if run.id not in first)) if delayed else queue:
        if run.id in late:
            continue
        if refuse_missed and run.latest_start is not None and run.latest_start < now:
            decision.missed.append(run)
            continue
        promising = backfill and reservations < reservation_depth
        if not promising and idle == 0:
            break  # nothing can start now and no more promises are made
        if not promising and run.gpus > idle:
            continue
        length = _seconds(run.duration)
        found = _earliest(models, run, length, math.inf if promising else 0.0)
        if found is None:
            continue
        model, start = found
        model.hold(run.gpus, start, length)
        if start == 0.0:
            devices, model.idle = model.idle[: run.gpus], model.idle[run.gpus:]
            idle -= run.gpus
            decision.start.append((run, devices))
        else:
            decision.reserved[run.id] = now + timedelta(seconds=start)
            reservations += 1
    return decision


def _earliest(models: list[_Model], run: WaitingRun, length: float,
              horizon: float) -> tuple[_Model, float] | None:
    """The model (and the time from now) where ``run`` can hold its devices for ``length`` seconds
    soonest, not after ``horizon``."""
    best: tuple[_Model, float] | None = None
    for model in models:
        if model.size < run.gpus or not matches(model.first, run.gpu_type):
            continue
        start = model.earliest(run.gpus, length, horizon if best is None else min(horizon, best[1]))
        if start is not None and (best is None or start < best[1]):
            best = (model, start)
    return best


@dataclass(frozen=True)
class Planned:
    """When a waiting run is planned to start and finish; None: it fits no host (or its deadline has passed)."""

    run: WaitingRun
    start: datetime | None
    finish: datetime | None  # None also when its duration is unknown

    @property
    def meets_deadline(self) -> bool | None:
        """Whether it starts by its latest start (so it finishes by its deadline); None: it has no deadline."""
        if self.run.latest_start is None:
            return None
        return self.start is not None and self.start <= self.run.latest_start

    @property
    def on_prediction(self) -> bool:
        """Whether it meets its deadline only on its predicted length: run to its full time limit, it would not."""
        run = self.run
        if not self.meets_deadline or run.limit is None or run.duration is None or self.start is None:
            return False
        assert run.latest_start is not None
        return self.start + run.limit > run.latest_start + run.duration


def plan(waiting: WaitingQueue | Iterable[WaitingRun], hosts: Sequence[tuple[Sequence[Device], Sequence[Busy]]],
         now: datetime) -> list[Planned]:
    """Every waiting run's planned start and finish over the pool's hosts (each: free devices, busy devices),
    in order of urgency: :func:`decide`'s reservations with no depth limit, each run on the host where it
    can start soonest (a run's devices are on one host). A run past its latest start is planned nowhere:
    the next poll refuses it.
    """
    queue = waiting if isinstance(waiting, WaitingQueue) else WaitingQueue(waiting)
    models = [_models(free, busy, now) for free, busy in hosts]
    planned = []
    for run in [*queue.gpuless, *queue]:
        if run.latest_start is not None and run.latest_start < now:
            planned.append(Planned(run, None, None))
            continue
        offset = 0.0
        if run.gpus:
            length = _seconds(run.duration)
            best: tuple[_Model, float] | None = None
            for host in models:
                found = _earliest(host, run, length, math.inf)
                if found is not None and (best is None or found[1] < best[1]):
                    best = found
            if best is None:
                planned.append(Planned(run, None, None))
                continue
            model, offset = best
            model.hold(run.gpus, offset, length)
        start = now + timedelta(seconds=offset)
        planned.append(Planned(run, start, None if run.duration is None else start + run.duration))
    return planned


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
    # The time limit its user set (None: its true duration), and the deployment it comes from (whose
    # past runs a learned plan learns from).
    limit: timedelta | None = None
    kind: Hashable = None


# What a simulated scheduler knows of a run's length: its user's limit, what past runs of its kind
# took (e31_prefect.model.prediction), or (for comparison) the truth.
KNOWLEDGE = ("limits", "learned", "perfect")


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
    # The share of GPU time spent on runs that met their deadline or had none: late work counts for nothing.
    on_time_utilisation: float = 0.0

    @property
    def percent_met(self) -> float:
        """Deadlines met, in percent of the jobs that had one."""
        return 100.0 * self.deadlines_met / self.with_deadline if self.with_deadline else 100.0


POLICIES: dict[str, dict] = {
    # Prefect's own order: scheduled time, whatever fits, late runs still run.
    "fifo": {"order": lambda r: (r.scheduled,), "backfill": False, "refuse_missed": False},
    # Prefect's order under e31's admission rule: runs that can no longer make it are refused.
    "fifo-admit": {"order": lambda r: (r.scheduled,), "backfill": False, "refuse_missed": True},
    # Earliest deadline first, whatever fits, late runs still run.
    "edf": {"order": lambda r: ((r.latest_start + r.duration) if r.latest_start and r.duration else _NO_DEADLINE,
                                r.scheduled),
            "backfill": False, "refuse_missed": False},
    # e31: least slack, priority, conservative backfill, runs that can no longer make it refused.
    "e31": {"order": urgency, "backfill": True, "refuse_missed": True},
}


def simulate(trace: Sequence[TraceJob], policy: str, gpus: int, knowledge: str = "perfect",
             history_runs: int = 20, past: Mapping[Hashable, Sequence[float]] | None = None) -> SimulationResult:
    """Replay ``trace`` on a pool of ``gpus`` identical GPUs with the same decision function the worker uses.

    Time jumps from event to event (a submission or a run ending); at each, the policy decides.
    ``knowledge`` is what a run's planned length is: ``perfect`` its real duration (reservations are
    exact), ``limits`` the limit its user set, ``learned`` the worker's prediction from the last
    ``history_runs`` runs of its kind (the limit until enough have ended; ``past`` gives each kind's work
    times, in seconds, from before the trace, as a pool that has run before has). A run always takes its real
    duration; a run that outlives its plan holds its devices until it ends, as in a worker.
    """
    from e31_prefect.model.prediction import predict

    if knowledge not in KNOWLEDGE:
        raise ValueError(f"knowledge {knowledge!r} is none of {', '.join(KNOWLEDGE)}")
    settings = dict(POLICIES[policy])
    history: dict[Hashable, list[float]] = {kind: list(times)[-history_runs:] for kind, times in (past or {}).items()}
    promised: dict[Hashable, datetime] = {}

    def planned_length(job: TraceJob) -> tuple[timedelta, timedelta | None]:
        limit = job.limit or job.duration
        if knowledge == "perfect":
            return job.duration, None
        if knowledge == "limits":
            return limit, None
        predicted = predict(history.get(job.kind, ()), limit).duration
        assert predicted is not None
        return predicted, limit

    waiting = WaitingQueue(order=settings.pop("order"))
    devices = [Device(i, "GPU") for i in range(gpus)]
    arrivals = sorted(trace, key=lambda j: (j.submit, j.id))
    by_id = {job.id: job for job in trace}
    ends: list[tuple[datetime, int]] = []  # heap of (end, job id)
    held: dict[int, tuple[list[Device], datetime]] = {}  # devices, and when the plan expects them back
    finished_kinds: set[Hashable] = set()
    met = refused = 0
    busy_seconds = on_time_seconds = 0.0
    waits: list[float] = []
    now = arrivals[0].submit if arrivals else datetime.now(timezone.utc)
    start_of_trace, last_end = now, now
    index = 0
    while index < len(arrivals) or waiting or ends:
        while ends and ends[0][0] <= now:
            _, finished = heapq.heappop(ends)
            del held[finished]
            done = by_id[finished]
            past = history.setdefault(done.kind, [])
            past.append(done.duration.total_seconds())
            del past[:-history_runs]
            finished_kinds.add(done.kind)
        while index < len(arrivals) and arrivals[index].submit <= now:
            job = arrivals[index]
            index += 1
            waiting.add(_waiting(job, *planned_length(job)))
        if knowledge == "learned" and finished_kinds:
            # What just ended teaches the plan of the runs of its kind still waiting: re-plan them.
            for run in [run for run in waiting if by_id[run.id].kind in finished_kinds]:
                job = by_id[run.id]
                fresh = _waiting(job, *planned_length(job))
                if fresh != run:
                    waiting.add(fresh)
            finished_kinds.clear()
        in_use = {d for devs, _ in held.values() for d in devs}
        busy = [Busy(d, until) for devs, until in held.values() for d in devs]
        decision = decide(waiting, [d for d in devices if d not in in_use], now, busy, promised=promised,
                          **settings)
        promised = decision.reserved
        for run in decision.missed:
            waiting.discard(run.id)
            refused += 1
        for run, chosen in decision.start:
            job = by_id[run.id]
            waiting.discard(run.id)
            end = now + job.duration
            held[job.id] = (chosen, now + run.duration if run.duration is not None else end)
            heapq.heappush(ends, (end, job.id))
            busy_seconds += job.gpus * job.duration.total_seconds()
            waits.append((now - job.submit).total_seconds())
            last_end = max(last_end, end)
            if job.deadline is not None and end <= job.deadline:
                met += 1
            if job.deadline is None or end <= job.deadline:
                on_time_seconds += job.gpus * job.duration.total_seconds()
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
        on_time_utilisation=on_time_seconds / (gpus * span),
    )


def _waiting(job: TraceJob, length: timedelta, limit: timedelta | None) -> WaitingRun:
    """A trace job as a worker sees it waiting: planned for ``length``, its deadline judged on that length."""
    return WaitingRun(job.id, job.gpus, None, job.submit,
                      latest_start=None if job.deadline is None else job.deadline - length,
                      priority=job.priority, duration=length, limit=limit)
