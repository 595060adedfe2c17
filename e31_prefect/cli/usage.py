"""What finished E31 jobs cost, summed by team, deployment, pool or day: ``e31 usage --by team``.

Pure: each finished run's meter comes in as a :class:`RunUsage` (read from its
tags and meter artifact by the CLI), totals go out. Totals are sums of the
per-run figures, nothing estimated.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

GROUPINGS = ("team", "deployment", "pool", "day")


@dataclass(frozen=True)
class RunUsage:
    """One finished run's meter."""

    team: str
    deployment: str
    pool: str
    day: str
    gpus: int
    billed_seconds: float
    run_seconds: float
    queue_seconds: float
    outcome: str | None = None  # "deadline-missed", "timed-out", ...


@dataclass
class Total:
    """The sums for one group."""

    group: str
    runs: int = 0
    gpu_hours_billed: float = 0.0
    run_hours: float = 0.0
    queue_hours: float = 0.0
    deadline_misses: int = 0
    time_outs: int = 0
    _billed_gpu_seconds: float = field(default=0.0, repr=False)

    def add(self, run: RunUsage) -> None:
        self.runs += 1
        self._billed_gpu_seconds += run.gpus * run.billed_seconds
        self.gpu_hours_billed = self._billed_gpu_seconds / 3600
        self.run_hours += run.run_seconds / 3600
        self.queue_hours += run.queue_seconds / 3600
        self.deadline_misses += run.outcome == "deadline-missed"
        self.time_outs += run.outcome == "timed-out"


class MalformedMeter(ValueError):
    """A run's meter artifact or tags that are not what the worker writes: the run is named and skipped."""


def meter_rows(data: Any) -> list[dict]:
    """A meter artifact's data (JSON text of a list of rows, as the worker writes it) as its rows."""
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except ValueError as exc:
            raise MalformedMeter(f"its meter artifact's data is not JSON ({exc})") from None
    if not isinstance(data, list) or not all(isinstance(row, dict) and isinstance(row.get("step"), str)
                                             for row in data):
        raise MalformedMeter(f"its meter artifact's data is not a list of rows with a step: {str(data)[:80]!r}")
    return data


def gpus_of(tags: dict[str, str]) -> int:
    """The run's GPU count from its ``e31:gpus`` tag (0 when absent)."""
    text = tags.get("e31:gpus", "0")
    if not text.isdigit():
        raise MalformedMeter(f"its tag e31:gpus={text!r} is not a number of GPUs")
    return int(text)


def meter_from_table(rows: list[dict], gpus: int) -> tuple[float, float, float]:
    """Billed, run and queue seconds from a meter artifact's rows (MalformedMeter if they are not a meter's)."""
    try:
        return _meter_from_table(rows)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise MalformedMeter(f"its meter artifact's rows are not a meter's ({type(exc).__name__}: {exc})") from None


def _meter_from_table(rows: list[dict]) -> tuple[float, float, float]:
    at = {row["step"]: datetime.fromisoformat(row["at"]) for row in rows if row.get("at")}

    def between(first: str, last: str) -> float:
        return max(0.0, (at[last] - at[first]).total_seconds()) if first in at and last in at else 0.0

    billed = next((float(row["seconds"]) for row in rows if row["step"] == "total billed"), 0.0)
    return billed, between("running", "run_ended"), between("submitted", "picked")


def summarize(runs: Iterable[RunUsage], by: str) -> list[Total]:
    """Totals per group, largest bill first."""
    if by not in GROUPINGS:
        raise ValueError(f"--by {by!r}: group by one of {', '.join(GROUPINGS)}")
    totals: dict[str, Total] = {}
    for run in runs:
        key = getattr(run, by) or "-"
        totals.setdefault(key, Total(key)).add(run)
    return sorted(totals.values(), key=lambda t: (-t.gpu_hours_billed, t.group))


def render(totals: list[Total], by: str, fmt: str) -> str:
    """The totals as a table, CSV or JSON."""
    rows = [{by: t.group, **{k: v for k, v in asdict(t).items() if k not in ("group", "_billed_gpu_seconds")}}
            for t in totals]
    if fmt == "json":
        return json.dumps(rows, indent=2)
    columns = [by, "runs", "gpu_hours_billed", "run_hours", "queue_hours", "deadline_misses", "time_outs"]
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()
    lines = ["  ".join(f"{c:>16}" for c in columns)]
    for row in rows:
        lines.append("  ".join(f"{row[c]:>16.4f}" if isinstance(row[c], float) else f"{row[c]!s:>16}"
                               for c in columns))
    return "\n".join(lines)
