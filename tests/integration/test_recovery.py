"""A worker killed with SIGKILL mid-run: the next worker on the host stops its orphan and closes its meter."""

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

from e31_prefect.ledger import process_running
from tests.integration.conftest import cli, flow_run_id
from tests.integration.test_jobs_end_to_end import read_run, write_job

pytestmark = pytest.mark.integration

FLOW = """
import time
from prefect import flow
from e31_prefect import output_dir

@flow
def slow():
    (output_dir() / "checkpoint.txt").write_text("epoch 1")
    time.sleep(600)
"""


def test_killed_worker_leaves_nothing_held_or_billing(prefect_server, tmp_path, pool):
    home = tmp_path / "e31-home"
    env = {**os.environ, "E31_HOME": str(home), "E31_GPUS": "1xH100", "E31_WATCH_SECONDS": "0.5"}
    job = write_job(tmp_path / "job", """
        name: orphaned
        work: {flow: flow.py:slow}
        request: {gpus: 1, max_duration: 1h}
        output: {to: ./out/}
        """, flow=FLOW)
    run_id = flow_run_id(cli("e31", "submit", str(job), "--pool", pool).stdout)
    prefect = str(Path(sys.executable).parent / "prefect")
    worker = subprocess.Popen([prefect, "worker", "start", "--pool", pool, "--type", "e31"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    entry = home / "ledger" / f"{run_id}.json"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if entry.exists() and json.loads(entry.read_text()).get("infrastructure") and \
                    read_run(run_id).state.is_running():
                break
            time.sleep(0.5)
        time.sleep(2)  # a few heartbeats
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
    last = json.loads(entry.read_text())
    orphan = int(last["infrastructure"])
    assert process_running(orphan), "the flow run's process outlives its killed worker until someone stops it"
    time.sleep(5)  # the orphan keeps running; none of this may be billed

    restarted = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once", env=env)
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr

    assert not process_running(orphan)
    assert not entry.exists()
    run = read_run(run_id)
    assert run.state.type.value == "CRASHED" and "last heartbeat" in run.state.message
    assert "e31:worker-lost" in run.tags
    billed = int(next(t for t in run.tags if t.startswith("e31:billed-s=")).split("=")[1])
    heartbeat_bill = datetime.fromisoformat(last["heartbeat"]) - datetime.fromisoformat(last["marks"]["rented"])
    assert abs(billed - heartbeat_bill.total_seconds()) <= 1.5  # closed at the last heartbeat, not at recovery
    assert (tmp_path / "job" / "out" / "checkpoint.txt").read_text() == "epoch 1"
