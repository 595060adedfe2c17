"""A DockerWorker pool's deployments moved to e31 with `e31 pool migrate`, and run there unchanged.

The deployment is what `prefect deploy` makes for prefect-docker: its code baked into an image, a pull step
into the image's project folder, and job variables an image, env and labels, no e31 field. After the move a
stock `prefect worker start --type e31` runs it as a container job on the real engine.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from datetime import datetime, timezone

import pytest
from prefect import get_client

from tests.integration.conftest import cli
from tests.integration.test_jobs_end_to_end import read_run

pytestmark = pytest.mark.integration

PROBE = """
import json, os
from pathlib import Path
from prefect import flow

@flow
def probe():
    seen = {"in_container": Path("/.dockerenv").exists(), "cwd": os.getcwd(), "seed": os.environ.get("SEED"),
            "devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    print(json.dumps(seen))
    if os.environ.get("E31_OUTPUT_DIR"):  # an e31 run: what the flow writes there comes back
        (Path(os.environ["E31_OUTPUT_DIR"]) / "seen.json").write_text(json.dumps(seen))
"""
PROJECT = "/opt/prefect/project"  # where `prefect deploy`'s docker build puts a project's code


@pytest.fixture(scope="session")
def deployment_image(job_image: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The project's image, as prefect-docker's build step makes it: the flow's code on a Prefect image."""
    folder = tmp_path_factory.mktemp("image")
    (folder / "probe.py").write_text(PROBE)
    (folder / "Dockerfile").write_text(f"FROM {job_image}\nCOPY probe.py {PROJECT}/probe.py\nWORKDIR {PROJECT}\n")
    tag = "e31-migrate-probe:" + hashlib.sha256((job_image + PROBE).encode()).hexdigest()[:12]
    subprocess.run(["docker", "build", "--network", "none", "-q", "-t", tag, str(folder)], check=True,
                   capture_output=True)
    return tag


def deploy_on_docker_pool(pool: str, name: str, variables: dict) -> str:
    """A prefect-docker deployment of the probe on the DockerWorker pool ``pool``; its id."""
    with get_client(sync_client=True) as client:
        return str(client.create_deployment(
            flow_id=client.create_flow_from_name("probe"), name=name, work_pool_name=pool,
            entrypoint="probe.py:probe",
            pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": PROJECT}}],
            job_variables=variables))


def test_a_prefect_docker_deployment_moved_by_e31_pool_migrate_completes_as_a_container_job(
        prefect_server, deployment_image, tmp_path, pool):
    docker_pool = f"{pool}-docker"
    created = cli("prefect", "work-pool", "create", docker_pool, "--type", "docker")
    assert created.returncode == 0, created.stdout + created.stderr
    variables = {"image": deployment_image, "env": {"SEED": "7"}, "labels": {"team": "vision"}}
    moving = deploy_on_docker_pool(docker_pool, "nightly", variables)
    # One that an e31 pool would refuse stays where it is, its reason named; the other still moves.
    staying = deploy_on_docker_pool(docker_pool, "legacy", {**variables, "mem_limit": "1g", "privileged": True})

    migrated = cli("e31", "pool", "migrate", docker_pool, pool, "--gpus", "1", "--max-duration", "5m")
    assert migrated.returncode == 2, migrated.stdout + migrated.stderr  # one stays
    assert "moves: nightly" in migrated.stdout, migrated.stdout
    assert "stays: legacy" in migrated.stdout
    assert "mem_limit = '1g': is not an e31 setting: use request.memory" in migrated.stdout
    assert "privileged = True" in migrated.stdout  # every reason at once
    with get_client(sync_client=True) as client:
        moved = client.read_deployment(moving)
        assert (moved.work_pool_name, moved.job_variables) == (pool, variables)  # its variables unchanged
        assert client.read_deployment(staying).work_pool_name == docker_pool
        run_id = client.create_flow_run_from_deployment(moved.id).id

    home = tmp_path / "e31"
    since = datetime.now(timezone.utc).timestamp()
    worker = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once", gpus="1xH100",
                 env={"E31_HOME": str(home), "PREFECT_WORKER_QUERY_SECONDS": "1"})
    assert worker.returncode == 0, worker.stdout[-3000:] + worker.stderr[-3000:]
    run = read_run(run_id)
    assert run.state.is_completed(), run.state
    seen = json.loads((home / "outputs" / str(run_id) / "seen.json").read_text())
    assert seen == {"in_container": True, "cwd": PROJECT, "seed": "7", "devices": "0"}
    assert "e31:gpus=1" in run.tags  # the pool's default request: 1 GPU, metered
    # The container carried the team's label (and prefect-docker's run label, which e31 finds it by).
    created = subprocess.run(
        ["docker", "events", "--since", str(since), "--until", str(datetime.now(timezone.utc).timestamp()),
         "--filter", "type=container", "--filter", "event=create",
         "--filter", f"label=io.prefect.flow-run-id={run_id}", "--format", "{{json .Actor.Attributes}}"],
        capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(created) == 1, created
    assert json.loads(created[0])["team"] == "vision"
    assert json.loads(created[0])["image"] == deployment_image


def test_migrate_dry_run_changes_nothing_and_a_pool_of_another_type_is_refused(prefect_server, pool):
    docker_pool = f"{pool}-docker"
    assert cli("prefect", "work-pool", "create", docker_pool, "--type", "docker").returncode == 0
    deployment = deploy_on_docker_pool(docker_pool, "nightly", {"image": "acme/trainer:1"})
    planned = cli("e31", "pool", "migrate", docker_pool, pool, "--gpus", "0", "--max-duration", "1h", "--dry-run")
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert "a run that gives no request rents: gpus 0, max_duration 1h" in planned.stdout
    assert "moves: nightly" in planned.stdout
    with get_client(sync_client=True) as client:
        assert client.read_deployment(deployment).work_pool_name == docker_pool
        assert pool not in {p.name for p in client.read_work_pools()}
    assert cli("prefect", "work-pool", "create", f"{pool}-e31", "--type", "e31").returncode == 0
    refused = cli("e31", "pool", "migrate", f"{pool}-e31", pool, "--gpus", "0", "--max-duration", "1h")
    assert refused.returncode == 2
    assert "is a 'e31' pool; e31 pool migrate moves the deployments of a DockerWorker pool" in refused.stderr
