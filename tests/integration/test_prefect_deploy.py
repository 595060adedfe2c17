"""The stock Prefect path: `prefect deploy --all` from deployments/, then `prefect worker start --type e31`.

A Prefect user never touches `e31` here: the four example jobs are deployments
whose job variables are the job file's fields, the nightly ones run at 22:00
Paris time with a deadline of 07:00, and a deployment with a bad job variable
gets the same clear message as `e31 validate` before any GPU is rented.
"""

from __future__ import annotations

import json
import shutil
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
import yaml
from prefect import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

from e31_prefect.model import timing
from tests.integration.conftest import REPO, cli
from tests.integration.test_jobs_end_to_end import read_run

pytestmark = pytest.mark.integration

PARIS = ZoneInfo("Europe/Paris")
NIGHTLY = {"retrain-tonight", "footage-pass"}


@pytest.fixture
def project(tmp_path: Path, pool: str) -> Path:
    """A copy of deployments/ whose prefect.yaml targets this test's own pool."""
    target = tmp_path / "deployments"
    shutil.copytree(REPO / "deployments", target, ignore=shutil.ignore_patterns("outputs", "__pycache__"))
    manifest = target / "prefect.yaml"
    manifest.write_text(manifest.read_text().replace("name: gpu\n", f"name: {pool}\n"))
    return target


def deploy(project: Path, *args: str):
    return cli("prefect", "--no-prompt", "deploy", *args, cwd=project)


def deployments_of(pool: str) -> dict:
    with get_client(sync_client=True) as client:
        return {d.name: d for d in client.read_deployments() if d.work_pool_name == pool}


def cancel_scheduled(pool: str) -> None:
    """Cancel the pool's scheduled runs (so only the ones a test starts are taken)."""
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName
    from prefect.states import Cancelled

    with get_client(sync_client=True) as client:
        for run in client.read_flow_runs(work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool]))):
            if run.state and run.state.is_scheduled():
                client.set_flow_run_state(run.id, Cancelled(), force=True)


def scheduled_runs(deployment_id, timeout: float = 90) -> list:
    """The runs Prefect's scheduler service made for a deployment (it makes them within seconds).

    Only those: other tests run the same example jobs (same flow and deployment names) at other times.
    """
    wanted = DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            runs = [run for run in client.read_flow_runs(deployment_filter=wanted) if run.auto_scheduled]
            if runs or time.monotonic() > deadline:
                return runs
            time.sleep(1)


