"""`e31 usage` arithmetic: totals are exact sums of the per-run meters."""

from __future__ import annotations

import csv
import io
import json

import pytest

from e31_prefect.cli.usage import MalformedMeter, RunUsage, gpus_of, meter_from_table, meter_rows, render, summarize


def run(team, gpus, billed, outcome=None, deployment="train", pool="gpu", day="2026-12-02"):
    return RunUsage(team=team, deployment=deployment, pool=pool, day=day, gpus=gpus, billed_seconds=billed,
                    run_seconds=billed - 1, queue_seconds=30, outcome=outcome)


def test_totals_by_team_are_the_sums_of_the_runs():
    runs = [run("vision", 2, 3600), run("vision", 1, 1800, "timed-out"), run("research", 8, 0, "deadline-missed")]
    vision, research = summarize(runs, "team")
    assert (vision.group, vision.runs, vision.gpu_hours_billed, vision.time_outs) == ("vision", 2, 2.5, 1)
    assert vision.run_hours == pytest.approx((3599 + 1799) / 3600)
    assert vision.queue_hours == pytest.approx(60 / 3600)
    assert (research.gpu_hours_billed, research.deadline_misses) == (0.0, 1)


def test_grouping_by_day_and_an_unknown_grouping():
    runs = [run("a", 1, 3600, day="2026-12-01"), run("a", 1, 7200, day="2026-12-02")]
    assert [(t.group, t.gpu_hours_billed) for t in summarize(runs, "day")] == [("2026-12-02", 2.0),
                                                                              ("2026-12-01", 1.0)]
    with pytest.raises(ValueError, match="group by one of team, deployment, pool, day"):
        summarize(runs, "colour")


def test_formats_carry_the_same_figures():
    totals = summarize([run("vision", 2, 5400)], "team")
    assert json.loads(render(totals, "team", "json"))[0]["gpu_hours_billed"] == 3.0
    [row] = list(csv.DictReader(io.StringIO(render(totals, "team", "csv"))))
    assert (row["team"], float(row["gpu_hours_billed"]), row["runs"]) == ("vision", 3.0, "1")
    table = render(totals, "team", "table").splitlines()
    assert "gpu_hours_billed" in table[0] and "vision" in table[1] and "3.0000" in table[1]


def test_meter_figures_from_an_artifact_table():
    rows = [{"step": "submitted", "at": "2026-12-02T22:00:00+00:00", "seconds": 0},
            {"step": "picked", "at": "2026-12-02T22:00:30+00:00", "seconds": 30},
            {"step": "running", "at": "2026-12-02T22:01:00+00:00", "seconds": 30},
            {"step": "run_ended", "at": "2026-12-02T23:01:00+00:00", "seconds": 3600},
            {"step": "total billed", "at": "", "seconds": 3601.5}]
    assert meter_from_table(rows, gpus=2) == (3601.5, 3600.0, 30.0)


def test_meter_rows_come_from_the_json_text_the_worker_writes():
    rows = [{"step": "total billed", "at": "", "seconds": 60}]
    assert meter_rows(json.dumps(rows)) == rows
    assert meter_rows(rows) == rows


@pytest.mark.parametrize(("data", "why"), [
    ([1, 2, 3], "not a list of rows"),
    ('[1, 2, 3]', "not a list of rows"),
    ('{"step": "total billed"}', "not a list of rows"),
    ("[{\"at\": \"\"}]", "not a list of rows"),
    ("not json", "not JSON"),
    (None, "not a list of rows"),
])
def test_a_malformed_meter_is_named_not_a_crash(data, why):
    with pytest.raises(MalformedMeter, match=why):
        meter_from_table(meter_rows(data), gpus=1)


@pytest.mark.parametrize("rows", [
    [{"step": "running", "at": "yesterday"}],
    [{"step": "total billed", "at": "", "seconds": "lots"}],
    [{"step": "total billed", "at": "", "seconds": None}],
    [{"step": "running", "at": 5}],
])
def test_rows_that_are_no_meters_are_malformed(rows):
    with pytest.raises(MalformedMeter, match="not a meter's"):
        meter_from_table(rows, gpus=1)


def test_a_gpu_count_tag_that_is_no_number_is_malformed():
    assert gpus_of({"e31:gpus": "2"}) == 2 and gpus_of({}) == 0
    with pytest.raises(MalformedMeter, match="e31:gpus='-1'"):
        gpus_of({"e31:gpus": "-1"})
