"""Shards of one job (a Slurm job array): which shard runs on which slot next, and how the job ends.

A job file with ``work: {command: [...], shards: 10000}`` is run by the built-in
command flow (:mod:`e31_prefect.flows.command_flow`), one with ``work: {flow: ..., shards: 8}``
by the built-in flow-shards flow (:mod:`e31_prefect.flows.flow_shards`); both start each
shard through :mod:`e31_prefect.flows.shard_runner`. Everything here is pure: settings
carried to the job in ``E31_SHARDS``, the device slots, each shard's environment
and a flow shard's parameters, the schedule (a state machine the runner drives),
and the progress a person reads.
"""

from __future__ import annotations

import json
import math
from collections import Counter, deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Protocol

SHARDS_VARIABLE = "E31_SHARDS"  # the job's shard settings, as JSON, for the built-in flow that runs them
SHARD_PARAMETERS = ("shard_index", "shard_count")  # what each shard of a sharded flow receives


class _ShardsDeclared(Protocol):
    """What a job's ``work:`` says of its shards (:class:`e31_prefect.model.job_work.Work`)."""

    shards: int | None
    gpus_per_shard: int | None
    shards_per_gpu: int | None
    shard_retries: int | None
    allow_failed_shards: int | float | None
    reduce: list[str] | None


class _GpusRequested(Protocol):
    """How many GPUs a job's ``request:`` rents (:class:`e31_prefect.model.job.Request`)."""

    gpus: int


class ShardedJob(Protocol):
    """What :meth:`ShardSettings.of` reads of a job: a Protocol, so that shards need not import the job model
    (which imports shards to check a job's shard fields)."""

    @property
    def work(self) -> _ShardsDeclared: ...

    @property
    def request(self) -> _GpusRequested: ...


