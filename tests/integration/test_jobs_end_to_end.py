"""E31 jobs end to end: the real e31 and prefect CLIs, a real Prefect server, the process runtime.

Each test runs what a user runs and checks what a user sees: the final state,
the outputs, the flow run's tags, artifacts and events.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from uuid import UUID, uuid4

import pytest
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter, EventResourceFilter

from tests.integration.conftest import cli, flow_run_id, host_processes_with

pytestmark = pytest.mark.integration


def read_run(run_id: UUID):
    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id)


def artifacts_of(run_id: UUID) -> dict[str, object]:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
    return {a.key.split("-")[1]: a for a in found if a.key and a.key.startswith("e31-")}


def e31_events(run_id: UUID, expect: set[str], timeout: float = 30) -> list[str]:
    """The e31.job.* event names about a flow run, in order, once all of ``expect`` arrived."""
    names: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = job_events(run_id, "e31.job.")
        if expect <= set(names):
            return names
        time.sleep(1)
    raise AssertionError(f"events {sorted(expect - set(names))} never arrived; got {names}")


def job_events(run_id: UUID, prefix: str, related: bool = False) -> list[str]:
    """The names of the events about a flow run, in order (``related``: that name it among their related resources)."""
    about = f"prefect.flow-run.{run_id}"
    where = {"related": EventRelatedFilter(id=[about])} if related else {"resource": EventResourceFilter(id=[about])}
    with get_client(sync_client=True) as client:
        page = client.read_events(filter=EventFilter(event=EventNameFilter(prefix=[prefix]), **where), limit=50)
    return [e.event for e in sorted(page.events, key=lambda e: e.occurred)]


def write_job(folder: Path, text: str, flow: str | None = None, name: str = "job.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if flow is not None:
        (folder / "flow.py").write_text(textwrap.dedent(flow))
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


MARK_FLOW = """
    from prefect import flow
    from e31_prefect import output_dir

    @flow
    def mark():
        (output_dir() / "ran").write_text("yes")
    """


def mark_job(folder: Path, name: str, *, deadline: str | None = None, gpus: int = 1, gpu_type: str | None = None,
             max_duration: str = "10m") -> Path:
    """A job file running :data:`MARK_FLOW` (it leaves ``ran`` in its outputs): the scheduling tests' job,
    different only in its name and its request."""
    request = {"gpus": gpus, "gpu_type": gpu_type, "max_duration": max_duration,
               "deadline": f'"{deadline}"' if deadline else None}
    fields = ", ".join(f"{key}: {value}" for key, value in request.items() if value is not None)
    return write_job(folder, f"""
        name: {name}
        work: {{flow: flow.py:mark}}
        request: {{{fields}}}
        output: {{to: ./out/}}
        """, flow=MARK_FLOW)


def test_example_job_runs_end_to_end_with_meter_tags_artifacts_and_events(prefect_server, jobs, pool):
    result = cli("e31", "run", str(jobs / "retrain.yaml"), "--now", "--pool", pool, gpus="1xH100")
    assert result.returncode == 0, result.stdout + result.stderr
    run_id = flow_run_id(result.stdout)
    assert ": Completed" in result.stdout

    outputs = list((jobs / "outputs" / "retrain-tonight").iterdir())
    assert len(outputs) == 1
    metrics = json.loads((outputs[0] / "metrics.json").read_text())
    assert metrics["accuracy"] > 0.8 and (outputs[0] / "model.json").exists()

    run = read_run(run_id)
    assert run.state.is_completed()
    tags = set(run.tags)
    assert {"e31", "e31:gpus=1", "e31:team=vision"} <= tags
    billed = float(next(t for t in tags if t.startswith("e31:billed-s=")).split("=")[1])
    run_s = float(next(t for t in tags if t.startswith("e31:run-s=")).split("=")[1])
    assert 0 <= run_s <= billed + 1

    found = artifacts_of(run_id)
    rows = json.loads(found["meter"].data)
    steps = [row["step"] for row in rows]
    assert steps == ["submitted", "picked", "staged", "ready", "rented", "running", "run_ended", "output",
                     "released", "total billed"]
    from datetime import datetime

    at = {row["step"]: datetime.fromisoformat(row["at"]) for row in rows[:-1]}
    billed_exact = (at["run_ended"] - at["rented"]).total_seconds()
    assert rows[-1]["seconds"] == pytest.approx(billed_exact, abs=0.002)
    # Prefect loaded in the job's process before the rent (unbilled); the flow ran within the bill.
    assert at["staged"] <= at["ready"] <= at["rented"] <= at["running"] <= run.start_time
    # The bill ends when the job's process is gone, after its engine reported the flow's end.
    assert run.end_time <= at["run_ended"] and not next(r for r in rows if r["step"] == "ready")["billed"]
    assert outputs[0].as_uri() in found["outputs"].data

    names = e31_events(run_id, {"e31.job.staged", "e31.job.rented", "e31.job.running",
                                "e31.job.output", "e31.job.released"})
    assert names == ["e31.job.staged", "e31.job.rented", "e31.job.running", "e31.job.output",
                     "e31.job.released"]
    # Its flow took less than a heartbeat interval (180 s): its process sent no heartbeat (job_entry), though the
    # events of its tasks, sent after the flow started, arrived.
    deadline = time.monotonic() + 30
    while not job_events(run_id, "prefect.task-run.", related=True):
        assert time.monotonic() < deadline, "the events of the flow's tasks never arrived"
        time.sleep(1)
    assert job_events(run_id, "prefect.flow-run.heartbeat") == []


def test_job_sees_only_its_devices_its_dirs_and_no_credentials(prefect_server, tmp_path, pool):
    job = write_job(tmp_path / "probe", """
        name: env-probe
        work:
          flow: flow.py:probe
          env: {CUDA_VISIBLE_DEVICES: "0,1,2,3"}
        data:
          - from: input.txt
        request: {gpus: 2, gpu_type: h100, max_duration: 5m}
        output: {to: ./out/, expect: [env.json]}
        """, flow="""
        import json, os
        from prefect import flow
        from e31_prefect import data_dir, output_dir

        @flow
        def probe():
            seen = {k: os.environ.get(k) for k in (
                "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "AWS_SECRET_ACCESS_KEY", "E31_GPUS")}
            seen["input"] = (data_dir() / "input.txt").read_text()
            seen["data_writable"] = os.access(data_dir() / "input.txt", os.W_OK) and os.geteuid() != 0
            (output_dir() / "env.json").write_text(json.dumps(seen))
        """)
    (tmp_path / "probe" / "input.txt").write_text("hello")
    result = cli("e31", "run", str(job), "--pool", pool, gpus="0:A100,1:H100,2:H100,3:NVIDIA H100 80GB",
                 env={"AWS_SECRET_ACCESS_KEY": "do-not-leak"})
    assert result.returncode == 0, result.stdout + result.stderr
    seen = json.loads((tmp_path / "probe" / "out" / "env.json").read_text())
    # gpu_type h100 skips device 0 (an A100); the job's own env cannot widen its view.
    assert seen["CUDA_VISIBLE_DEVICES"] == "1,2"
    assert seen["NVIDIA_VISIBLE_DEVICES"] == "1,2"
    assert seen["AWS_SECRET_ACCESS_KEY"] is None and seen["E31_GPUS"] is None
    assert seen["input"] == "hello"
    assert seen["data_writable"] is False
    assert "e31:gpus=2" in read_run(flow_run_id(result.stdout)).tags


def test_code_on_the_jobs_own_pythonpath_runs_only_once_it_was_handed_its_devices(prefect_server, tmp_path, pool):
    """A sitecustomize.py on the job's PYTHONPATH runs as an interpreter starts: never before the hand-over, when
    the devices were not rented, the meter had not started and no time limit ran."""
    job = write_job(tmp_path / "hooked", f"""
        name: hooked
        work:
          flow: flow.py:hooked
          env: {{PYTHONPATH: "{tmp_path / 'hooked' / 'lib'}"}}
        request: {{gpus: 1, max_duration: 5m}}
        output: {{to: ./out/, expect: [hook.txt]}}
        """, flow="""
        from prefect import flow
        from helper import answer

        @flow
        def hooked():
            return answer()
        """)
    lib = tmp_path / "hooked" / "lib"
    lib.mkdir()
    (lib / "helper.py").write_text("def answer():\n    return 42\n")
    (lib / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('E31_OUTPUT_DIR'):\n"
        "    with open(os.path.join(os.environ['E31_OUTPUT_DIR'], 'hook.txt'), 'a') as f:\n"
        "        f.write(repr(os.environ.get('CUDA_VISIBLE_DEVICES')) + '\\n')\n")
    os.chmod(tmp_path, 0o755)
    result = cli("e31", "run", str(job), "--now", "--pool", pool, gpus="1xH100")
    assert result.returncode == 0 and ": Completed" in result.stdout, result.stdout + result.stderr
    assert (tmp_path / "hooked" / "out" / "hook.txt").read_text() == "'0'\n", "the job's code ran before the hand-over"


def test_time_limit_kills_the_process_group_and_fails_timed_out(prefect_server, tmp_path, pool):
    marker = f"e31-test-child-{uuid4()}"  # the job's pids are its namespace's: the host finds its child by this
    job = write_job(tmp_path / "slow", """
        name: too-slow
        work: {flow: flow.py:slow}
        request: {gpus: 1, max_duration: 20s}
        output: {to: ./out/}
        """, flow="""
        import subprocess, sys, time
        from prefect import flow
        from e31_prefect import output_dir

        @flow
        def slow():
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "MARKER"])
            (output_dir() / "partial.txt").write_text("written before the limit")
            time.sleep(600)
        """.replace("MARKER", marker))
    result = cli("e31", "run", str(job), "--pool", pool, gpus="1xH100",
                 env={"E31_STOP_GRACE_SECONDS": "2"})
    assert result.returncode == 1, result.stdout + result.stderr
    run_id = flow_run_id(result.stdout)
    run = read_run(run_id)
    assert run.state.is_failed() and run.state.name == "TimedOut"
    assert "time limit" in run.state.message
    assert "e31:timed-out" in run.tags
    out = tmp_path / "slow" / "out"
    assert (out / "partial.txt").read_text() == "written before the limit"
    assert host_processes_with(marker) == [], "the job's child outlived its time limit"
    billed = float(next(t for t in run.tags if t.startswith("e31:billed-s=")).split("=")[1])
    assert 19 <= billed <= 20 + 2 + 1, "billed past its time limit and grace"
    e31_events(run_id, {"e31.job.timed-out", "e31.job.released"})


def test_missing_expected_output_fails_the_run_naming_the_file(prefect_server, tmp_path, pool):
    job = write_job(tmp_path / "forgetful", """
        name: forgetful
        work: {flow: flow.py:forget}
        request: {gpus: 0, max_duration: 5m}
        output: {to: ./out/, expect: [model.json, metrics.json]}
        """, flow="""
        from prefect import flow
        from e31_prefect import output_dir

        @flow
        def forget():
            (output_dir() / "metrics.json").write_text("{}")
        """)
    result = cli("e31", "run", str(job), "--pool", pool)
    assert result.returncode == 1
    run = read_run(flow_run_id(result.stdout))
    assert run.state.name == "OutputMissing" and "model.json" in run.state.message
    assert "metrics.json" not in run.state.message.split("(")[0]
    assert (tmp_path / "forgetful" / "out" / "metrics.json").exists()


def test_ten_thousand_shards_run_through_the_built_in_flow_on_declared_gpus(prefect_server, jobs, pool):
    result = cli("e31", "run", str(jobs / "simulations.yaml"), "--pool", pool, gpus="4xH100")
    assert result.returncode == 0, result.stdout + result.stderr
    [out] = (jobs / "outputs" / "ten-thousand-simulations").iterdir()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["simulations"] == 10000 and summary["failed_shards"] == []
    histogram = (out / "histogram.csv").read_text().splitlines()[1:]
    assert sum(int(line.split(",")[1]) for line in histogram) == 10000
    assert len(list(out.glob("shard-*/finished.txt"))) == 10000
    # One job: one rent of the four GPUs, one meter.
    assert "e31:gpus=4" in read_run(flow_run_id(result.stdout)).tags


def test_a_plain_command_job_runs_once_through_the_built_in_flow(prefect_server, tmp_path, pool):
    job = write_job(tmp_path / "plain", """
        name: plain-command
        work: {command: [python, -c, "import os; print('no shard:', os.environ.get('E31_SHARD_INDEX'))"]}
        request: {gpus: 0, max_duration: 5m}
        """)
    result = cli("e31", "run", str(job), "--pool", pool)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no shard: None" in result.stdout and ": Completed" in result.stdout


def test_a_job_whose_folder_holds_the_workers_home_runs_and_sees_none_of_it_but_its_own(prefect_server, tmp_path,
                                                                                       pool):
    """E31_HOME kept in the folder of the job files (a project checked out with its worker's home in it): the
    job's view of its folder shows it its own workspace there, and nothing else of E31_HOME."""
    home = tmp_path / "project" / "e31-home"
    job = write_job(tmp_path / "project", f"""
        name: home-inside
        work: {{flow: flow.py:probe, parameters: {{home: "{home}"}}}}
        request: {{gpus: 0, max_duration: 5m}}
        """, flow="""
        import os
        from prefect import flow
        from e31_prefect import output_dir

        @flow
        def probe(home: str):
            for folder in ("workspaces", "spool", "ledger"):
                try:
                    print(f"{folder}:", sorted(os.listdir(os.path.join(home, folder))))
                except PermissionError:
                    print(f"{folder}: closed")
            print("mine:", sorted(os.listdir(output_dir())))
        """)
    # Another run's workspace there: the job must not see it.
    (home / "workspaces" / "another-run").mkdir(parents=True)
    result = cli("e31", "run", str(job), "--pool", pool, env={"E31_HOME": str(home)}, cwd=tmp_path / "project")
    assert result.returncode == 0, result.stdout + result.stderr
    run_id = flow_run_id(result.stdout)
    assert ": Completed" in result.stdout and "mine: []" in result.stdout, result.stdout
    assert f"workspaces: ['{run_id}']" in result.stdout, result.stdout
    assert "spool: closed" in result.stdout or "spool: []" in result.stdout, result.stdout


def test_worker_refuses_a_run_past_its_latest_start_before_renting(prefect_server, tmp_path, pool):
    job = write_job(tmp_path / "late", """
        name: late-job
        team: night-shift
        work: {flow: flow.py:never}
        request: {gpus: 1, max_duration: 1h, deadline: +2h}
        """, flow="""
        from prefect import flow

        @flow
        def never():
            raise AssertionError("a run past its deadline must not start")
        """)
    submitted = cli("e31", "submit", str(job), "--pool", pool)
    assert submitted.returncode == 0, submitted.stderr
    with get_client(sync_client=True) as client:
        first = client.read_flow_run(flow_run_id(submitted.stdout))
        # A second run of the same deployment whose deadline is now too close for its hour.
        soon = (time.time() + 600)
        from datetime import datetime, timezone

        deadline = datetime.fromtimestamp(soon, timezone.utc).isoformat()
        late = client.create_flow_run_from_deployment(
            first.deployment_id, job_variables={"request": {"gpus": 1, "max_duration": "1h", "deadline": deadline}})
        client.delete_flow_run(first.id)
    worker = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once", gpus="1xH100")
    assert worker.returncode == 0, worker.stdout + worker.stderr
    run = read_run(late.id)
    assert run.state.is_failed() and run.state.name == "DeadlineMissed"
    assert "No GPU was rented" in run.state.message
    assert "e31:billed-s=0" in run.tags and "e31:deadline-missed" in run.tags
    assert "e31:team=night-shift" in run.tags  # so `e31 usage` counts the miss against its team
    e31_events(late.id, {"e31.job.deadline-missed"})


def test_worker_leaves_runs_it_cannot_fit_and_takes_the_least_slack_first(prefect_server, tmp_path, pool):
    relaxed = mark_job(tmp_path / "a", "relaxed", deadline="+8h")
    urgent = mark_job(tmp_path / "b", "urgent", deadline="+30m")
    big = mark_job(tmp_path / "c", "too-big", gpus=2, gpu_type="H100")
    ids = {}
    for path in (relaxed, big, urgent):
        submitted = cli("e31", "submit", str(path), "--pool", pool)
        assert submitted.returncode == 0, submitted.stderr
        ids[path.parent.name] = flow_run_id(submitted.stdout)

    worker = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once", gpus="1xH100")
    assert worker.returncode == 0, worker.stdout + worker.stderr
    assert read_run(ids["b"]).state.is_completed()
    assert read_run(ids["a"]).state.is_scheduled()
    assert read_run(ids["c"]).state.is_scheduled()

    # On two H100s the run with a deadline still goes first, and the big one no longer fits beside it.
    worker = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once", gpus="2xH100")
    assert worker.returncode == 0, worker.stdout + worker.stderr
    assert read_run(ids["a"]).state.is_completed()
    assert read_run(ids["c"]).state.is_scheduled()

    worker = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once", gpus="2xH100")
    assert worker.returncode == 0, worker.stdout + worker.stderr
    assert read_run(ids["c"]).state.is_completed()
    assert (tmp_path / "c" / "out" / "ran").exists()


def test_submit_returns_at_once_and_a_stock_prefect_worker_runs_it(prefect_server, jobs, pool):
    created = cli("prefect", "work-pool", "create", pool, "--type", "e31")
    assert created.returncode == 0, created.stdout + created.stderr
    submitted = cli("e31", "submit", str(jobs / "footage.yaml"), "--pool", pool)
    assert submitted.returncode == 0, submitted.stderr
    run_id = flow_run_id(submitted.stdout)
    assert f"/runs/flow-run/{run_id}" in submitted.stdout
    assert read_run(run_id).state.is_scheduled()

    worker = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once")
    assert worker.returncode == 0, worker.stdout + worker.stderr
    run = read_run(run_id)
    assert run.state.is_completed(), run.state
    [out] = (jobs / "outputs" / "footage-pass").iterdir()
    track = json.loads((out / "track.json").read_text())
    assert len(track) == 24 and all(frame["pixels"] > 0 for frame in track)
    assert len(list((out / "masks").glob("*.pgm"))) == 24


def test_pool_form_documents_every_request_field(prefect_server, pool):
    created = cli("prefect", "work-pool", "create", pool, "--type", "e31")
    assert created.returncode == 0, created.stdout + created.stderr
    with get_client(sync_client=True) as client:
        template = client.read_work_pool(pool).base_job_template
    definitions = template["variables"]["definitions"] if "definitions" in template["variables"] \
        else template["variables"]["$defs"]
    request = definitions["Request"]["properties"]
    assert {"gpus", "gpu_type", "max_duration", "until_done", "expected_duration", "start", "deadline",
            "priority"} <= set(request)
    for name, field in request.items():
        assert field.get("title") and field.get("description") and field.get("examples"), name


def test_bad_job_file_exits_2_with_one_line_per_problem_and_no_traceback(prefect_server, tmp_path, pool):
    job = write_job(tmp_path / "bad", """
        name: bad
        work: {flow: missing.py:train, command: [python, x.py]}
        data:
          - {from: "gs://bucket/x", to: ../escape}
        request: {gpus: 0, gpu_type: H100, max_duration: 2hours, deadlin: "07:00"}
        """)
    for command in (("validate",), ("run", "--pool", pool), ("submit", "--pool", pool)):
        result = cli("e31", command[0], str(job), *command[1:])
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr
        lines = [line.strip() for line in result.stderr.splitlines()[1:]]
        assert any(line.startswith("data.from = 'gs://bucket/x'") and "s3://" in line for line in lines)
        assert any(line.startswith("data.to = '../escape'") for line in lines)
        assert any(line.startswith("request.max_duration = '2hours'") and "90m" in line for line in lines)
        assert any(line.startswith("request.deadlin") and "did you mean deadline?" in line for line in lines)
        assert any(line.startswith("work =") and "not both" in line for line in lines)


def test_cancelling_a_running_process_stops_its_group_and_closes_the_meter(prefect_server, tmp_path, pool):
    job = write_job(tmp_path / "cancel", """
        name: cancel-process
        work: {flow: flow.py:slow}
        request: {gpus: 1, max_duration: 10m}
        output: {to: ./out/}
        """, flow="""
        import time
        from prefect import flow
        from e31_prefect import output_dir

        @flow
        def slow():
            (output_dir() / "started.txt").write_text("yes")
            time.sleep(600)
        """)
    run_id = flow_run_id(cli("e31", "submit", str(job), "--pool", pool).stdout)
    output = cancel_while_running(run_id, pool)
    run = read_run(run_id)
    assert run.state.is_cancelled(), (run.state, output[-3000:])
    assert "e31:cancelled" in run.tags
    assert (tmp_path / "cancel" / "out" / "started.txt").exists()


def cancel_while_running(run_id: UUID, pool: str) -> str:
    """Run a worker for the pool, cancel the run once it runs, as a user would; returns the worker's output."""
    worker = subprocess.Popen(
        [str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", pool, "--type", "e31",
         "--run-once"], env={**os.environ, "E31_GPUS": "1xH100", "E31_WATCH_SECONDS": "0.5"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not read_run(run_id).state.is_running() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert read_run(run_id).state.is_running()
        cancelled = cli("prefect", "flow-run", "cancel", str(run_id))
        assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
        return worker.communicate(timeout=120)[0]
    finally:
        worker.kill()


def test_usage_totals_equal_the_sum_of_the_runs_meters(prefect_server, tmp_path, pool):
    flow = """
        from prefect import flow

        @flow
        def quick():
            return 1
        """
    ids = []
    for index, (team, gpus) in enumerate([("usage-a", 1), ("usage-a", 2), ("usage-b", 1)]):
        job = write_job(tmp_path / f"j{index}", f"""
            name: usage-{index}
            team: {team}
            work: {{flow: flow.py:quick}}
            request: {{gpus: {gpus}, max_duration: 5m}}
            """, flow=flow)
        result = cli("e31", "run", str(job), "--pool", pool, gpus="2xH100")
        assert result.returncode == 0, result.stdout + result.stderr
        ids.append((team, gpus, flow_run_id(result.stdout)))
    expected: dict[str, float] = {}
    for team, gpus, run_id in ids:
        rows = json.loads(artifacts_of(run_id)["meter"].data)
        expected[team] = expected.get(team, 0.0) + gpus * rows[-1]["seconds"]
    report = cli("e31", "usage", "--by", "team", "--format", "json")
    assert report.returncode == 0, report.stderr
    totals = {row["team"]: row for row in json.loads(report.stdout)}
    for team, billed_gpu_seconds in expected.items():
        assert totals[team]["gpu_hours_billed"] == pytest.approx(billed_gpu_seconds / 3600, abs=1e-12)
    assert totals["usage-a"]["runs"] == 2 and totals["usage-b"]["runs"] == 1


def test_submits_that_race_to_create_their_pool_all_land_in_it(prefect_server, pool):
    """Jobs submitted at once to a pool nobody created yet (or as its worker starts): one creates it, the
    others find it, and none fails on the server's 'already exists'."""
    import asyncio

    from e31_prefect.surface.submission import ensure_pool

    async def all_at_once() -> list:
        async with get_client() as client:
            return await asyncio.gather(*(ensure_pool(client, pool) for _ in range(8)))

    pools = asyncio.run(all_at_once())
    assert {found.name for found in pools} == {pool} and {found.type for found in pools} == {"e31"}
