"""Jobs with an image run in containers on a real Docker engine, through the real CLIs.

Required in CI (E31_REQUIRE_DOCKER=1); skipped with the reason where no engine answers.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import cli, containers_labelled, flow_run_id
from tests.integration.test_jobs_end_to_end import cancel_while_running, read_run, write_job

pytestmark = pytest.mark.integration

PROBE = """
import json, os
from pathlib import Path
from prefect import flow
from e31_prefect import data_dir, output_dir

@flow
def probe():
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    try:
        (data_dir() / "intruder.txt").write_text("x")
        data_write = "allowed"
    except OSError as exc:
        data_write = exc.strerror
    seen = {
        "in_container": Path("/.dockerenv").exists(),
        "cwd": os.getcwd(),
        "data_dir": str(data_dir()), "output_dir": str(output_dir()),
        "data": sorted(p.name for p in data_dir().iterdir()),
        "output_before": sorted(p.name for p in output_dir().iterdir()),
        "data_write": data_write,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("CUDA", "NVIDIA", "AWS", "E31"))},
        "cap_eff": status["CapEff"].strip(), "no_new_privs": status["NoNewPrivs"].strip(),
    }
    (output_dir() / "seen.json").write_text(json.dumps(seen))
"""


def image_job(folder, name, image, *, request="{gpus: 0, max_duration: 5m}", flow=PROBE, data="[]"):
    return write_job(folder, f"""
        name: {name}
        work: {{flow: flow.py:probe, image: {image}}}
        data: {data}
        request: {request}
        output: {{to: ./out/}}
        """, flow=flow)


def test_image_job_runs_isolated_in_a_container_and_its_outputs_arrive(prefect_server, job_image, tmp_path, pool):
    (tmp_path / "iso").mkdir()
    (tmp_path / "iso" / "frames.bin").write_bytes(b"\0" * 4096)
    job = image_job(tmp_path / "iso", "isolated", job_image, data="[{from: frames.bin}]",
                    request="{gpus: 2, gpu_type: H100, max_duration: 5m, memory: 1g, cpus: 1}")
    result = cli("e31", "run", str(job), "--pool", pool, gpus="0:A100,1:H100,2:H100",
                 env={"AWS_SECRET_ACCESS_KEY": "never-in-a-container", "AWS_ACCESS_KEY_ID": "AKIA-TEST"})
    assert result.returncode == 0, result.stdout + result.stderr
    seen = json.loads((tmp_path / "iso" / "out" / "seen.json").read_text())
    assert seen["in_container"] is True
    assert seen["cwd"] == str(tmp_path / "iso")
    assert (seen["data_dir"], seen["output_dir"]) == ("/e31/data", "/e31/output")
    assert seen["data"] == ["frames.bin"] and seen["output_before"] == []
    assert seen["data_write"] == "Read-only file system"
    # Its devices and its dirs; no AWS_*, and none of what e31's entry takes for itself.
    assert seen["env"] == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1,2",
                           "NVIDIA_VISIBLE_DEVICES": "1,2", "E31_DATA_DIR": "/e31/data",
                           "E31_OUTPUT_DIR": "/e31/output"}
    assert seen["cap_eff"] == "0000000000000000" and seen["no_new_privs"] == "1"
    assert containers_labelled("isolated") == []
    assert "e31:gpus=2" in read_run(flow_run_id(result.stdout)).tags


def test_two_concurrent_containers_see_only_their_own_data_and_outputs(prefect_server, job_image, tmp_path, pool):
    ids = {}
    for name in ("left", "right"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.txt").write_text(name)
        job = image_job(tmp_path / name, f"conc-{name}", job_image, data=f"[{{from: {name}.txt}}]",
                        request="{gpus: 1, max_duration: 5m}")
        submitted = cli("e31", "submit", str(job), "--pool", pool)
        assert submitted.returncode == 0, submitted.stderr
        ids[name] = flow_run_id(submitted.stdout)
    worker = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once", gpus="2xH100")
    assert worker.returncode == 0, worker.stdout + worker.stderr
    for name in ("left", "right"):
        assert read_run(ids[name]).state.is_completed()
        seen = json.loads((tmp_path / name / "out" / "seen.json").read_text())
        # Each saw its own input only, and an output dir of its own (empty when it started).
        assert seen["data"] == [f"{name}.txt"] and seen["output_before"] == []
        assert seen["env"]["CUDA_VISIBLE_DEVICES"] in ("0", "1")
    devices = {json.loads((tmp_path / n / "out" / "seen.json").read_text())["env"]["CUDA_VISIBLE_DEVICES"]
               for n in ("left", "right")}
    assert devices == {"0", "1"}


SLEEPER = """
import time
from prefect import flow
from e31_prefect import output_dir

@flow
def probe():
    (output_dir() / "started.txt").write_text("yes")
    time.sleep(600)
