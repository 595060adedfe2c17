"""`e31 run` for the person at the keyboard: data beside the job's folder is staged, and the run's log says so;
a shared pool's worker (`prefect worker start`) keeps the rule and refuses it."""

from __future__ import annotations

import time
from pathlib import Path
from uuid import UUID

import pytest
from prefect import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

from tests.integration.conftest import cli, flow_run_id
from tests.integration.test_jobs_end_to_end import read_run, write_job

pytestmark = pytest.mark.integration

COUNT_FLOW = """
    from prefect import flow
    from e31_prefect import data_dir, output_dir

    @flow
    def count():
        rows = (data_dir() / "people.csv").read_text().splitlines()[1:]
        (output_dir() / "count.txt").write_text(str(len(rows)))
    """

JOB = """
    name: people
    work: {flow: flow.py:count}
    data: [{from: ../data/people.csv}]
    request: {gpus: 0, max_duration: 5m}
    output: {to: "./out/{flow_run.id}/"}
    """


def run_logs(run_id: UUID, containing: str, timeout: float = 60) -> str:
    """The run's log messages, once one contains ``containing`` (or all of them at the timeout)."""
    text = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with get_client(sync_client=True) as client:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
        text = "\n".join(log.message for log in logs)
        if containing in text:
            return text
        time.sleep(1)
    return text


def test_e31_run_stages_data_beside_the_job_folder_and_says_so(prefect_server, tmp_path: Path, pool):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "people.csv").write_text("name\nada\ngrace\n")
    job = write_job(tmp_path / "job", JOB, flow=COUNT_FLOW)

    result = cli("e31", "run", str(job), "--now", "--pool", pool)
    assert result.returncode == 0, result.stdout + result.stderr
    run_id = flow_run_id(result.stdout)
    assert (tmp_path / "job" / "out" / str(run_id) / "count.txt").read_text() == "2"
    said = f"e31 run: staging {tmp_path / 'data' / 'people.csv'} from outside the job's folder"
    assert said in run_logs(run_id, said)


def test_a_shared_pool_keeps_the_rule_for_the_same_job(prefect_server, tmp_path: Path, pool):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "people.csv").write_text("name\nada\n")
    job = write_job(tmp_path / "job", JOB, flow=COUNT_FLOW)

    submitted = cli("e31", "submit", str(job), "--now", "--pool", pool)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    run_id = flow_run_id(submitted.stdout)
    worker = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once")
    assert worker.returncode == 0, worker.stdout + worker.stderr
    state = read_run(run_id).state
    assert state.name == "StagingFailed", state
    assert f"{tmp_path / 'data' / 'people.csv'}: outside the folders" in state.message
