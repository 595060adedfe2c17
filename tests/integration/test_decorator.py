"""@e31(...) flows: calling one runs it as an E31 job through an e31 worker and returns its value."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from prefect import get_client
from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName

from tests.integration.conftest import cli
from tests.integration.test_jobs_end_to_end import read_run

pytestmark = pytest.mark.integration

SCRIPT = """
import json, os
from prefect import flow
from e31_prefect import e31, data_dir, output_dir

@e31(work_pool=os.environ.get("POOL", "gpu"), gpus=1, max_duration="5m", deadline="+1h", team="vision",
     data=["./in.txt"], output="file://./out/{flow_run.id}/", expect=["echo.txt"])
@flow
def echo(times: int = 2) -> dict:
    text = (data_dir() / "in.txt").read_text().strip()
    (output_dir() / "echo.txt").write_text(text * times)
    return {"text": text * times, "devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "secrets": sorted(k for k in os.environ if k.startswith(("AWS_", "E31_GPUS")))}

if __name__ == "__main__":
    print("RESULT", json.dumps(echo(times=3)))
"""


def test_calling_an_e31_flow_runs_it_as_a_metered_job_and_returns_its_value(prefect_server, tmp_path: Path, pool):
    (tmp_path / "in.txt").write_text("hello\n")
    (tmp_path / "job.py").write_text(textwrap.dedent(SCRIPT))
    ran = cli("python", str(tmp_path / "job.py"), gpus="1xH100",
              env={"POOL": pool, "AWS_SECRET_ACCESS_KEY": "not-for-jobs"}, cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    [line] = [line for line in ran.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    # The value came back, the job saw its one rented GPU and none of the worker's secrets.
    assert result == {"text": "hellohellohello", "devices": "0", "secrets": []}

    [out] = (tmp_path / "out").iterdir()
    assert (out / "echo.txt").read_text() == "hellohellohello"
    run = read_run(out.name)
    assert run.state.is_completed() and run.deployment_id is None
    assert {"e31", "e31:gpus=1", "e31:team=vision"} <= set(run.tags)
    assert any(tag.startswith("e31:billed-s=") for tag in run.tags)
    assert run.job_variables["work"]["flow"] == f"{tmp_path / 'job.py'}:echo"


def test_an_e31_flow_that_fails_raises_in_the_caller_with_the_jobs_reason(prefect_server, tmp_path: Path, pool):
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import os
        from prefect import flow
        from e31_prefect import e31

        @e31(work_pool=os.environ.get("POOL", "gpu"), gpus=0, max_duration="5m", output="file://./out/",
             expect=["never.txt"])
        @flow
        def forgetful() -> int:
            return 1

        if __name__ == "__main__":
            forgetful()
        """))
    ran = cli("python", str(tmp_path / "job.py"), env={"POOL": pool}, cwd=tmp_path)
    assert ran.returncode != 0
    assert "Expected output missing: never.txt" in ran.stderr


def test_an_e31_flow_called_where_its_gpus_are_not_waits_for_a_pool_worker(prefect_server, tmp_path: Path, pool):
    (tmp_path / "in.txt").write_text("hi\n")
    (tmp_path / "job.py").write_text(textwrap.dedent(SCRIPT))
    # This host declares no GPU: the call's own worker cannot rent, so the run goes to the pool,
    # where a worker with a GPU (started after the call) takes it; the caller gets the value.
    caller = subprocess.Popen([sys.executable, str(tmp_path / "job.py")], cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "POOL": pool, "E31_GPUS": ""})
    try:
        deadline = time.monotonic() + 120
        while not waiting_runs(pool) and time.monotonic() < deadline:
            assert caller.poll() is None, caller.communicate()
            time.sleep(1)
        worker = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once", gpus="1xH100")
        assert worker.returncode == 0, worker.stdout + worker.stderr
        out, err = caller.communicate(timeout=120)
    finally:
        caller.kill()
    assert caller.returncode == 0, out + err
    assert "waits in work pool" in err
    [line] = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert json.loads(line.removeprefix("RESULT "))["text"] == "hihihi"


def waiting_runs(pool: str) -> list:
    with get_client(sync_client=True) as client:
        return [run for run in client.read_flow_runs(work_pool_filter=WorkPoolFilter(
            name=WorkPoolFilterName(any_=[pool]))) if run.state and run.state.is_scheduled()]


def test_an_e31_flow_with_an_image_runs_in_a_container_and_returns_its_value(prefect_server, job_image,
                                                                             tmp_path: Path, pool):
    (tmp_path / "in.txt").write_text("hey\n")
    script = textwrap.dedent(SCRIPT).replace('team="vision",', f'team="vision", image="{job_image}",')
    script = script.replace('"secrets":', '"in_container": os.path.exists("/.dockerenv"), "secrets":')
    (tmp_path / "job.py").write_text(script)
    ran = cli("python", str(tmp_path / "job.py"), gpus="1xH100", env={"POOL": pool}, cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    [line] = [line for line in ran.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert result == {"text": "heyheyhey", "devices": "0", "in_container": True, "secrets": []}
    [out] = (tmp_path / "out").iterdir()
    assert (out / "echo.txt").read_text() == "heyheyhey"
