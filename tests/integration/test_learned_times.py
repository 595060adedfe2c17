"""Learned run times against a real Prefect server: after a few completed runs of a deployment with a long limit,
``e31 submit`` and ``e31 queue`` plan its next run by what those runs took, say so, and the pool's plan is an
artifact in the Prefect UI.

Runs the real ``e31 submit``, ``prefect worker start --run-once`` and ``e31 queue``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from tests.integration.conftest import cli, flow_run_id
from tests.integration.test_jobs_end_to_end import mark_job, read_run

pytestmark = pytest.mark.integration

LIVE = {"PREFECT_WORKER_HEARTBEAT_SECONDS": "600"}  # the worker that ran counts as live for the plan


def test_after_three_runs_submit_and_queue_plan_by_what_they_took_not_the_four_hour_limit(
        prefect_server, tmp_path: Path, pool):
    job = mark_job(tmp_path / "nightly", "nightly", max_duration="4h")
    first = []
    for _ in range(3):
        submitted = cli("e31", "submit", str(job), "--pool", pool)
        assert submitted.returncode == 0, submitted.stderr
        first.append(flow_run_id(submitted.stdout))
    # With no history, the run is planned by its limit, and submit says why.
    assert "  planned for 4 h: planned by its 4 h limit (no past runs; 3 needed to learn from)" in submitted.stdout, \
        submitted.stdout
    worker = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once", gpus="3xH100", env=LIVE)
    assert worker.returncode == 0, worker.stdout + worker.stderr
    for run_id in first:
        run = read_run(run_id)
        assert run.state.is_completed(), run.state
        assert any(tag.startswith("e31:run-s=") for tag in run.tags)

    submitted = cli("e31", "submit", str(job), "--pool", pool)

    assert submitted.returncode == 0, submitted.stderr
    planned = next(line for line in submitted.stdout.splitlines() if line.startswith("  planned for "))
    assert "your last 3 runs took " in planned and " of a 4 h limit" in planned, submitted.stdout
    assert "  planned start: " in submitted.stdout and "behind 0 run(s) on 1 live worker(s)" in submitted.stdout
    shown = cli("e31", "queue", "--pool", pool)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    [row] = [line for line in shown.stdout.splitlines() if " nightly " in line]
    assert "your last 3 runs took " in row and " of a 4 h limit" in row
    assert re.search(r"  \d+ s +your last 3 runs", row), row  # planned for seconds, not four hours

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"e31-plan-{pool}"])))
    assert artifacts, "no plan artifact for the pool"
    latest = max(artifacts, key=lambda artifact: artifact.created).data  # one key, a version per change
    rows = json.loads(latest) if isinstance(latest, str) else latest
    [entry] = [row for row in rows if row.get("job") == "nightly"]
    assert entry["basis"].startswith("your last 3 runs took ") and entry["planned start"] != "never"
    assert entry["planned length"].endswith(" s")


def test_a_run_past_its_limits_latest_start_but_not_its_predictions_runs_and_meets_its_deadline(
        prefect_server, tmp_path: Path, pool):
    # Three runs of "tight" (1 h limit, no deadline) teach the pool it takes seconds.
    relaxed = mark_job(tmp_path / "relaxed", "tight", max_duration="1h")
    for _ in range(3):
        assert cli("e31", "submit", str(relaxed), "--pool", pool).returncode == 0
    worker = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once", gpus="3xH100", env=LIVE)
    assert worker.returncode == 0, worker.stdout + worker.stderr
    # The same job with a deadline an hour away: by its limit it must start at once, and a moment later it
    # can no longer make it; by what its runs take it has nearly an hour.
    tight = mark_job(tmp_path / "tight", "tight", max_duration="1h", deadline="+1h")
    submitted = cli("e31", "submit", str(tight), "--pool", pool)
    assert submitted.returncode == 0, submitted.stderr
    run_id = flow_run_id(submitted.stdout)

    worker = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once", gpus="1xH100", env=LIVE)

    assert worker.returncode == 0, worker.stdout + worker.stderr
    run = read_run(run_id)
    assert run.state.is_completed(), (run.state, worker.stdout[-3000:], worker.stderr[-3000:])
    assert (tmp_path / "tight" / "out" / "ran").exists()


def _plan_versions(pool: str) -> list:
    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"e31-plan-{pool}"])))


def test_a_pools_worker_writes_the_plan_artifact_of_its_waiting_runs(prefect_server, tmp_path, pool):
    # Two 1-GPU runs wait on a worker with one GPU: the worker's plan has one starting now, one after it.
    job = mark_job(tmp_path / "pair", "pair", max_duration="10m")
    for _ in range(2):
        assert cli("e31", "submit", str(job), "--pool", pool).returncode == 0
    written = len(_plan_versions(pool))  # e31 submit wrote its own
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "E31_HOME": str(home), "E31_DEVICE_LOCKS": str(home / "locks"), "E31_GPUS": "1xH100",
           "PREFECT_WORKER_QUERY_SECONDS": "1", "E31_PLAN_ARTIFACT_SECONDS": "1"}
    with (home / "worker.log").open("wb") as log:
        worker = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", pool,
                                   "--type", "e31"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and len(_plan_versions(pool)) <= written:
            time.sleep(1)
    finally:
        worker.terminate()
        worker.wait(timeout=60)
    versions = _plan_versions(pool)
    assert len(versions) > written, (home / "worker.log").read_text()[-3000:]
    latest = max(versions, key=lambda artifact: artifact.created)
    assert latest.type == "table" and latest.description.startswith(f"E31 plan of pool {pool}: ")
    rows = json.loads(latest.data) if isinstance(latest.data, str) else latest.data
    assert {row["job"] for row in rows} == {"pair"} and rows[0]["planned start"] != "never"