@dataclass(frozen=True)
class ShardSettings:
    """How a job's shards run: how many, on how many GPUs each, how many at once, retries, failures allowed.

    ``command`` and ``folder`` are set where the worker knows, before the work starts, what the shards run
    and where (a command deployed by e31, its folder the deployment's only pull step): the job's entry then
    starts the shards at once, not after Prefect has loaded (:func:`e31_prefect.flows.shard_runner.start_early`).
    """

    count: int
    gpus_per_shard: int = 1
    shards_per_gpu: int = 1
    retries: int = 0
    allow_failed: int | float = 0
    reduce: list[str] | None = None
    command: list[str] | None = None
    folder: str | None = None

    @classmethod
    def of(cls, job: ShardedJob, command: Sequence[str] | None = None,
           folder: str | None = None) -> ShardSettings | None:
        """The job's shard settings with their defaults filled in; None for a job without shards.

        ``command`` and ``folder``: what the run's shards will run and where, where the worker knows.
        """
        work = job.work
        if work.shards is None:
            return None
        default_gpus = 1 if job.request.gpus else 0  # a job renting no GPU has CPU-only shards
        return cls(count=work.shards,
                   gpus_per_shard=default_gpus if work.gpus_per_shard is None else work.gpus_per_shard,
                   shards_per_gpu=work.shards_per_gpu or 1, retries=work.shard_retries or 0,
                   allow_failed=work.allow_failed_shards or 0, reduce=work.reduce,
                   command=list(command) if command and folder else None, folder=folder if command else None)

    def to_text(self) -> str:
        """The settings as the job's ``E31_SHARDS`` value."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_text(cls, text: str) -> ShardSettings:
        """Settings from an ``E31_SHARDS`` value."""
        return cls(**json.loads(text))

    @property
    def allowed_failures(self) -> int:
        """How many shards may fail (after their retries) with the job still Completed."""
        return allowed_failures(self.count, self.allow_failed)


def entrypoint_problem(shards: int | None, entrypoint: str | None, command_flow: str,
                       flow_shards: str) -> str | None:
    """Why a run cannot run as its job says, from its deployment's entrypoint; None where it can.

    Shards are run by e31's built-in flows (``command_flow`` for a command, ``flow_shards`` for a flow): a
    deployment of a flow of its own would ignore ``work.shards`` and run once, and the flow-shards flow
    without shards has nothing to shard. An entrypoint not known (None) is let through.
    """
    if entrypoint is None or entrypoint == command_flow:
        return None
    if entrypoint == flow_shards:
        return None if shards is not None else (
            f"work.shards: not set, and this deployment runs e31's flow shards ({flow_shards}); set work.shards "
            "(e.g. shards: 8) or deploy the flow itself as the entrypoint")
    if shards is None:
        return None
    return (f"work.shards = {shards}: this deployment runs the flow {entrypoint} itself, which would run once; "
            f"deploy it with entrypoint {flow_shards} and parameters {{flow: {entrypoint}, parameters: {{...}}}} "
            "(e31 submit does this for a job file's work.flow), or remove shards")


def missing_shard_parameters(accepted: Collection[str]) -> list[str]:
    """Which of ``shard_index`` and ``shard_count`` a flow's function does not name among the parameters
    it ``accepted`` by keyword.

    Both must be named: ``**kwargs`` does not count, since Prefect gives a flow's ``**kwargs`` as one
    parameter holding a mapping, and a flow that took neither would do the same work in every shard.
    """
    return [name for name in SHARD_PARAMETERS if name not in accepted]


def missing_parameters_fix(flow: str, missing: Sequence[str]) -> str:
    """What to do about a sharded flow that cannot receive its shard."""
    function = flow.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
    return (f"{function} takes no {' or '.join(missing)} parameter, which each shard of a sharded flow receives; "
            f"add {'them' if len(missing) > 1 else 'it'} (def {function}(..., "
            f"{', '.join(f'{name}: int' for name in missing)})) or remove work.shards")


def shard_parameters(parameters: Mapping[str, Any], index: int, count: int) -> dict[str, Any]:
    """A flow shard's parameters: the job's own and its shard (the job's cannot name these two:
    :meth:`e31_prefect.model.job_work.Work.shard_problems`)."""
    return {**parameters, "shard_index": index, "shard_count": count}


def allowed_failures(count: int, allow: int | float) -> int:
    """A count stays a count; a fraction of ``count`` shards is rounded down (0.01 of 150 allows 1)."""
    if isinstance(allow, float):
        return math.floor(count * allow + 1e-9)  # 0.07 * 100 is 7.000000000000001 or 6.999...: mean 7
    return allow


def slot_count(gpus: int, gpus_per_shard: int, shards_per_gpu: int) -> int:
    """How many shards run at once on ``gpus`` devices (at least 1, so a plan never divides by zero)."""
    groups = gpus // gpus_per_shard if gpus_per_shard else 1
    return max(1, groups * shards_per_gpu)


def expected_array_duration(count: int, slots: int, per_shard: timedelta) -> timedelta:
    """How long ``count`` shards of ``per_shard`` each take over ``slots``: whole waves, the last maybe partial."""
    return per_shard * math.ceil(count / slots)


def slots(devices: Sequence[str], gpus_per_shard: int, shards_per_gpu: int) -> list[tuple[str, ...]]:
    """The places a shard may run at once, each with the devices it sees.

    ``devices`` are the job's own (its ``CUDA_VISIBLE_DEVICES`` entries). Each group of ``gpus_per_shard``
    devices gives ``shards_per_gpu`` slots; CPU-only shards (0 GPUs each) get ``shards_per_gpu`` slots
    without a device. Devices left over after the last whole group are not used.
    """
    if gpus_per_shard == 0:
        return [()] * shards_per_gpu
    groups = [tuple(devices[i:i + gpus_per_shard])
              for i in range(0, len(devices) - gpus_per_shard + 1, gpus_per_shard)]
    return [group for group in groups for _ in range(shards_per_gpu)]


def shard_environment(index: int, count: int, devices: tuple[str, ...], output_dir: str) -> dict[str, str]:
    """What one shard's process adds to the job's environment: its index under every name array users
    know (E31, Slurm, AWS Batch, Kubernetes), exactly its devices, and its own output folder."""
    visible = ",".join(devices)
    return {
        "E31_SHARD_INDEX": str(index), "E31_SHARD_COUNT": str(count),
        "SLURM_ARRAY_TASK_ID": str(index), "SLURM_ARRAY_TASK_COUNT": str(count),
        "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": str(count - 1),
        "AWS_BATCH_JOB_ARRAY_INDEX": str(index), "JOB_COMPLETION_INDEX": str(index),
        "CUDA_VISIBLE_DEVICES": visible, "NVIDIA_VISIBLE_DEVICES": visible or "none",
        "E31_OUTPUT_DIR": output_dir,
    }


def reduce_environment(count: int, failed: Sequence[int]) -> dict[str, str]:
    """What the reduce command adds to the job's environment: how many shards there were, and which failed
    (within the allowance), so it can combine the others."""
    return {"E31_SHARD_COUNT": str(count), "E31_FAILED_SHARDS": ",".join(map(str, sorted(failed)))}


def shard_folder(index: int) -> str:
    """A shard's folder under the job's output dir."""
    return f"shard-{index}"


@dataclass(frozen=True)
class Failure:
    """A shard that failed for good: its last attempt's exit code and last log lines."""

    shard: int
    attempts: int
    exit_code: int
    tail: str