def test_prefect_deploy_all_then_a_stock_e31_worker_runs_the_jobs(prefect_server, project, pool, tmp_path):
    created = cli("prefect", "work-pool", "create", pool, "--type", "e31")
    assert created.returncode == 0, created.stdout + created.stderr
    # The team used `e31 submit` from another folder first: prefect deploy takes over that deployment.
    earlier = tmp_path / "earlier"
    shutil.copytree(project / "jobs", earlier)
    submitted = cli("e31", "submit", str(earlier / "retrain.yaml"), "--pool", pool)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    cancel_scheduled(pool)
    deployed = deploy(project, "--all")
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr

    found = deployments_of(pool)
    assert set(found) == {"retrain-tonight", "footage-pass", "batch-inference", "ten-thousand-simulations"}
    retrain = found["retrain-tonight"]
    assert retrain.job_variables["request"] == {"gpus": 1, "max_duration": "20m", "deadline": "07:00"}
    assert retrain.job_variables["team"] == "vision"
    for name in NIGHTLY:
        [schedule] = found[name].schedules
        assert (schedule.schedule.cron, schedule.schedule.timezone) == ("0 22 * * *", "Europe/Paris")
        # Prefect schedules the coming nights at 22:00 Paris; each must be done by 07:00 the next morning.
        runs = scheduled_runs(found[name].id)
        assert runs, f"no scheduled runs for {name}"
        for run in runs:
            start = run.expected_start_time.astimezone(PARIS)
            assert (start.hour, start.minute) == (22, 0)
            deadline = timing.resolve_deadline("07:00", timing.utc(run.expected_start_time), PARIS)
            assert deadline.astimezone(PARIS).replace(tzinfo=None) == \
                (start.replace(tzinfo=None) + timedelta(days=1)).replace(hour=7)
    assert found["batch-inference"].schedules == []

    # Run two of them now, as a user would from the UI or CLI; a stock e31 worker takes both. The nightly
    # retraining is due by 07:00 (Paris): run by day it is given a deadline it can meet whatever the hour
    # (between 06:40 and 07:00 its own would be missed, rightly), as a run's job variables allow.
    run_ids = {}
    by_day = {"retrain-tonight": ["--job-variable", 'request={"gpus": 1, "max_duration": "20m", "deadline": "+9h"}']}
    for flow_name, name in [("retrain", "retrain-tonight"), ("e31-command", "ten-thousand-simulations")]:
        started = cli("prefect", "deployment", "run", f"{flow_name}/{name}", *by_day.get(name, []))
        assert started.returncode == 0, started.stdout + started.stderr
        run_ids[name] = next(line.split()[-1] for line in started.stdout.splitlines() if "UUID" in line)
    # Five GPUs: one for the retraining, four for the simulations' shards.
    worker = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once", gpus="5xH100")
    assert worker.returncode == 0, worker.stdout + worker.stderr

    states = {name: read_run(run_id).state for name, run_id in run_ids.items()}
    assert {name: state.name for name, state in states.items()} == dict.fromkeys(run_ids, "Completed"), states
    for run_id in run_ids.values():
        run = read_run(run_id)
        assert "e31" in run.tags and any(tag.startswith("e31:billed-s=") for tag in run.tags)
    retrain_run = read_run(run_ids["retrain-tonight"])
    assert "e31:gpus=1" in retrain_run.tags and "e31:team=vision" in retrain_run.tags
    # Relative paths in the deployment are read from the deployments folder: data in, outputs back there.
    model = json.loads((project / "outputs" / "retrain-tonight" / retrain_run.name / "model.json").read_text())
    assert set(model) >= {"w1", "w2", "b"}
    sims = project / "outputs" / "ten-thousand-simulations" / read_run(run_ids["ten-thousand-simulations"]).name
    assert json.loads((sims / "summary.json").read_text())["simulations"] == 10000


def test_a_deployment_with_a_bad_job_variable_fails_with_the_job_file_message(prefect_server, project, pool):
    created = cli("prefect", "work-pool", "create", pool, "--type", "e31")
    assert created.returncode == 0, created.stdout + created.stderr
    manifest = yaml.safe_load((project / "prefect.yaml").read_text())
    [inference] = [d for d in manifest["deployments"] if d["name"] == "batch-inference"]
    inference["work_pool"]["job_variables"]["request"]["max_duration"] = "10 minutes"
    (project / "prefect.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    deployed = deploy(project, "--name", "batch-inference")
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr

    started = cli("prefect", "deployment", "run", "batch-inference/batch-inference")
    assert started.returncode == 0, started.stdout + started.stderr
    run_id = next(line.split()[-1] for line in started.stdout.splitlines() if "UUID" in line)
    worker_started = datetime.now(timezone.utc)
    worker = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once", gpus="1xH100")
    assert worker.returncode == 0, worker.stdout + worker.stderr
    worker_ended = datetime.now(timezone.utc)

    run = read_run(run_id)
    assert run.state.is_failed() and run.state.name == "InvalidJob", run.state
    assert "request.max_duration" in run.state.message and "'10 minutes'" in run.state.message
    # The same words `e31 validate` prints for a job file with the same mistake.
    job_file = project / "jobs" / "inference.yaml"
    job_file.write_text(job_file.read_text().replace("max_duration: 10m", "max_duration: 10 minutes"))
    validated = cli("e31", "validate", str(job_file))
    assert validated.returncode == 2
    [problem] = [line.strip() for line in validated.stderr.splitlines() if "max_duration" in line]
    assert problem in run.state.message
    assert "e31:billed-s=0" in run.tags and "e31:gpus=0" in run.tags  # nothing was rented
    assert worker_started <= timing.utc(run.end_time) <= worker_ended  # ended by that worker, however long it took
