"""The schedule of one submission: when a job may start, when it must end, when it must start by (pure).

``e31 submit job.yaml`` plans the job's times with :func:`plan` and refuses it with :func:`plan_problems`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from e31_prefect.model import timing
from e31_prefect.model.job import Job
from e31_prefect.model.job_values import Problem

# -- the schedule of one submission -------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """A job's times for one submission: when it may start, when it must end, when it must start by."""

    start: datetime
    deadline: datetime | None
    latest_start: datetime | None
    time_limit: timedelta | None


def plan(job: Job, now: datetime, *, start_now: bool = False) -> Plan:
    """Resolve the job's start and deadline as seen at ``now``.

    ``start_now`` ignores ``start``: the run starts now, and a deadline given as a time of day stays the one
    after the start the job declares (``start: "22:00"``, ``deadline: "07:00"`` run at 06:45 with ``--now``
    is due tomorrow at 07:00, not in 15 minutes); a relative deadline counts from now.
    """
    tz = job.tz
    start = now if start_now else timing.resolve_start(job.request.start, now, tz)
    deadline = timing.job_deadline(job.request.deadline, job.request.start, start, tz)
    return Plan(
        start=start,
        deadline=deadline,
        latest_start=timing.latest_start(deadline, job.admission_duration),
        time_limit=job.request.time_limit,
    )


def plan_problems(job: Job, the_plan: Plan) -> list[Problem]:
    """A job whose deadline comes before its start plus its time limit can never be met."""
    if the_plan.latest_start is None or the_plan.latest_start >= the_plan.start:
        return []
    assert the_plan.deadline is not None
    need = timing.format_duration(job.admission_duration)
    deadline, start = (moment.astimezone(job.tz).isoformat() for moment in (the_plan.deadline, the_plan.start))
    return [Problem(
        "request.deadline", job.request.deadline,
        f"is {deadline}, before the start {start} plus {need}; "
        "move the deadline later, start earlier, or shorten the time limit",
    )]