@dataclass
class Schedule:
    """Which shard runs next on a free slot, and the count of each outcome.

    Shards go in index order; a failed shard with retries left goes to the front, so it runs again on
    the next free slot (any slot). Once more shards have failed for good than are allowed, the job can no
    longer succeed: no further shard starts (the rent is not spent on a lost cause) and the running ones
    are let finish.
    """

    count: int
    retries: int = 0
    allowed_failures: int = 0
    pending: deque[int] = field(default_factory=deque, init=False)
    running: dict[int, int] = field(default_factory=dict, init=False)  # shard -> slot
    attempts: Counter[int] = field(default_factory=Counter, init=False)
    succeeded: int = field(default=0, init=False)
    retried: int = field(default=0, init=False)
    failures: dict[int, Failure] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.pending = deque(range(self.count))

    def take(self, slot: int) -> int | None:
        """The shard to start on ``slot`` now, or None (nothing to start at the moment)."""
        if self.gave_up or not self.pending:
            return None
        shard = self.pending.popleft()
        self.attempts[shard] += 1
        self.running[shard] = slot
        return shard

    def finish(self, shard: int, exit_code: int, tail: str = "") -> str:
        """Record how a shard's attempt ended; returns ``done``, ``retry`` or ``failed``."""
        del self.running[shard]
        if exit_code == 0:
            self.succeeded += 1
            return "done"
        if self.attempts[shard] <= self.retries:
            self.retried += 1
            self.pending.appendleft(shard)
            return "retry"
        self.failures[shard] = Failure(shard, self.attempts[shard], exit_code, tail)
        return "failed"

    @property
    def gave_up(self) -> bool:
        """More shards failed for good than are allowed: the job can no longer succeed."""
        return len(self.failures) > self.allowed_failures

    @property
    def over(self) -> bool:
        """Nothing runs and nothing more will start: the runner's slots may stop."""
        return not self.running and (self.gave_up or not self.pending)

    @property
    def not_run(self) -> int:
        """Shards never run (or not run again) because the job gave up."""
        return len(self.pending) if self.gave_up else 0

    @property
    def ok(self) -> bool:
        """Whether the shards, once over, let the job end Completed."""
        return self.over and not self.gave_up

    def outcome(self) -> Outcome:
        """How the shards ended (call once :attr:`over`)."""
        return Outcome(count=self.count, allowed_failures=self.allowed_failures, succeeded=self.succeeded,
                       retried=self.retried, not_run=self.not_run, failures=dict(self.failures))

    def progress(self, elapsed_s: float) -> Progress:
        """The counts a person reads, ``elapsed_s`` seconds after the first shard started."""
        return Progress(count=self.count, done=self.succeeded, failed=len(self.failures),
                        running=len(self.running), elapsed_s=elapsed_s)


