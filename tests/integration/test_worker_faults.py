"""Real e31 workers under faults: killed, told to stop, sharing a host, fed a hostile run.

Whatever happens to a worker, its runs stay bounded by their supervisors, the next worker on the
host adopts them, the meter closes at the work's true end (as the supervisor recorded it), and
no device is ever rented twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from uuid import UUID

import pytest
from prefect import get_client

from e31_prefect.host.inventory import Device, Inventory
from e31_prefect.host.ledger import Record, RunFolder, process_running
from e31_prefect.model.meter import work_end
from tests.integration.conftest import cli, flow_run_id, host_processes_with
from tests.integration.test_jobs_end_to_end import artifacts_of, read_run, write_job

pytestmark = pytest.mark.integration

FLOW = """
import json, os, subprocess, sys, time
from datetime import datetime, timezone
from prefect import flow
from e31_prefect import output_dir

@flow
def work(seconds: float = 3, daemon: bool = False) -> dict:
    (output_dir() / "checkpoint.txt").write_text("epoch 1")
    if daemon:  # a daemon in a session of its own, as a careless or hostile job would leave
        # Marked with its run's id: its pid is its PID namespace's, so the host finds it by that mark.
        subprocess.Popen([sys.executable, "-c", "import os, time; open('daemon.pid', 'w').write(str(os.getpid()));"
                          "time.sleep(600)", "e31-test-daemon-" + os.environ["PREFECT__FLOW_RUN_ID"]],
                         cwd=output_dir(), start_new_session=True)
    started = datetime.now(timezone.utc).isoformat()
    time.sleep(seconds)
    ran = {"devices": os.environ["CUDA_VISIBLE_DEVICES"], "started": started,
           "ended": datetime.now(timezone.utc).isoformat()}
    (output_dir() / "ran.json").write_text(json.dumps(ran))
    return ran
"""


class Worker:
    """A `prefect worker start --type e31` process of this test, with its log kept."""

    def __init__(self, pool: str, home: Path, gpus: str = "1xH100", *extra: str, **env: str):
        home.mkdir(parents=True, exist_ok=True)
        self.log = home / f"worker-{time.monotonic_ns()}.log"
        self.home = home
        self.process = subprocess.Popen(
            [str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", pool, "--type", "e31", *extra],
            env={**os.environ, "E31_HOME": str(home), "E31_GPUS": gpus, "E31_WATCH_SECONDS": "0.5",
                 "E31_STOP_GRACE_SECONDS": "2", "PREFECT_WORKER_QUERY_SECONDS": "1", **env},
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)

    def stop(self, timeout: float) -> float:
        """SIGTERM, as a service manager sends it; seconds until the worker exited."""
        sent = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=timeout)
        return time.monotonic() - sent

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)


def submit(tmp_path: Path, pool: str, name: str, request: str, **parameters: object) -> UUID:
    params = json.dumps(parameters)
    job = write_job(tmp_path / name, f"""
        name: {name}
        work: {{flow: flow.py:work, parameters: {params}}}
        request: {request}
        output: {{to: ./out/}}
        """, flow=FLOW)
    submitted = cli("e31", "submit", str(job), "--pool", pool)
    assert submitted.returncode == 0, submitted.stderr
    return flow_run_id(submitted.stdout)


def closed(run_id: UUID) -> bool:
    """The run's meter is closed: its outputs went before."""
    return any(t.startswith("e31:billed-s=") for t in read_run(run_id).tags)


def until(check, timeout: float, what: str, every: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"{what} did not happen within {timeout} s")


def record_of(home: Path, run_id: UUID) -> Record | None:
    return RunFolder(home / "ledger" / str(run_id)).record()


def running_under_supervisor(home: Path, run_id: UUID) -> Record | None:
    record = record_of(home, run_id)
    return record if record is not None and record.started and read_run(run_id).state.is_running() else None


def billed_in_artifact(run_id: UUID) -> float:
    table = json.loads(artifacts_of(run_id)["meter"].data)
    return next(row["seconds"] for row in table if row["step"] == "total billed")


def accounted_bill(home: Path, run_id: UUID) -> float:
    """What the run's supervisor accounted for it (the host's accounting file): rent to the work's true end."""
    lines = [json.loads(line) for line in (home / "accounting.jsonl").read_text().splitlines()]
    entry = next(line for line in lines if line["run_id"] == str(run_id))
    end = work_end(datetime.fromisoformat(entry["ended"]),
                   datetime.fromisoformat(entry["stop_requested"]) if entry["stop_requested"] else None,
                   entry["grace_seconds"])
    return (end - datetime.fromisoformat(entry["rented"])).total_seconds()


