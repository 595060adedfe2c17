"""Several e31 workers on one pool, with a team quota: nothing rented twice, nothing held after a crash."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from prefect import get_client

from e31_prefect.host.ledger import RunFolder, process_running
from tests.integration.conftest import cli, flow_run_id
from tests.integration.test_jobs_end_to_end import read_run, write_job

pytestmark = pytest.mark.integration

FLOW = """
import json, os, time
from datetime import datetime, timezone
from pathlib import Path
from prefect import flow
from e31_prefect import output_dir

@flow
def work(seconds: float = 3):
    started = datetime.now(timezone.utc).isoformat()
    time.sleep(seconds)
    (output_dir() / "ran.json").write_text(json.dumps({
        # A job sees none of its worker's environment: its host is the home its workspace lies in.
        "worker": Path(os.environ["E31_OUTPUT_DIR"]).parents[2].name.removeprefix("host-"),
        "devices": os.environ["CUDA_VISIBLE_DEVICES"],
        "started": started, "ended": datetime.now(timezone.utc).isoformat()}))
"""


def start_worker(pool: str, gpus: str, home: Path) -> subprocess.Popen:
    # Each worker stands for a host of its own: its own name, its own home and its own host-wide device locks.
    env = {**os.environ, "E31_HOST_NAME": home.name, "E31_HOME": str(home), "E31_DEVICE_LOCKS": str(home / "locks"),
           "E31_GPUS": gpus,
           "E31_WATCH_SECONDS": "0.5", "PREFECT_WORKER_QUERY_SECONDS": "1"}
    home.mkdir(parents=True, exist_ok=True)
    log = (home / f"worker-{time.monotonic_ns()}.log").open("wb")  # kept: a failure shows what the worker saw
    return subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", pool,
                             "--type", "e31"], env=env, stdout=log, stderr=subprocess.STDOUT)


def active_slots(name: str) -> int:
    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(name).active_slots


def overlapping(intervals: list[tuple[datetime, datetime]]) -> int:
    """The most intervals open at one moment."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    most = current = 0
    for _, step in edges:
        current += step
        most = max(most, current)
    return most


def test_two_workers_share_a_pool_and_a_team_quota_without_renting_twice(prefect_server, tmp_path, pool):
    team = f"quota-{pool}"[:40]
    assert cli("e31", "quota", "set", team, "2").returncode == 0
    runs = {}
    for index, gpu_type in enumerate(["A100", "A100", "H100", "H100", None, None]):
        kind = f"gpu_type: {gpu_type}, " if gpu_type else ""
        job = write_job(tmp_path / f"job{index}", f"""
            name: shared-{index}
            team: {team}
            work: {{flow: flow.py:work}}
            request: {{gpus: 1, {kind}max_duration: 5m}}
            output: {{to: ./out/}}
            """, flow=FLOW)
        submitted = cli("e31", "submit", str(job), "--pool", pool)
        assert submitted.returncode == 0, submitted.stderr
        runs[index] = (flow_run_id(submitted.stdout), gpu_type)
    workers = [start_worker(pool, "2xA100", tmp_path / "host-a"),
               start_worker(pool, "2xH100", tmp_path / "host-h")]
    try:
        deadline = time.monotonic() + 240
        # Done when every run's meter is closed (its outputs are sent before that).
        while time.monotonic() < deadline and not all(
                any(t.startswith("e31:billed-s=") for t in read_run(r).tags) for r, _ in runs.values()):
            time.sleep(1)
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.wait(timeout=60)
    seen = {}
    for index, (run_id, gpu_type) in runs.items():
        assert read_run(run_id).state.is_completed(), (index, read_run(run_id).state)
        seen[index] = json.loads((tmp_path / f"job{index}" / "out" / "ran.json").read_text())
        # Prefect names the run's infrastructure by the host that ran it (cancellation finds it there).
        assert read_run(run_id).infrastructure_pid == f"e31:host-{seen[index]['worker']}:{run_id}"
        if gpu_type:
            assert seen[index]["worker"] == {"A100": "a", "H100": "h"}[gpu_type]
    by_device: dict[tuple[str, str], list] = {}
    for ran in seen.values():
        by_device.setdefault((ran["worker"], ran["devices"]), []).append(
            (datetime.fromisoformat(ran["started"]), datetime.fromisoformat(ran["ended"])))
    assert all(overlapping(spans) == 1 for spans in by_device.values()), by_device
    everything = [span for spans in by_device.values() for span in spans]
    assert overlapping(everything) <= 2  # the team's quota, across both workers and four GPUs
    assert active_slots(f"e31-team-{team}") == 0


def test_a_killed_workers_quota_slots_come_back_within_a_lease_and_its_adopter_holds_them_again(
        prefect_server, tmp_path, pool):
    assert cli("e31", "quota", "set", "--pool", pool, "4").returncode == 0
    job = write_job(tmp_path / "job", """
        name: lease-holder
        work: {flow: flow.py:work, parameters: {seconds: 600}}
        request: {gpus: 2, max_duration: 1h}
        """, flow=FLOW)
    run_id = flow_run_id(cli("e31", "submit", str(job), "--pool", pool).stdout)
    home = tmp_path / "host"
    worker = start_worker(pool, "2xH100", home)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not read_run(run_id).state.is_running():
            time.sleep(0.5)
        assert active_slots(f"e31-pool-{pool}") == 2
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
    killed = time.monotonic()
    while active_slots(f"e31-pool-{pool}") and time.monotonic() - killed < 180:
        time.sleep(2)
    assert active_slots(f"e31-pool-{pool}") == 0, "slots outlived the lease of the dead worker"
    # The run goes on under its supervisor; the next worker on its host adopts it and holds its slots again.
    record = RunFolder(home / "ledger" / str(run_id)).record()
    assert process_running(int(record.infrastructure))
    adopter = start_worker(pool, "2xH100", home)
    try:
        deadline = time.monotonic() + 60
        while active_slots(f"e31-pool-{pool}") != 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert active_slots(f"e31-pool-{pool}") == 2
        assert cli("prefect", "flow-run", "cancel", str(run_id)).returncode == 0
        deadline = time.monotonic() + 60
        while not any(t.startswith("e31:billed-s=") for t in read_run(run_id).tags) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        adopter.send_signal(signal.SIGTERM)
        adopter.wait(timeout=30)
    assert read_run(run_id).state.is_cancelled()
    assert not process_running(int(record.infrastructure))
    assert active_slots(f"e31-pool-{pool}") == 0
