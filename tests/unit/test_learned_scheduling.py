"""Unit tests for planning with learned run times (issue 24): the decision with predicted lengths, a reservation
a misprediction delayed placed first, a deadline met only on a prediction marked so, and the simulator's three
kinds of knowledge (limits, learned, perfect) on the same jobs."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from e31_prefect.host.inventory import Device
from e31_prefect.planning.scheduling import Busy, Planned, TraceJob, WaitingRun, decide, plan, simulate

NOW = datetime(2026, 12, 3, 22, 0, tzinfo=timezone.utc)
FOUR = [Device(i, "H100") for i in range(4)]


def minutes(n: float) -> timedelta:
    return timedelta(minutes=n)


def test_a_run_planned_by_its_prediction_backfills_where_its_limit_would_not():
    # Two devices free until the big run's reservation in 30 minutes; the small job's limit is 2 h but its
    # deployment's runs take 12-14 min.
    busy = [Busy(d, NOW + minutes(30)) for d in FOUR[:2]]
    big = WaitingRun("big", 4, None, NOW, latest_start=NOW + minutes(40), duration=minutes(60))
    by_limit = WaitingRun("small", 1, None, NOW, latest_start=NOW + minutes(600), duration=minutes(120))
    learned = WaitingRun("small", 1, None, NOW, latest_start=NOW + minutes(600), duration=minutes(14),
                         limit=minutes(120))
    assert [r.id for r, _ in decide([big, by_limit], FOUR[2:], NOW, busy).start] == []
    assert [r.id for r, _ in decide([big, learned], FOUR[2:], NOW, busy).start] == ["small"]


def test_a_reservation_a_misprediction_delayed_is_met_first():
    # "late" was promised 21:50 (a run predicted to end then overran); since, "urgent" came with less slack.
    late = WaitingRun("late", 1, None, NOW - minutes(30), latest_start=NOW + minutes(120), duration=minutes(30))
    urgent = WaitingRun("urgent", 1, None, NOW, latest_start=NOW + minutes(60), duration=minutes(30))
    free = FOUR[:1]
    assert [r.id for r, _ in decide([late, urgent], free, NOW).start] == ["urgent"]
    decision = decide([late, urgent], free, NOW, promised={"late": NOW - minutes(10)})
    assert [r.id for r, _ in decision.start] == ["late"]
    assert decision.reserved == {"urgent": NOW + minutes(30)}


def test_a_promise_not_yet_due_or_of_a_run_gone_changes_nothing():
    late = WaitingRun("late", 1, None, NOW - minutes(30), latest_start=NOW + minutes(120), duration=minutes(30))
    urgent = WaitingRun("urgent", 1, None, NOW, latest_start=NOW + minutes(60), duration=minutes(30))
    for promised in ({"late": NOW + minutes(5)}, {"gone": NOW - minutes(5)}, {}):
        assert [r.id for r, _ in decide([late, urgent], FOUR[:1], NOW, promised=promised).start] == ["urgent"]


def test_a_delayed_run_past_its_latest_start_is_still_refused():
    late = WaitingRun("late", 1, None, NOW - minutes(30), latest_start=NOW - minutes(1), duration=minutes(30))
    decision = decide([late], FOUR[:1], NOW, promised={"late": NOW - minutes(10)})
    assert decision.start == [] and [r.id for r in decision.missed] == ["late"]


def test_a_deadline_met_only_on_a_prediction_is_marked_so():
    # Deadline 23:00; runs take 14 min of a 2 h limit: it starts at 22:30, which its limit could not afford.
    deadline = NOW + minutes(60)
    run = WaitingRun("r", 1, None, NOW, latest_start=deadline - minutes(14), duration=minutes(14),
                     limit=minutes(120))
    busy = [Busy(d, NOW + minutes(30)) for d in FOUR]
    [entry] = plan([run], [([], busy)], NOW)
    assert entry.start == NOW + minutes(30) and entry.meets_deadline and entry.on_prediction
    roomy = WaitingRun("r", 1, None, NOW, latest_start=NOW + minutes(600) - minutes(14), duration=minutes(14),
                       limit=minutes(120))
    [entry] = plan([roomy], [([], busy)], NOW)
    assert entry.meets_deadline and not entry.on_prediction
    assert not Planned(WaitingRun("x", 1, None, NOW, duration=minutes(5)), NOW, NOW + minutes(5)).on_prediction


def _trace(limit: timedelta) -> list[TraceJob]:
    # One deployment whose runs take 10 minutes and whose user set a 4 h limit; one GPU. Each run is due
    # within an hour of its submission, a run every 15 minutes.
    return [TraceJob(i, NOW + minutes(15 * i), 1, minutes(10), deadline=NOW + minutes(15 * i + 60),
                     limit=limit, kind="nightly") for i in range(20)]


def test_planning_by_limits_refuses_what_learning_meets():
    trace = _trace(timedelta(hours=4))
    limits = simulate(trace, "e31", 1, "limits")
    learned = simulate(trace, "e31", 1, "learned", past={"nightly": [600.0] * 20})
    perfect = simulate(trace, "e31", 1, "perfect")
    assert limits.deadlines_met == 0 and limits.refused == 20  # a 4 h limit can never finish within the hour
    assert learned.deadlines_met == perfect.deadlines_met == 20


def test_learning_from_nothing_plans_by_the_limit_until_runs_have_ended():
    # Jobs without a deadline run whatever their limit; they teach the plan of those that have one.
    early = [TraceJob(i, NOW + minutes(15 * i), 1, minutes(10), limit=timedelta(hours=4), kind="k") for i in range(3)]
    late = [TraceJob(3 + i, NOW + minutes(60 + 15 * i), 1, minutes(10), deadline=NOW + minutes(120 + 15 * i),
                     limit=timedelta(hours=4), kind="k") for i in range(5)]
    assert simulate(early + late, "e31", 1, "limits").deadlines_met == 0
    assert simulate(early + late, "e31", 1, "learned").deadlines_met == 5


def test_a_run_that_outlives_its_prediction_ends_when_it_ends():
    # Past runs took 5 minutes; this one takes 50 of its 1 h limit: it is not cut short, and the next run waits.
    trace = [TraceJob(0, NOW, 1, minutes(50), limit=timedelta(hours=1), kind="k"),
             TraceJob(1, NOW + minutes(1), 1, minutes(5), deadline=NOW + minutes(70), limit=timedelta(hours=1),
                      kind="k")]
    result = simulate(trace, "e31", 1, "learned", past={"k": [300.0] * 10})
    assert result.deadlines_met == 1
    assert result.mean_wait == timedelta(minutes=49) / 2


def test_unknown_knowledge_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="knowledge 'psychic' is none of limits, learned, perfect"):
        simulate(_trace(timedelta(hours=1)), "e31", 1, "psychic")
