"""The meter of one job: a timestamp per step, and what the team pays for.

Teams pay for rent and run only: ``billed_seconds = run_ended - rented`` and
``billed_gpu_seconds = gpus * billed_seconds``. Queueing, staging and output
upload are recorded but never billed. Pure: no clock, no client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

STEPS = ("submitted", "picked", "staged", "ready", "rented", "running", "run_ended", "output", "released")
STEP_MEANING = {
    "submitted": "scheduled start of the flow run",
    "picked": "an e31 worker took the run",
    "staged": "inputs copied into the workspace",
    "ready": "the job's work loaded Prefect, waiting for its devices (a process: before the rent, not billed)",
    "rented": "devices handed to the work: the meter starts",
    "running": "the work started",
    "run_ended": "the work ended and the devices went back: the meter stops",
    "output": "outputs sent to their destination",
    "released": "workspace cleaned, meter closed",
}


@dataclass
class Meter:
    """Step timestamps of one flow run and the figures derived from them."""

    gpus: int = 0
    team: str | None = None
    devices: list[int] = field(default_factory=list)
    marks: dict[str, datetime] = field(default_factory=dict)

    def mark(self, step: str, at: datetime) -> None:
        """Record when a step happened (the first time only: a step happens once)."""
        if step not in STEPS:
            raise ValueError(f"unknown meter step {step!r}")
        self.marks.setdefault(step, at)

    def between(self, first: str, last: str) -> float:
        """Seconds from one step to another; 0 when either did not happen."""
        if first not in self.marks or last not in self.marks:
            return 0.0
        return max(0.0, (self.marks[last] - self.marks[first]).total_seconds())

    @property
    def billed_seconds(self) -> float:
        """Rent and run: from the devices being held to the work ending."""
        return self.between("rented", "run_ended")

    @property
    def billed_gpu_seconds(self) -> float:
        """Billed seconds times the GPUs held."""
        return self.gpus * self.billed_seconds

    @property
    def run_seconds(self) -> float:
        """How long the work itself ran."""
        return self.between("running", "run_ended")

    @property
    def queue_seconds(self) -> float:
        """From the scheduled start until a worker took the run (not billed)."""
        return self.between("submitted", "picked")

    @property
    def staging_seconds(self) -> float:
        """Copying inputs in (not billed)."""
        return self.between("picked", "staged")

    @property
    def output_seconds(self) -> float:
        """Sending outputs back (not billed)."""
        return self.between("run_ended", "output")


def work_end(ended: datetime, stop_requested: datetime | None = None, grace_seconds: float = 0.0) -> datetime:
    """When the work truly ended, as its supervisor recorded it: where billing stops.

    That is the moment no process of the job could use its devices any more (its last process gone), not
    a word the job writes: a job that says its flow returned and goes on is billed until it is gone. A stop
    (the time limit, a cancel) bills at most its grace, whatever the container engine did after it.
    """
    if stop_requested is not None:
        return min(ended, stop_requested + timedelta(seconds=grace_seconds))
    return ended


def tag_seconds(seconds: float) -> str:
    """Seconds as a tag carries them: whole from 10 s, tenths below (work of 0.4 s did not take 0 s, and
    what a deployment's runs took is learned from these tags)."""
    return f"{seconds:.0f}" if seconds >= 10 or seconds == 0 else f"{seconds:.1f}"


def tags(meter: Meter, outcome: str | None = None, attempt: int = 1, earlier_billed_seconds: float = 0.0) -> list[str]:
    """The flow run's tags that carry the meter, e.g. ``e31:gpus=2``, ``e31:billed-s=3725``.

    A run's later attempt (its host was lost) bills its earlier ones too: ``e31:billed-s`` is the run's whole
    bill, ``e31:run-s`` this attempt's work (what its deployment's runs take is learned from it), and
    ``e31:attempts=N`` says how many there were.
    """
    result = [
        "e31",
        f"e31:gpus={meter.gpus}",
        f"e31:billed-s={tag_seconds(meter.billed_seconds + earlier_billed_seconds)}",
        f"e31:run-s={tag_seconds(meter.run_seconds)}",
    ]
    if attempt > 1:
        result.append(f"e31:attempts={attempt}")
    if meter.team:
        result.append(f"e31:team={meter.team}")
    if outcome:
        result.append(f"e31:{outcome}")
    return result


def table(meter: Meter) -> list[dict[str, object]]:
    """Artifact rows: each step with its time, the seconds since the previous step, and the bill; in the order
    the steps happened (a container is ready after its rent)."""
    rows: list[dict[str, object]] = []
    previous: datetime | None = None
    rented, ended = meter.marks.get("rented"), meter.marks.get("run_ended")
    for step in sorted(meter.marks, key=lambda step: (meter.marks[step], STEPS.index(step))):
        at = meter.marks[step]
        rows.append({
            "step": step,
            "at": at.isoformat(),
            "seconds": round((at - previous).total_seconds(), 3) if previous else 0.0,
            # The seconds since the previous step lie within the rent: from its start, before the work's end.
            "billed": None not in (previous, rented, ended) and rented <= previous < ended,  # type: ignore[operator]
            "meaning": STEP_MEANING[step],
        })
        previous = at
    rows.append({
        "step": "total billed",
        "at": "",
        "seconds": round(meter.billed_seconds, 3),
        "billed": True,
        "meaning": f"{meter.gpus} GPU(s) x {meter.billed_seconds:.3f} s = "
        f"{meter.billed_gpu_seconds:.3f} GPU-seconds",
    })
    return rows
