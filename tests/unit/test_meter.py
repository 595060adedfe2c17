"""Unit tests for e31_prefect.model.meter: step timestamps, what is billed, tags and the artifact table.

Teams pay for rent and run only (``run_ended - rented``); queueing, staging and output upload are
recorded but never billed.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from e31_prefect.model.meter import STEP_MEANING, STEPS, Meter, table, tags
from e31_prefect.model.prediction import run_seconds, usable

T0 = datetime(2026, 12, 3, 22, 0, tzinfo=timezone.utc)

# Seconds after T0 at which each step of a typical run happened.
TIMELINE = {
    "submitted": 0,
    "picked": 60,  # 60 s queued
    "staged": 180,  # 120 s staging
    "ready": 184,  # 4 s loading Prefect in the job's process, no device held (not billed)
    "rented": 200,  # 16 s waiting for devices (not billed)
    "running": 205,  # 5 s from the hand-over to the work's start (billed)
    "run_ended": 3925,  # 3720 s run (billed): 3725 s billed in all
    "output": 3985,  # 60 s output upload
    "released": 3990,
}


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def metered(
    gpus: int = 2, team: str | None = "vision", timeline: dict[str, float] = TIMELINE
) -> Meter:
    meter = Meter(gpus=gpus, team=team)
    for step, seconds in timeline.items():
        meter.mark(step, at(seconds))
    return meter


def test_billed_is_from_rented_to_run_ended():
    meter = metered()
    assert meter.billed_seconds == 3725.0
    assert meter.billed_gpu_seconds == 7450.0
    assert meter.run_seconds == 3720.0


def test_loading_prefect_before_the_hand_over_is_recorded_but_not_billed():
    meter = metered()
    assert meter.between("staged", "ready") == 4.0
    slow = metered(timeline={**TIMELINE, "ready": 199.5})
    assert slow.billed_seconds == meter.billed_seconds == 3725.0


def test_queue_staging_and_output_are_recorded_but_not_billed():
    meter = metered()
    assert (meter.queue_seconds, meter.staging_seconds, meter.output_seconds) == (60.0, 120.0, 60.0)

    slow = dict(TIMELINE)
    slow.update(submitted=-7200, picked=-3600, staged=199, output=9999, released=10000)
    slow_meter = metered(timeline=slow)
    assert (slow_meter.queue_seconds, slow_meter.staging_seconds, slow_meter.output_seconds) == (
        3600.0, 3799.0, 6074.0,
    )
    assert slow_meter.billed_seconds == meter.billed_seconds == 3725.0


@pytest.mark.parametrize(("gpus", "expected"), [(0, 0.0), (1, 3725.0), (2, 7450.0), (8, 29800.0)])
def test_billed_gpu_seconds_is_gpus_times_billed(gpus, expected):
    assert metered(gpus=gpus).billed_gpu_seconds == expected


def test_nothing_is_billed_before_the_run_ends():
    early = ("submitted", "picked", "rented")
    meter = metered(timeline={k: v for k, v in TIMELINE.items() if k in early})
    assert meter.billed_seconds == 0.0
    assert meter.billed_gpu_seconds == 0.0


def test_a_run_that_never_rented_is_not_billed():
    meter = Meter(gpus=1)
    meter.mark("submitted", at(0))
    meter.mark("picked", at(5))
    meter.mark("released", at(10))
    assert meter.billed_seconds == 0.0
    assert meter.queue_seconds == 5.0


def test_between_is_zero_when_a_step_is_missing_or_out_of_order():
    meter = Meter()
    meter.mark("rented", at(100))
    assert meter.between("rented", "run_ended") == 0.0
    meter.mark("run_ended", at(40))
    assert meter.between("rented", "run_ended") == 0.0
    assert meter.between("run_ended", "rented") == 60.0


def test_fractional_seconds_are_kept():
    meter = Meter(gpus=3)
    meter.mark("rented", at(0))
    meter.mark("run_ended", at(1.25))
    assert meter.billed_seconds == 1.25
    assert meter.billed_gpu_seconds == 3.75


# -- mark -------------------------------------------------------------------------------------


def test_mark_keeps_the_first_timestamp():
    meter = Meter()
    meter.mark("rented", at(10))
    meter.mark("rented", at(99))
    assert meter.marks == {"rented": at(10)}


def test_mark_refuses_an_unknown_step():
    with pytest.raises(ValueError, match="unknown meter step 'finished'"):
        Meter().mark("finished", at(0))


def test_every_step_has_a_meaning():
    assert set(STEP_MEANING) == set(STEPS)


# -- tags -------------------------------------------------------------------------------------


def test_tags_carry_the_meter():
    assert tags(metered(), "succeeded") == [
        "e31",
        "e31:gpus=2",
        "e31:billed-s=3725",
        "e31:run-s=3720",
        "e31:team=vision",
        "e31:succeeded",
    ]


def test_team_tag_only_when_a_team_is_set():
    assert tags(metered(team=None)) == ["e31", "e31:gpus=2", "e31:billed-s=3725", "e31:run-s=3720"]
    assert tags(metered(team="")) == ["e31", "e31:gpus=2", "e31:billed-s=3725", "e31:run-s=3720"]


def test_outcome_tag_only_when_given():
    assert tags(metered(team=None), "timed-out")[-1] == "e31:timed-out"
    assert all(not t.startswith("e31:timed") for t in tags(metered(), None))


def test_tags_round_billed_seconds():
    meter = Meter(gpus=1)
    meter.mark("rented", at(0))
    meter.mark("running", at(0.2))
    meter.mark("run_ended", at(3725.4))
    assert tags(meter)[2:4] == ["e31:billed-s=3725", "e31:run-s=3725"]


def test_tags_keep_tenths_of_short_work_so_it_is_learned_from():
    meter = Meter(gpus=1)
    meter.mark("rented", at(0))
    meter.mark("running", at(0.1))
    meter.mark("run_ended", at(0.46))
    run_tag = tags(meter)[3]
    assert tags(meter)[2:4] == ["e31:billed-s=0.5", "e31:run-s=0.4"]
    assert usable([run_seconds([run_tag])]) == [0.4]


def test_tags_of_an_empty_meter():
    assert tags(Meter()) == ["e31", "e31:gpus=0", "e31:billed-s=0", "e31:run-s=0"]


# -- table ------------------------------------------------------------------------------------


def test_table_rows_in_step_order_with_a_total():
    meter = Meter(gpus=2, team="vision")
    # Marked out of order: the table still follows the steps.
    for step in reversed(STEPS):
        meter.mark(step, at(TIMELINE[step]))
    rows = table(meter)
    assert [row["step"] for row in rows] == [*STEPS, "total billed"]
    assert [row["seconds"] for row in rows] == [
        0.0, 60.0, 120.0, 4.0, 16.0, 5.0, 3720.0, 60.0, 5.0, 3725.0,
    ]
    assert [row["billed"] for row in rows] == [
        False, False, False, False, False, True, True, False, False, True,
    ]
    assert rows[0] == {
        "step": "submitted",
        "at": "2026-12-03T22:00:00+00:00",
        "seconds": 0.0,
        "billed": False,
        "meaning": "scheduled start of the flow run",
    }
    assert rows[-1] == {
        "step": "total billed",
        "at": "",
        "seconds": 3725.0,
        "billed": True,
        "meaning": "2 GPU(s) x 3725.000 s = 7450.000 GPU-seconds",
    }


def test_billed_rows_add_up_to_the_total():
    rows = table(metered())
    assert sum(r["seconds"] for r in rows[:-1] if r["billed"]) == rows[-1]["seconds"]


def test_a_container_ready_after_its_rent_is_listed_after_it_and_its_load_billed():
    meter = metered(timeline={**TIMELINE, "rented": 184, "ready": 200})  # created once rented, then loaded
    rows = table(meter)
    assert [row["step"] for row in rows][3:6] == ["rented", "ready", "running"]
    assert [(row["seconds"], row["billed"]) for row in rows[3:6]] == [(4.0, False), (16.0, True), (5.0, True)]
    assert sum(r["seconds"] for r in rows[:-1] if r["billed"]) == rows[-1]["seconds"] == 3741.0


def test_table_skips_steps_that_did_not_happen():
    meter = Meter(gpus=1)
    meter.mark("submitted", at(0))
    meter.mark("picked", at(30))
    meter.mark("released", at(31.5))
    rows = table(meter)
    assert [(r["step"], r["seconds"]) for r in rows] == [
        ("submitted", 0.0), ("picked", 30.0), ("released", 1.5), ("total billed", 0.0),
    ]
    assert rows[-1]["meaning"] == "1 GPU(s) x 0.000 s = 0.000 GPU-seconds"


def test_table_of_an_empty_meter_is_just_the_total():
    assert table(Meter()) == [{
        "step": "total billed", "at": "", "seconds": 0.0, "billed": True,
        "meaning": "0 GPU(s) x 0.000 s = 0.000 GPU-seconds",
    }]