@dataclass(frozen=True)
class Outcome:
    """How a job's shards ended: what its run reports, and whether it may end Completed."""

    count: int
    allowed_failures: int
    succeeded: int
    retried: int
    not_run: int
    failures: dict[int, Failure]

    @property
    def ok(self) -> bool:
        """No more shards failed for good than are allowed."""
        return len(self.failures) <= self.allowed_failures

    def to_json(self) -> dict[str, Any]:
        """As JSON (what the shards' runner hands the flow)."""
        return {**asdict(self), "failures": [asdict(f) for f in self.failures.values()]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Outcome:
        """From :meth:`to_json`."""
        failures = [Failure(**f) for f in data["failures"]]
        return cls(**{**data, "failures": {f.shard: f for f in failures}})


@dataclass(frozen=True)
class Progress:
    """Shards done, failed and running; from them the fraction finished, the rate and the time left."""

    count: int
    done: int
    failed: int
    running: int
    elapsed_s: float

    @property
    def finished(self) -> int:
        """Shards that will not run again (succeeded or failed for good)."""
        return self.done + self.failed

    @property
    def fraction(self) -> float:
        """From 0 to 1."""
        return self.finished / self.count if self.count else 1.0

    @property
    def rate(self) -> float | None:
        """Shards finished per second so far (None before the first or at time zero)."""
        return self.finished / self.elapsed_s if self.finished and self.elapsed_s > 0 else None

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate so far (None until there is a rate)."""
        return (self.count - self.finished) / self.rate if self.rate else None

    def describe(self) -> str:
        """One line: ``4200/10000 shards done, 3 failed, 8 running; 41.2 shards/s; ETA 2m21s``."""
        line = f"{self.done}/{self.count} shards done, {self.failed} failed, {self.running} running"
        if self.rate is not None:
            line += f"; {self.rate:.1f} shards/s"
        if self.eta_s is not None and self.finished < self.count:
            line += f"; ETA {_duration(self.eta_s)}"
        return line


def progress_bar(percent: float, description: str, width: int = 30) -> str:
    """A one-line bar for a terminal: ``[#########.....................]  30% 3000/10000 shards done, ...``."""
    percent = min(max(percent, 0.0), 100.0)
    filled = int(width * percent / 100)
    return f"[{'#' * filled}{'.' * (width - filled)}] {percent:3.0f}% {description}"


def _duration(seconds: float) -> str:
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def failure_summary(outcome: Outcome, limit: int = 10) -> str:
    """Why the shards failed the job, for its final state: counts, then the first ``limit`` failed shards."""
    failures = sorted(outcome.failures.values(), key=lambda f: f.shard)
    head = (f"{len(failures)} of {outcome.count} shards failed (allowed: {outcome.allowed_failures})"
            + (f"; {outcome.not_run} not run after that" if outcome.not_run else "")
            + ". Failed shards: " + ", ".join(str(f.shard) for f in failures[:limit])
            + (f" and {len(failures) - limit} more" if len(failures) > limit else ""))
    lines = [head]
    for failure in failures[:limit]:
        last = failure.tail.strip().splitlines()[-1:] or ["(no output)"]
        lines.append(f"  shard {failure.shard}: exit {failure.exit_code} after {failure.attempts} "
                     f"attempt(s): {last[0][:200]}")
    return "\n".join(lines)


def failure_rows(outcome: Outcome) -> list[dict[str, object]]:
    """One table row per failed shard: index, attempts, exit code and its last log lines."""
    return [{"shard": f.shard, "attempts": f.attempts, "exit_code": f.exit_code, "last_lines": f.tail}
            for f in sorted(outcome.failures.values(), key=lambda f: f.shard)]