"""


def test_time_limit_stops_the_container_and_frees_its_devices(prefect_server, job_image, tmp_path, pool):
    # Long enough for Prefect's engine to start in the container on a busy host, short for a test.
    job = image_job(tmp_path / "slow", "slow-container", job_image, flow=SLEEPER,
                    request="{gpus: 1, max_duration: 30s}")
    result = cli("e31", "run", str(job), "--pool", pool, gpus="1xH100", env={"E31_STOP_GRACE_SECONDS": "2"})
    assert result.returncode != 0
    run = read_run(flow_run_id(result.stdout))
    assert run.state.name == "TimedOut"
    assert (tmp_path / "slow" / "out" / "started.txt").read_text() == "yes"
    assert containers_labelled("slow-container") == []
    assert "e31:timed-out" in run.tags
    assert "devices [0] back in the pool" in result.stdout + result.stderr


def test_cancelling_a_running_container_stops_it_and_closes_the_meter(prefect_server, job_image, tmp_path, pool):
    job = image_job(tmp_path / "cancel", "cancel-me", job_image, flow=SLEEPER, request="{gpus: 1, max_duration: 10m}")
    run_id = flow_run_id(cli("e31", "submit", str(job), "--pool", pool).stdout)
    output = cancel_while_running(run_id, pool)
    run = read_run(run_id)
    assert run.state.is_cancelled(), (run.state, output[-3000:])
    assert containers_labelled("cancel-me") == []
    assert "e31:cancelled" in run.tags
    assert any(t.startswith("e31:billed-s=") for t in run.tags)


OOM = """
from prefect import flow

@flow
def probe():
    hog = bytearray(1024 * 1024 * 1024)
    return len(hog)
"""


def test_container_killed_at_its_memory_limit_fails_out_of_memory(prefect_server, job_image, tmp_path, pool):
    job = image_job(tmp_path / "oom", "memory-hog", job_image, flow=OOM,
                    request="{gpus: 0, max_duration: 5m, memory: 300m}")
    result = cli("e31", "run", str(job), "--pool", pool)
    assert result.returncode != 0
    run = read_run(flow_run_id(result.stdout))
    assert run.state.is_failed() and run.state.name == "OutOfMemory", run.state
    assert "300m" in run.state.message
    assert containers_labelled("memory-hog") == []


DIES = """
import os
from prefect import flow
from e31_prefect import output_dir

@flow
def probe():
    (output_dir() / "last-words.txt").write_text("written before dying")
    os._exit(3)  # the process dies without the flow reporting a state
"""


def test_container_that_dies_fails_with_its_exit_code_and_keeps_its_outputs(prefect_server, job_image, tmp_path, pool):
    job = image_job(tmp_path / "dies", "dies-young", job_image, flow=DIES, request="{gpus: 1, max_duration: 5m}")
    result = cli("e31", "run", str(job), "--pool", pool, gpus="1xH100")
    assert result.returncode != 0
    run = read_run(flow_run_id(result.stdout))
    assert run.state.is_failed() and run.state.name == "ContainerDied", run.state
    assert "exit code 3" in run.state.message
    assert (tmp_path / "dies" / "out" / "last-words.txt").read_text() == "written before dying"
    assert containers_labelled("dies-young") == []
    assert "devices [0] back in the pool" in result.stdout + result.stderr


def test_image_job_without_an_engine_fails_before_renting(prefect_server, tmp_path, pool):
    job = image_job(tmp_path / "noengine", "no-engine", "e31-prefect-job:any", request="{gpus: 1, max_duration: 5m}")
    result = cli("e31", "run", str(job), "--pool", pool, gpus="1xH100",
                 env={"DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock"})
    assert result.returncode == 1
    run = read_run(flow_run_id(result.stdout))
    assert run.state.name == "NoContainerEngine" and "e31-prefect-job:any" in run.state.message
    assert "e31:billed-s=0" in run.tags



def test_a_flow_beside_the_jobs_folder_runs_the_same_in_a_container_and_as_a_process(
        prefect_server, job_image, tmp_path, pool):
    """A repository with jobs/ and flows/: the container sees the project folder holding both, read-only."""
    repo = tmp_path / "repo"
    (repo / "flows").mkdir(parents=True)
    (repo / "flows" / "probe.py").write_text(PROBE)
    outputs = {}
    for runtime, image in (("container", f", image: {job_image}"), ("process", "")):
        job = write_job(repo / "jobs", f"""
            name: beside-{runtime}
            work: {{flow: ../flows/probe.py:probe{image}}}
            request: {{gpus: 0, max_duration: 5m}}
            output: {{to: ./out-{runtime}/}}
            """, name=f"{runtime}.yaml")
        result = cli("e31", "run", str(job), "--pool", pool)
        assert result.returncode == 0, result.stdout + result.stderr
        outputs[runtime] = json.loads((repo / "jobs" / f"out-{runtime}" / "seen.json").read_text())
    # (this host may itself be a container, so where the data is mounted tells the runtimes apart)
    assert outputs["container"]["data_dir"] == "/e31/data" and outputs["process"]["data_dir"] != "/e31/data"
    assert outputs["container"]["cwd"] == str(repo / "jobs")
