"""Jobs whose data and outputs live in S3, over HTTP to moto's S3 server through s3fs."""

from __future__ import annotations

import json
import os

import pytest
import s3fs

from tests.integration.conftest import cli, flow_run_id
from tests.integration.test_jobs_end_to_end import read_run, write_job
from tests.integration.test_keyboard import run_logs

pytestmark = pytest.mark.integration

FLOW = """
import json
from prefect import flow
from e31_prefect import data_dir, output_dir

@flow
def count():
    files = sorted(p.relative_to(data_dir()).as_posix() for p in data_dir().rglob("*") if p.is_file())
    sizes = {name: (data_dir() / name).stat().st_size for name in files}
    (output_dir() / "sub").mkdir()
    (output_dir() / "sub" / "sizes.json").write_text(json.dumps(sizes))
    return len(files)
"""


def bucket(s3_env: dict[str, str], name: str) -> s3fs.S3FileSystem:
    fs = s3fs.S3FileSystem(key=s3_env["AWS_ACCESS_KEY_ID"], secret=s3_env["AWS_SECRET_ACCESS_KEY"],
                           client_kwargs={"endpoint_url": s3_env["AWS_ENDPOINT_URL"]})
    fs.mkdir(name)
    return fs


def test_s3_prefix_is_staged_and_outputs_go_back_to_s3(prefect_server, s3_server, tmp_path, pool):
    fs = bucket(s3_server, "footage")
    fs.pipe({"footage/night/a.bin": b"a" * 1000, "footage/night/deep/b.bin": b"b" * 70000,
             "footage/model.json": b'{"w": 1}'})
    job = write_job(tmp_path / "s3", """
        name: s3-job
        work: {flow: flow.py:count}
        data:
          - {from: "s3://footage/night/", to: night}
          - {from: "s3://footage/model.json", size: 8}
        request: {gpus: 0, max_duration: 5m}
        output: {to: "s3://footage/results/{job}/{flow_run.id}/", expect: [sub/sizes.json]}
        """, flow=FLOW)
    result = cli("e31", "run", str(job), "--pool", pool, env=s3_server)
    assert result.returncode == 0, result.stdout + result.stderr
    run_id = flow_run_id(result.stdout)
    sizes = json.loads(fs.cat(f"footage/results/s3-job/{run_id}/sub/sizes.json"))
    assert sizes == {"model.json": 8, "night/a.bin": 1000, "night/deep/b.bin": 70000}


def test_missing_s3_input_fails_before_renting_and_bills_nothing(prefect_server, s3_server, tmp_path, pool):
    bucket(s3_server, "empty")
    job = write_job(tmp_path / "missing", """
        name: missing-input
        work: {flow: flow.py:count}
        data:
          - {from: "s3://empty/nothing-here.csv"}
        request: {gpus: 1, max_duration: 5m}
        """, flow=FLOW)
    result = cli("e31", "run", str(job), "--pool", pool, gpus="1xH100", env=s3_server)
    assert result.returncode == 1
    run = read_run(flow_run_id(result.stdout))
    assert run.state.name == "StagingFailed"
    assert "s3://empty/nothing-here.csv" in run.state.message and "not found" in run.state.message
    assert "e31:billed-s=0" in run.tags


def test_a_job_run_twice_as_its_own_user_downloads_its_input_once(prefect_server, s3_server, tmp_path, pool):
    # The worker as root with E31_JOB_USERS=auto (as the tests run here): each run's job has a uid of its own, its
    # workspace is handed to that uid and removed after the run. None of it may cost the next run its download.
    assert os.geteuid() == 0 and os.environ.get("E31_JOB_USERS", "auto") == "auto", "needs a root worker"
    fs = bucket(s3_server, "nightly-weights")
    weights = bytes(range(256)) * 4096  # 1 MiB
    fs.pipe({"nightly-weights/model.bin": weights})
    job = write_job(tmp_path / "nightly", """
        name: nightly
        work: {flow: flow.py:count}
        data: [{from: "s3://nightly-weights/model.bin"}]
        request: {gpus: 0, max_duration: 5m}
        """, flow=FLOW)
    env = {**s3_server, "E31_HOME": str(tmp_path / "host")}  # this test's own host cache
    staged = []
    for night in ("first", "second"):
        result = cli("e31", "run", str(job), "--now", "--pool", pool, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        run_id = flow_run_id(result.stdout)
        assert read_run(run_id).state.is_completed(), (night, result.stdout + result.stderr)
        staged.append(run_logs(run_id, "Staged "))
    assert "1 from the host's cache" not in staged[0]
    assert "1 from the host's cache, 0.00 MB downloaded" in staged[1], staged[1]
    assert "evicted" not in staged[1], staged[1]