def test_a_killed_workers_run_keeps_its_time_limit_and_the_next_worker_closes_it_at_the_true_end(
        prefect_server, tmp_path, pool):
    home = tmp_path / "host"
    # Long enough for Prefect's engine to start and checkpoint on a busy host.
    run_id = submit(tmp_path, pool, "orphaned", "{gpus: 1, max_duration: 25s}", seconds=600)
    first = Worker(pool, home)
    record = until(lambda: running_under_supervisor(home, run_id), 120, "the run starting", )
    first.kill()
    work = int(record.infrastructure)
    assert process_running(work), "the work dies with its worker"
    # Nobody runs a worker now: the supervisor alone stops the work at its time limit.
    until(lambda: (record_of(home, run_id) or Record()).finished, 60, "the supervisor ending the work")
    assert not process_running(work)
    # The device's lock goes as the work's last process does.
    until(lambda: Inventory([Device(0, "H100")], Path(os.environ["E31_DEVICE_LOCKS"])).free() == [Device(0, "H100")],
          30, "the device coming back")
    # Its line in the host's accounting follows, once the supervisor has swept what the work left.
    until(lambda: (home / "accounting.jsonl").exists(), 30, "the supervisor accounting for the run")
    expected = accounted_bill(home, run_id)
    assert 25 <= expected <= 25 + 2 + 1, "billed past its time limit and grace"
    time.sleep(3)  # time that passes before the next worker starts is billed to nobody

    second = Worker(pool, home, "1xH100", "--run-once")
    assert second.wait(120) == 0, second.output()
    run = read_run(run_id)
    assert run.state.name == "TimedOut", (run.state, second.output())
    assert "e31:timed-out" in run.tags
    assert abs(billed_in_artifact(run_id) - expected) <= 1.0
    assert (tmp_path / "orphaned" / "out" / "checkpoint.txt").read_text() == "epoch 1"
    assert not (home / "ledger" / str(run_id)).exists()


def test_a_run_whose_worker_was_killed_completes_and_is_adopted(prefect_server, tmp_path, pool):
    home = tmp_path / "host"
    run_id = submit(tmp_path, pool, "adopted", "{gpus: 1, max_duration: 5m}", seconds=8)
    first = Worker(pool, home)
    until(lambda: running_under_supervisor(home, run_id), 120, "the run starting")
    first.kill()
    second = Worker(pool, home, "1xH100", "--run-once")
    assert second.wait(180) == 0, second.output()
    run = read_run(run_id)
    assert run.state.is_completed(), (run.state, second.output())
    ran = json.loads((tmp_path / "adopted" / "out" / "ran.json").read_text())
    work_seconds = (datetime.fromisoformat(ran["ended"]) - datetime.fromisoformat(ran["started"])).total_seconds()
    assert work_seconds >= 8
    assert abs(billed_in_artifact(run_id) - accounted_bill(home, run_id)) <= 1.0
    assert billed_in_artifact(run_id) >= work_seconds
    assert run.state.result() == ran, "the adopted run's return value is readable"


def test_sigterm_stops_a_worker_within_10_s_and_its_run_goes_on_for_the_next(prefect_server, tmp_path, pool):
    idle = Worker(f"{pool}-idle", tmp_path / "idle")
    until(lambda: "started!" in idle.output(), 120, "the idle worker starting")  # Prefect's word, once it polls
    time.sleep(1)
    assert idle.stop(timeout=30) <= 10, idle.output()

    home = tmp_path / "host"
    run_id = submit(tmp_path, pool, "outlives", "{gpus: 1, max_duration: 5m}", seconds=10)
    busy = Worker(pool, home)
    record = until(lambda: running_under_supervisor(home, run_id), 120, "the run starting")
    assert busy.stop(timeout=30) <= 10, busy.output()
    assert process_running(int(record.infrastructure)), "SIGTERM to the worker stopped its run"
    second = Worker(pool, home, "1xH100", "--run-once")
    assert second.wait(180) == 0, second.output()
    assert read_run(run_id).state.is_completed(), second.output()


def test_two_workers_on_one_host_never_rent_gpu_0_twice(prefect_server, tmp_path, pool):
    """Two pools, two E31_HOMEs, one host (one device-lock folder): GPU 0 is one run's at a time."""
    runs = {name: submit(tmp_path, f"{pool}-{name[0]}", name, "{gpus: 1, max_duration: 5m}", seconds=1)
            for name in ("a1", "a2", "b1", "b2")}
    workers = [Worker(f"{pool}-a", tmp_path / "home-a"), Worker(f"{pool}-b", tmp_path / "home-b")]
    try:
        until(lambda: all(closed(r) for r in runs.values()), 240, "all four runs ending", every=1)
    finally:
        for worker in workers:
            worker.stop(timeout=30)
    spans = []
    for name, run_id in runs.items():
        assert read_run(run_id).state.is_completed(), name
        ran = json.loads((tmp_path / name / "out" / "ran.json").read_text())
        assert ran["devices"] == "0"
        spans.append((datetime.fromisoformat(ran["started"]), datetime.fromisoformat(ran["ended"])))
    spans.sort()
    assert all(earlier[1] <= later[0] for earlier, later in zip(spans, spans[1:], strict=False)), spans


