"""Unit tests for e31_prefect.model.prediction: a run's planned length learned from its deployment's past runs.

The rules: a high quantile of the usable past work times, never above the run's limit and never
at or below zero; the limit itself with too little history; junk in the history (zero, negative,
NaN, infinite, absurd, not a number) is ignored. Property-style tests check the bounds over many
seeded random histories.
"""

from __future__ import annotations

import math
import random
from datetime import timedelta

import pytest

from e31_prefect.model.prediction import (
    ABSURD,
    FLOOR,
    MIN_RUNS,
    QUANTILE,
    Prediction,
    human,
    predict,
    quantile,
    run_seconds,
    team_of,
    usable,
)

MIN = 60.0
TWO_HOURS = timedelta(hours=2)


def test_twenty_runs_of_twelve_to_fourteen_minutes_plan_fourteen_not_the_two_hour_limit():
    history = [12 * MIN + i * 6 for i in range(20)]  # 12:00 to 13:54
    prediction = predict(history, TWO_HOURS)
    assert prediction.learned and prediction.runs == 20
    assert timedelta(minutes=13) < prediction.duration < timedelta(minutes=14)
    assert prediction.basis() == "your last 20 runs took 12-14 min of a 2 h limit"


def test_too_little_history_plans_by_the_limit_and_says_so():
    prediction = predict([12 * MIN] * (MIN_RUNS - 1), TWO_HOURS)
    assert prediction == Prediction(TWO_HOURS, TWO_HOURS)
    assert not prediction.learned
    assert prediction.basis(MIN_RUNS - 1) == f"planned by its 2 h limit ({MIN_RUNS - 1} past run(s); {MIN_RUNS} " \
                                             "needed to learn from)"
    assert predict([], TWO_HOURS).basis() == f"planned by its 2 h limit (no past runs; {MIN_RUNS} needed to learn from)"


def test_no_limit_and_no_history_is_unknown_and_history_alone_plans_a_run_without_limit():
    assert predict([], None).duration is None
    assert "unknown" in predict([], None).basis()
    assert predict([10 * MIN] * 5, None).duration == timedelta(minutes=10)
    assert predict([10 * MIN] * 5, None).basis().endswith("took 10 min of no time limit")


def test_runs_longer_than_the_limit_never_plan_past_it():
    prediction = predict([3 * 3600.0] * 10, TWO_HOURS)  # the limit was raised, then lowered again
    assert prediction.duration == TWO_HOURS
    assert prediction.basis().endswith("took 3 h of a 2 h limit; planned as the limit")


@pytest.mark.parametrize("junk", [0, 0.0, -5, -1e300, math.nan, math.inf, -math.inf, ABSURD * 2, 1e308,
                                  True, "600", None, [600]])
def test_junk_in_a_history_is_ignored(junk):
    good = [600.0, 660.0, 720.0]
    assert predict([junk] * 50 + good, TWO_HOURS) == predict(good, TWO_HOURS)
    assert predict([junk] * 50, TWO_HOURS) == Prediction(TWO_HOURS, TWO_HOURS)  # nothing usable: the limit


def test_a_team_of_zeroes_cannot_plan_a_run_at_zero():
    prediction = predict([0.0, -1.0, 1e-9, 1e-9, 1e-9], TWO_HOURS)
    assert prediction.duration > timedelta(0)


@pytest.mark.parametrize("seed", range(300))
def test_a_prediction_is_never_at_or_below_zero_nor_above_the_limit(seed):
    rng = random.Random(seed)
    pool = [lambda: rng.uniform(-1e6, 1e6), lambda: rng.choice([0, -0.0, math.nan, math.inf, -math.inf, 1e308]),
            lambda: rng.expovariate(1 / 600), lambda: rng.uniform(0, 1e-6), lambda: rng.choice([True, "x", None]),
            lambda: rng.uniform(ABSURD * 0.99, ABSURD * 1.01)]
    history = [rng.choice(pool)() for _ in range(rng.randrange(0, 60))]
    limit = rng.choice([None, timedelta(seconds=rng.uniform(1, 86400 * 30))])
    prediction = predict(history, limit, q=rng.uniform(0, 1), min_runs=rng.randrange(0, 6))
    if prediction.duration is None:
        assert limit is None and not prediction.learned
        return
    assert prediction.duration > timedelta(0)
    assert prediction.duration <= timedelta(seconds=ABSURD)
    if limit is not None:
        assert prediction.duration <= limit
    if prediction.learned:
        times = usable(history)
        assert prediction.runs == len(times)
        assert prediction.low <= prediction.duration or prediction.duration == limit
        assert prediction.duration <= max(prediction.high, FLOOR)
        # A time some run took (to timedelta's microsecond), the one-second floor, or the limit.
        choices = [*times, 1.0, *([limit.total_seconds()] if limit else [])]
        assert any(abs(prediction.duration.total_seconds() - c) <= 1e-6 for c in choices)
    else:
        assert prediction.duration == limit


@pytest.mark.parametrize("seed", range(100))
def test_the_quantile_is_a_time_some_run_took_and_at_least_the_share_took_no_longer(seed):
    rng = random.Random(seed)
    values = [rng.uniform(1, 1000) for _ in range(rng.randrange(1, 40))]
    q = rng.uniform(0.01, 1)
    found = quantile(values, q)
    assert found in values
    assert sum(v <= found for v in values) >= q * len(values) - 1e-9
    assert quantile(values, 1.0) == max(values) and quantile(values, 0.0) == min(values)


def test_the_default_quantile_ignores_one_odd_slow_run_in_twenty():
    history = [600.0] * 19 + [5400.0]
    assert QUANTILE < 0.95
    assert predict(history, TWO_HOURS).duration == timedelta(minutes=10)


def test_work_times_and_teams_are_read_from_the_workers_meter_tags():
    assert run_seconds(["e31", "e31:gpus=1", "e31:billed-s=800", "e31:run-s=742"]) == 742.0
    assert run_seconds(["e31", "e31:billed-s=800"]) is None
    assert run_seconds(["e31:run-s=lots"]) is None
    assert team_of(["e31:team=vision", "e31"]) == "vision"
    assert team_of(["e31"]) is None


@pytest.mark.parametrize(("seconds", "said"), [(45, "45 s"), (720, "12 min"), (7200, "2 h"), (5400, "1 h 30 min"),
                                               (86400 * 2, "2 d"), (86400 + 3 * 3600, "1 d 3 h")])
def test_lengths_are_said_as_people_say_them(seconds, said):
    assert human(timedelta(seconds=seconds)) == said


def test_an_eight_hour_limit_reads_an():
    assert "of an 8 h limit" in predict([600.0] * 5, timedelta(hours=8)).basis()
