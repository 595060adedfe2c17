"""Sharded jobs end to end (a command and a flow): `e31 run` of a job array on declared GPUs, a real Prefect server,
the process runtime.

What a user checks: each shard saw only its devices and its index, a flaky shard ran again,
failures within the allowance still complete the job, the reduce step combined the shards,
the progress artifact reached 100%, and a job failing past its allowance names its shards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from uuid import uuid4

import pytest
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from tests.integration.conftest import cli, flow_run_id, host_processes_with

pytestmark = pytest.mark.integration

SHARD = """\
import json, os, sys
from pathlib import Path

index = int(os.environ["E31_SHARD_INDEX"])
out = Path(os.environ["E31_OUTPUT_DIR"])
tries = out / "tries"
tries.write_text(str(int(tries.read_text()) + 1 if tries.exists() else 1))
names = ("E31_SHARD_COUNT", "SLURM_ARRAY_TASK_ID", "AWS_BATCH_JOB_ARRAY_INDEX", "JOB_COMPLETION_INDEX",
         "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
(out / "seen.json").write_text(json.dumps({name: os.environ.get(name) for name in names}))
if index in (3, 5) and tries.read_text() == "1":
    sys.exit("flaky: first try of shard %d fails" % index)
if index == 7:
    print("loading shard 7")
    sys.exit("bad parameters for shard 7")
"""

REDUCE = """\
import json, os
from pathlib import Path

out = Path(os.environ["E31_OUTPUT_DIR"])
done = sorted(int(p.parent.name.split("-")[1]) for p in out.glob("shard-*/seen.json"))
(out / "reduced.json").write_text(json.dumps({"shards": done, "count": os.environ["E31_SHARD_COUNT"],
                                             "failed": os.environ["E31_FAILED_SHARDS"]}))
"""


SLEEP = """\
import os, time
from pathlib import Path
(Path(os.environ["E31_OUTPUT_DIR"]) / "pid").write_text(str(os.getpid()))
time.sleep(600)
"""


def shard_pids(run_id) -> list[int]:
    """The pids the running shards of a run wrote into their folders of its workspace."""
    output = Path(os.environ["E31_HOME"]) / "workspaces" / str(run_id) / "output"
    return [int(text) for path in output.glob("shard-*/pid") if (text := path.read_text().strip())]


def write_job(folder: Path, allow: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "shard.py").write_text(SHARD)
    (folder / "reduce.py").write_text(REDUCE)
    job = folder / "job.yaml"
    job.write_text(textwrap.dedent(f"""\
        name: array-{allow.replace('.', '-')}
        work:
          command: [python, shard.py]
          shards: 12
          gpus_per_shard: 2
          shards_per_gpu: 2
          shard_retries: 1
          allow_failed_shards: {allow}
          reduce: [python, reduce.py]
        request: {{gpus: 4, max_duration: 5m}}
        output: {{to: ./out/}}
        """))
    return job


def artifacts_of(run_id) -> dict[str, object]:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
    return {a.key: a for a in found if a.key}


def test_shards_run_over_the_rented_gpus_with_retries_an_allowance_and_a_reduce(prefect_server, tmp_path, pool):
    job = write_job(tmp_path / "array", "1")
    result = cli("e31", "run", str(job), "--pool", pool, gpus="4xH100")
    assert result.returncode == 0, result.stdout + result.stderr
    assert ": Completed" in result.stdout
    out = tmp_path / "array" / "out"

    pairs = set()
    for shard in range(12):
        seen = json.loads((out / f"shard-{shard}" / "seen.json").read_text())
        assert seen["E31_SHARD_COUNT"] == "12"
        assert {seen[n] for n in ("SLURM_ARRAY_TASK_ID", "AWS_BATCH_JOB_ARRAY_INDEX", "JOB_COMPLETION_INDEX")} \
            == {str(shard)}
        assert seen["NVIDIA_VISIBLE_DEVICES"] == seen["CUDA_VISIBLE_DEVICES"]
        pairs.add(seen["CUDA_VISIBLE_DEVICES"])
    assert pairs <= {"0,1", "2,3"}  # two GPUs each, never another shard's half

    tries = {shard: int((out / f"shard-{shard}" / "tries").read_text()) for shard in range(12)}
    assert tries == {**dict.fromkeys(range(12), 1), 3: 2, 5: 2, 7: 2}
    assert "bad parameters for shard 7" in (out / "shard-7" / "shard.log").read_text()

    assert json.loads((out / "reduced.json").read_text()) == {"shards": list(range(12)), "count": "12",
                                                                 "failed": "7"}

    artifacts = artifacts_of(flow_run_id(result.stdout))
    progress = artifacts["e31-shards"]
    assert progress.type == "progress" and float(progress.data) == 100.0
    assert progress.description.startswith("11/12 shards done, 1 failed, 0 running")
    [row] = json.loads(artifacts["e31-shard-failures"].data)
    assert row["shard"] == 7 and row["attempts"] == 2 and "bad parameters for shard 7" in row["last_lines"]


def test_shards_failing_past_the_allowance_fail_the_job_naming_them_and_skip_the_reduce(prefect_server, tmp_path,
                                                                                         pool):
    job = write_job(tmp_path / "strict", "0")
    result = cli("e31", "run", str(job), "--pool", pool, gpus="4xH100")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 of 12 shards failed (allowed: 0)" in result.stdout
    assert "shard 7: exit 1 after 2 attempt(s): bad parameters for shard 7" in result.stdout
    assert not (tmp_path / "strict" / "out" / "reduced.json").exists()
    artifacts = artifacts_of(flow_run_id(result.stdout))
    assert [row["shard"] for row in json.loads(artifacts["e31-shard-failures"].data)] == [7]


def test_the_time_limit_stops_every_running_shard(prefect_server, tmp_path, pool):
    folder = tmp_path / "sleepy"
    folder.mkdir()
    (folder / "sleep.py").write_text(SLEEP)
    marker = f"e31-test-shard-{uuid4()}"  # the shards' pids are their namespace's: the host finds them by this
    (folder / "job.yaml").write_text(textwrap.dedent(f"""\
        name: sleepy-array
        work: {{command: [python, sleep.py, {marker}], shards: 8}}
        request: {{gpus: 4, max_duration: 15s}}
        output: {{to: ./out/}}
        """))
    result = cli("e31", "run", str(folder / "job.yaml"), "--pool", pool, gpus="4xH100",
                 env={"E31_STOP_GRACE_SECONDS": "2"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert ": TimedOut" in result.stdout
    pids = [int(path.read_text()) for path in (folder / "out").glob("shard-*/pid")]
    assert 1 <= len(pids) <= 4  # four GPUs, one shard each at a time; the rest never started
    assert host_processes_with(marker) == [], "a shard outlived the run's time limit"


def test_cancelling_a_sharded_run_stops_every_running_shard(prefect_server, tmp_path, pool):
    folder = tmp_path / "cancel"
    folder.mkdir()
    (folder / "sleep.py").write_text(SLEEP)
    marker = f"e31-test-shard-{uuid4()}"
    (folder / "job.yaml").write_text(textwrap.dedent(f"""\
        name: cancelled-array
        work: {{command: [python, sleep.py, {marker}], shards: 6, shards_per_gpu: 2}}
        request: {{gpus: 1, max_duration: 10m}}
        output: {{to: ./out/}}
        """))
    submitted = cli("e31", "submit", str(folder / "job.yaml"), "--pool", pool)
    run_id = flow_run_id(submitted.stdout)
    worker = subprocess.Popen(
        [str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", pool, "--type", "e31",
         "--run-once"], env={**os.environ, "E31_GPUS": "1xH100", "E31_WATCH_SECONDS": "0.5"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # Cancel once both slots of the one GPU run a shard (each writes its pid as it starts).
        deadline = time.monotonic() + 180
        while len(pids := shard_pids(run_id)) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(pids) == 2, pids
        cancelled = cli("prefect", "flow-run", "cancel", str(run_id))
        assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
        output = worker.communicate(timeout=120)[0]
    finally:
        worker.kill()
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
    assert run.state.is_cancelled(), (run.state, output[-3000:])
    assert host_processes_with(marker) == [], "a shard outlived its run's cancel"


STAMP = """\
import json, os, sys
from pathlib import Path
(Path(os.environ["E31_OUTPUT_DIR"]) / "started.json").write_text(
    json.dumps({"cwd": os.getcwd(), "argv": sys.argv[1:]}))
"""


def test_shards_run_the_runs_own_command_in_the_jobs_folder(prefect_server, tmp_path, pool):
    folder = tmp_path / "stamps"
    folder.mkdir()
    (folder / "stamp.py").write_text(STAMP)
    (folder / "job.yaml").write_text(textwrap.dedent("""\
        name: stamped-array
        work: {command: [python, stamp.py, as-deployed], shards: 4}
        request: {gpus: 2, max_duration: 5m}
        output: {to: ./out/}
        """))
    submitted = cli("e31", "submit", str(folder / "job.yaml"), "--pool", pool)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    with get_client(sync_client=True) as client:
        deployed = client.read_flow_run(flow_run_id(submitted.stdout))
        client.delete_flow_run(deployed.id)
        # A run of the deployment given another command (a custom run in the UI): its shards run that one.
        run = client.create_flow_run_from_deployment(
            deployed.deployment_id, parameters={"command": ["python", "stamp.py", "as-asked"]})
    worker = subprocess.run(
        [str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", pool, "--type", "e31",
         "--run-once"], env={**os.environ, "E31_GPUS": "2xH100"}, capture_output=True, text=True, timeout=240)
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run.id)
    assert run.state.is_completed(), (run.state, worker.stdout[-3000:], worker.stderr[-3000:])
    stamps = [json.loads((folder / "out" / f"shard-{i}" / "started.json").read_text()) for i in range(4)]
    assert {tuple(stamp["argv"]) for stamp in stamps} == {("as-asked",)}
    assert {stamp["cwd"] for stamp in stamps} == {str(folder)}
    # That they start before the engine loads the flow is tests/unit/test_entry_order.py's: a shard's own stamp
    # comes an interpreter's start after its fork, and an engine that loads the flow from its entrypoint may
    # mark the run Running first.


# -- a sharded work.flow: the same shards, each a call of the flow with its shard as parameters ------

FLOW = """\
import json, os
from pathlib import Path
from prefect import flow, get_run_logger
from e31_prefect import output_dir

@flow(name="probe")
def probe(label: str, shard_index: int, shard_count: int) -> None:
    out = output_dir()
    tries = out / "tries"
    tries.write_text(str(int(tries.read_text()) + 1 if tries.exists() else 1))
    names = ("E31_SHARD_INDEX", "E31_SHARD_COUNT", "SLURM_ARRAY_TASK_ID", "CUDA_VISIBLE_DEVICES",
             "NVIDIA_VISIBLE_DEVICES")
    seen = {"label": label, "shard_index": shard_index, "shard_count": shard_count,
            **{name: os.environ.get(name) for name in names}}
    (out / "seen.json").write_text(json.dumps(seen))
    get_run_logger().info("shard %d of %d for %s", shard_index, shard_count, label)
    if shard_index == 2 and tries.read_text() == "1":
        raise RuntimeError("flaky: first try of shard 2")
    if shard_index == 4:
        print("x" * 100000)
        raise RuntimeError("shard 4 diverged")
"""


def write_flow_job(folder: Path, flow: str = FLOW) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "probe.py").write_text(flow)
    (folder / "reduce.py").write_text(REDUCE)
    job = folder / "job.yaml"
    job.write_text(textwrap.dedent("""\
        name: flow-array
        work:
          flow: probe.py:probe
          parameters: {label: nightly}
          shards: 6
          gpus_per_shard: 2
          shard_retries: 1
          allow_failed_shards: 1
          reduce: [python, reduce.py]
        request: {gpus: 4, max_duration: 5m}
        output: {to: ./out/}
        """))
    return job


def flow_runs_in(pool: str) -> list:
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])))


def test_a_sharded_flow_runs_once_per_shard_with_its_shard_as_parameters_in_one_flow_run(prefect_server, tmp_path,
                                                                                        pool):
    job = write_flow_job(tmp_path / "flow-array")
    result = cli("e31", "run", str(job), "--pool", pool, gpus="4xH100")
    assert result.returncode == 0, result.stdout + result.stderr
    assert ": Completed" in result.stdout
    out = tmp_path / "flow-array" / "out"

    for shard in range(6):
        seen = json.loads((out / f"shard-{shard}" / "seen.json").read_text())
        assert seen["label"] == "nightly"  # the job's parameters, and the shard's own
        assert (seen["shard_index"], seen["shard_count"]) == (shard, 6)
        assert (seen["E31_SHARD_INDEX"], seen["SLURM_ARRAY_TASK_ID"], seen["E31_SHARD_COUNT"]) == (str(shard),
                                                                                                   str(shard), "6")
        assert seen["CUDA_VISIBLE_DEVICES"] in ("0,1", "2,3")  # two GPUs each, never another shard's half
        assert seen["NVIDIA_VISIBLE_DEVICES"] == seen["CUDA_VISIBLE_DEVICES"]
        assert f"shard {shard} of 6 for nightly" in (out / f"shard-{shard}" / "shard.log").read_text()
    tries = {shard: int((out / f"shard-{shard}" / "tries").read_text()) for shard in range(6)}
    assert tries == {0: 1, 1: 1, 2: 2, 3: 1, 4: 2, 5: 1}
    assert json.loads((out / "reduced.json").read_text()) == {"shards": list(range(6)), "count": "6",
                                                                 "failed": "4"}

    # One flow run for the whole job: the shards are processes, not runs.
    [run] = flow_runs_in(pool)
    assert run.id == flow_run_id(result.stdout)
    artifacts = artifacts_of(run.id)
    progress = artifacts["e31-shards"]
    assert float(progress.data) == 100.0 and progress.description.startswith("5/6 shards done, 1 failed, 0 running")
    [row] = json.loads(artifacts["e31-shard-failures"].data)
    assert row["shard"] == 4 and row["attempts"] == 2
    assert row["last_lines"].strip().splitlines()[-1] == "RuntimeError: shard 4 diverged"


def test_a_sharded_flow_that_cannot_receive_its_shard_fails_before_any_shard_naming_the_flow(prefect_server,
                                                                                            tmp_path, pool):
    # Valid when submitted; by the time the worker runs it, the flow's file no longer takes its shard.
    job = write_flow_job(tmp_path / "changed")
    submitted = cli("e31", "submit", str(job), "--pool", pool)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    (job.parent / "probe.py").write_text(FLOW.replace("shard_index: int, shard_count: int", "index: int = 0"))
    worker = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once", gpus="4xH100")
    assert worker.returncode == 0, worker.stdout + worker.stderr
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id(submitted.stdout))
    assert run.state.is_failed(), run.state
    assert ("The flow probe.py:probe cannot receive its shard: probe takes no shard_index or shard_count "
            "parameter") in run.state.message
    assert not list((job.parent / "out").glob("shard-*"))


def test_the_sweep_example_runs_as_a_sharded_flow(prefect_server, jobs, pool):
    result = cli("e31", "run", str(jobs / "sweep.yaml"), "--pool", pool, gpus="2xH100")
    assert result.returncode == 0, result.stdout + result.stderr
    [out] = (jobs / "outputs" / "rate-sweep").iterdir()
    rates = [json.loads((out / f"shard-{i}" / "metrics.json").read_text())["rate"] for i in range(8)]
    assert rates == [0.005 * 2**i for i in range(8)]
    best = json.loads((out / "best.json").read_text())
    assert best["tried"] == 8 and best["best"]["accuracy"] > 0.5