def test_a_run_with_a_hostile_deadline_fails_alone_and_the_worker_serves_the_next(prefect_server, tmp_path, pool):
    good = submit(tmp_path, pool, "good", "{gpus: 0, max_duration: 5m}", seconds=1)
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment(read_run(good).deployment_id)
        hostile = client.create_flow_run_from_deployment(deployment.id, job_variables={
            "request": {"gpus": 0, "max_duration": "1m", "deadline": "0001-01-01T00:00:00+00:00"}}).id
        no_zone = client.create_flow_run_from_deployment(deployment.id, job_variables={"timezone": "Mars/Olympus"}).id
    worker = Worker(pool, tmp_path / "host")
    try:
        until(lambda: all(closed(r) for r in (good, hostile, no_zone)), 180, "the runs ending", every=1)
        assert worker.process.poll() is None, worker.output()
    finally:
        worker.stop(timeout=30)
    assert read_run(good).state.is_completed()
    for run_id, fragment in ((hostile, "out of range"), (no_zone, "is not a time zone")):
        state = read_run(run_id).state
        assert state.name == "InvalidJob" and fragment in state.message, state


def test_a_cancelled_run_is_stopped_with_its_daemon_and_billed_to_the_stop(prefect_server, tmp_path, pool):
    home = tmp_path / "host"
    run_id = submit(tmp_path, pool, "cancelled", "{gpus: 1, max_duration: 5m}", seconds=600, daemon=True)
    worker = Worker(pool, home)
    try:
        until(lambda: running_under_supervisor(home, run_id), 120, "the run starting")
        daemon_pid = tmp_path / "host" / "workspaces" / str(run_id) / "output" / "daemon.pid"
        until(lambda: daemon_pid.exists() and daemon_pid.read_text(), 30, "the daemon starting")
        assert host_processes_with(f"e31-test-daemon-{run_id}"), "the daemon is not found by its mark"
        cancelled = cli("prefect", "flow-run", "cancel", str(run_id))
        assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
        asked = datetime.now().astimezone()
        until(lambda: closed(run_id), 60, "the meter closing")
    finally:
        worker.stop(timeout=30)
    run = read_run(run_id)
    assert run.state.is_cancelled(), run.state
    assert host_processes_with(f"e31-test-daemon-{run_id}") == [], "the setsid daemon outlived its cancelled run"
    rented = datetime.fromisoformat(next(r["at"] for r in json.loads(artifacts_of(run_id)["meter"].data)
                                         if r["step"] == "rented"))
    assert billed_in_artifact(run_id) <= (asked - rented).total_seconds() + 2 + 1  # the watcher's beat and grace


def test_a_run_whose_worker_died_before_renting_goes_back_to_the_pool(prefect_server, tmp_path, pool):
    """Killed while staging: Prefect would keep the run Pending for ever; the next worker hands it back."""
    import socket

    silent = socket.socket()  # an S3 endpoint that accepts and never answers: staging waits on it
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
    job = write_job(tmp_path / "stuck", """
        name: stuck
        work: {flow: flow.py:work}
        data: [{from: "s3://bucket/big.bin"}]
        request: {gpus: 1, max_duration: 5m}
        """, flow=FLOW)
    run_id = flow_run_id(cli("e31", "submit", str(job), "--pool", pool).stdout)
    home = tmp_path / "host"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
           "AWS_DEFAULT_REGION": "us-east-1"}
    first = Worker(pool, home, "1xH100", **env)
    try:
        until(lambda: read_run(run_id).state.type.value == "PENDING", 120, "the worker taking the run")
        # Staging: listing s3://bucket/big.bin at the endpoint, which never answers (kept open until the end).
        silent.settimeout(120)
        listing, _ = silent.accept()
        first.kill()
        listing.close()
        assert read_run(run_id).state.type.value == "PENDING"
        assert (home / "ledger" / str(run_id)).exists(), "the taken run is not in the host's ledger"
        # The next worker (the endpoint now refuses, so the run is not taken again at once) hands it back.
        silent.close()
        second = Worker(pool, home, "1xH100", **{**env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
        # Back in the pool with the host's ledger entry gone (the second worker may take it again at once
        # and fail its staging: that ends it).
        until(lambda: (read_run(run_id).state.name == "Scheduled" and not (home / "ledger" / str(run_id)).exists())
              or read_run(run_id).state.name == "StagingFailed", 120, "the run going back")
        second.stop(timeout=30)
    finally:
        silent.close()
