"""A run's result kept with its outputs, and the job's storage block name."""

from __future__ import annotations

from pathlib import Path
from uuid import uuid4

import pytest
from prefect.results import ResultRecordMetadata
from prefect.states import Completed, Failed, to_state_create

from e31_prefect.data.results import (
    RESULTS_FOLDER,
    local_result_key,
    result_environment,
    result_url,
    state_reading_from,
)
from e31_prefect.model.job import Job, parse_job
from e31_prefect.model.job_values import JobError

JOB = {"name": "j", "work": {"command": ["true"]}, "request": {"max_duration": "5m"}}


def completed(storage_key: str, block_id=None) -> Completed:
    state = Completed(message="All states completed.")
    state.data = ResultRecordMetadata(storage_key=storage_key, storage_block_id=block_id)
    return state


def test_the_job_names_its_storage_block_and_keeps_it_through_job_variables():
    job = parse_job({**JOB, "storage": "e31-store"})
    assert job.storage == "e31-store"
    assert Job.from_job_variables(job.to_job_variables(), "j") == job


def test_a_storage_name_that_cannot_be_a_block_name_is_refused():
    with pytest.raises(JobError) as caught:
        parse_job({**JOB, "storage": "My Store"})
    assert "storage = 'My Store': is not a block name" in str(caught.value)


def test_the_flow_persists_its_result_under_its_output_dir_and_tasks_do_not():
    env = result_environment("/e31/output")
    assert env["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] == f"/e31/output/{RESULTS_FOLDER}"
    assert env["PREFECT_RESULTS_PERSIST_BY_DEFAULT"] == "true"
    assert env["PREFECT_TASKS_DEFAULT_PERSIST_RESULT"] == "false"


def test_the_result_is_found_by_name_whatever_path_the_job_saw(tmp_path: Path):
    (tmp_path / RESULTS_FOLDER).mkdir()
    (tmp_path / RESULTS_FOLDER / "abc123").write_bytes(b"x")
    assert local_result_key(completed(f"/e31/output/{RESULTS_FOLDER}/abc123"), tmp_path) == "abc123"
    assert local_result_key(completed(f"/elsewhere/{RESULTS_FOLDER}/missing"), tmp_path) is None
    assert local_result_key(completed("/home/me/.prefect/storage/abc123"), tmp_path) is None
    assert local_result_key(completed(f"s3://x/{RESULTS_FOLDER}/abc123", uuid4()), tmp_path) is None
    assert local_result_key(Failed(), tmp_path) is None


def test_the_completed_state_then_reads_the_sent_copy():
    block = uuid4()
    state = completed(f"/e31/output/{RESULTS_FOLDER}/abc123")
    url = result_url("s3://bucket/runs/7/", "abc123")
    assert url == f"s3://bucket/runs/7/{RESULTS_FOLDER}/abc123"
    moved = to_state_create(state_reading_from(state, url, block))
    assert moved.type == state.type and moved.message == state.message
    assert (moved.data.storage_key, moved.data.storage_block_id) == (url, block)
    local = to_state_create(state_reading_from(state, result_url("file:///srv/out", "abc123"), block))
    assert (local.data.storage_key, local.data.storage_block_id) == (f"/srv/out/{RESULTS_FOLDER}/abc123", None)
