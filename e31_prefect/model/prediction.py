"""How long a run will take, learned from its deployment's recent runs: ``e31 submit``, ``e31 queue``.

    E31_HISTORY_RUNS=20 prefect worker start --pool gpu --type e31

Users set time limits far above what their jobs take, since a run that overruns is killed. The
scheduler plans with a prediction instead: a high quantile (:data:`QUANTILE`) of the work times of
the last runs of the same deployment and team, capped by the run's own limit. With fewer than
:data:`MIN_RUNS` usable times the limit itself is the plan. The limit stays the limit: a run that
outlives its prediction is not killed, the next poll plans around it.

Pure: the history comes in as numbers (seconds), read elsewhere (:mod:`e31_prefect.planning.run_history`).
A history is what workers wrote, but nothing in it is trusted to be sane: zero, negative, NaN,
infinite or absurd (over :data:`ABSURD`) times are ignored, so no history moves a prediction
below zero or above the limit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

QUANTILE = 0.9  # high enough that a run rarely outlives its plan, low enough to ignore an odd slow run
MIN_RUNS = 3  # fewer completed runs say too little: plan by the limit
ABSURD = timedelta(days=366).total_seconds()  # no run lasts longer than the longest limit a job may set
FLOOR = timedelta(seconds=1)  # a plan of a few microseconds (or 0, at timedelta's resolution) plans nothing
RUN_SECONDS_TAG = "e31:run-s="  # the worker's meter of the work's own time (meter.tags)


@dataclass(frozen=True)
class Prediction:
    """A run's planned length and what it stands on.

    ``duration`` is what the scheduler plans with: the learned time capped by ``limit``, or the limit
    itself with too little history (None: neither is known). ``runs`` is how many past work times
    it stands on (0: the limit); ``low`` and ``high`` their range.
    """

    duration: timedelta | None
    limit: timedelta | None
    runs: int = 0
    low: timedelta | None = None
    high: timedelta | None = None

    @property
    def learned(self) -> bool:
        """Whether the plan comes from history rather than the limit."""
        return self.runs > 0

    def basis(self, history: int = 0) -> str:
        """What the prediction stands on, for a user: "your last 20 runs took 12-14 min of a 2 h limit".
        ``history`` is how many usable times there were (told when too few to learn from)."""
        limit = f"{human(self.limit)} limit" if self.limit is not None else "no time limit"
        article = "" if self.limit is None else "an " if limit[0] == "8" or limit.startswith(("11 ", "18 ")) else "a "
        if not self.learned:
            if self.limit is None:
                return "no time limit and too little history: its length is unknown"
            seen = f"{history} past run(s)" if history else "no past runs"
            return f"planned by its {limit} ({seen}; {MIN_RUNS} needed to learn from)"
        assert self.low is not None and self.high is not None and self.duration is not None
        took = human(self.low) if _same(self.low, self.high) else _span(self.low, self.high)
        capped = "; planned as the limit" if self.limit is not None and self.duration >= self.limit else ""
        return f"your last {self.runs} runs took {took} of {article}{limit}{capped}"


def usable(seconds: Iterable[object]) -> list[float]:
    """The times in ``seconds`` worth learning from: real numbers above 0 and not absurd."""
    kept = []
    for value in seconds:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        value = float(value)
        if math.isfinite(value) and 0.0 < value <= ABSURD:
            kept.append(value)
    return kept


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (not empty): a time some run really took."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def predict(history: Iterable[object], limit: timedelta | None, *, q: float = QUANTILE,
            min_runs: int = MIN_RUNS) -> Prediction:
    """The planned length of a run whose time limit is ``limit``, from the work times (seconds) of its
    deployment's recent runs: their ``q`` quantile, never above the limit; the limit with too little history."""
    times = usable(history)
    if len(times) < max(1, min_runs):
        return Prediction(limit, limit)
    learned = max(FLOOR, timedelta(seconds=quantile(times, q)))
    duration = learned if limit is None or limit <= timedelta(0) else min(learned, limit)
    return Prediction(duration, limit, len(times), timedelta(seconds=min(times)), timedelta(seconds=max(times)))


def run_seconds(tags: Iterable[str]) -> float | None:
    """The work time a worker's meter tagged a run with (``e31:run-s=742``); None without a readable one."""
    for tag in tags:
        if tag.startswith(RUN_SECONDS_TAG):
            try:
                return float(tag[len(RUN_SECONDS_TAG):])
            except ValueError:
                return None
    return None


def team_of(tags: Iterable[str]) -> str | None:
    """The team a worker's meter tagged a run with (``e31:team=vision``); None: no team."""
    return next((tag[len("e31:team="):] for tag in tags if tag.startswith("e31:team=")), None)


def human(delta: timedelta | None) -> str:
    """A length as a person says it: ``45 s``, ``12 min``, ``2 h``, ``1 h 30 min``, ``2 d``."""
    if delta is None:
        return "?"
    seconds = delta.total_seconds()
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 86400:
        hours, minutes = divmod(round(seconds / 60), 60)
        return f"{hours} h" + (f" {minutes} min" if minutes else "")
    days, hours = divmod(round(seconds / 3600), 24)
    return f"{days} d" + (f" {hours} h" if hours else "")


def _same(low: timedelta, high: timedelta) -> bool:
    return human(low) == human(high)


def _span(low: timedelta, high: timedelta) -> str:
    """``12-14 min`` where both ends share a unit, else ``50 min-2 h``."""
    first, last = human(low), human(high)
    unit_first, unit_last = first.split(" ", 1)[1], last.split(" ", 1)[1]
    if unit_first == unit_last and " " not in unit_first:
        return f"{first.split(' ')[0]}-{last}"
    return f"{first}-{last}"
