"""Unit tests for @e31(...): the job it binds a flow to, and the clear errors for bad arguments."""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect import flow

from e31_prefect import JobError, e31
from e31_prefect.model.job_values import job_name
from e31_prefect.surface.decorators import E31Flow


@flow(name="Nightly track!", retries=2)
def track(threshold: int = 60) -> int:
    return threshold


HERE = Path(__file__).resolve().parent


def test_the_bound_flow_carries_the_job_as_job_variables():
    bound = e31(work_pool="gpu", gpus=2, gpu_type="H100", max_duration="2h", deadline="+8h", team="media",
                data=["./frames/", {"from": "s3://bucket/model.pt", "to": "model.pt", "size": 10}],
                output="s3://results/{job}/{flow_run.id}/", expect=["track.json"], env={"SEED": "7"})(track)
    assert isinstance(bound, E31Flow) and bound.work_pool == "gpu"
    variables = bound.job_variables
    assert variables["work"]["flow"] == f"{Path(__file__).resolve()}:track"
    assert variables["work"]["env"] == {"SEED": "7"}
    assert variables["request"]["gpus"] == 2 and variables["request"]["gpu_type"] == "H100"
    assert variables["request"]["max_duration"] == "2h" and variables["request"]["deadline"] == "+8h"
    assert variables["data"][0]["from"] == f"file://{HERE}/frames/"  # relative to the flow's file
    assert variables["data"][1] == {"from": "s3://bucket/model.pt", "to": "model.pt", "size": 10}
    assert variables["output"] == {"to": "s3://results/{job}/{flow_run.id}/", "expect": ["track.json"]}
    assert variables["team"] == "media"
    # What @flow set is kept.
    assert bound.name == "Nightly track!" and bound.retries == 2


def test_a_bad_request_value_names_the_field_and_the_fix():
    with pytest.raises(JobError) as raised:
        e31(work_pool="gpu", gpus=1, max_duration="2 hours")(track)
    text = str(raised.value)
    assert "request.max_duration" in text and "'2 hours'" in text


def test_an_unknown_request_argument_is_refused_with_the_fields_that_exist():
    with pytest.raises(JobError) as raised:
        e31(work_pool="gpu", gpu=1)
    text = str(raised.value)
    assert "gpu" in text and "gpus" in text and "max_duration" in text


def test_flow_names_become_job_names():
    assert job_name("Nightly track!") == "Nightly-track"
    assert job_name("retrain") == "retrain"
    assert job_name("***") == "flow"


def test_any_name_prefect_accepts_becomes_a_valid_job_name_and_a_valid_one_is_kept():
    from e31_prefect.model.job import parse_job

    for name in ("My Deployment 1", "nightly run / ../ #1 ünï", "x" * 300, "-lead", "../..", "a\nb"):
        made = job_name(name)
        parse_job({"name": made, "work": {"command": ["true"]}, "request": {"max_duration": "1m"}})
    assert job_name("My Deployment 1") == "My-Deployment-1"
    for valid in ("retrain-tonight", "train-", "v1.2_x"):
        assert job_name(valid) == valid


def test_a_start_time_is_refused_since_a_called_flow_starts_now():
    with pytest.raises(JobError) as raised:
        e31(work_pool="gpu", gpus=1, max_duration="1h", start="22:00")
    assert "start = '22:00'" in str(raised.value) and "prefect deploy" in str(raised.value)


def test_calling_the_flow_while_its_own_job_loads_it_is_refused(monkeypatch):
    bound = e31(work_pool="gpu", max_duration="1h")(track)
    monkeypatch.setenv("PREFECT__FLOW_ENTRYPOINT", bound.job_variables["work"]["flow"])
    with pytest.raises(RuntimeError, match="__main__"):
        bound(threshold=1)
