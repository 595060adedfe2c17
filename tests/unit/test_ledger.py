"""The host ledger: which runs a dead worker left behind, and where their meters close."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone

from e31_prefect.ledger import Holding, Ledger, process_start_time, this_process
from e31_prefect.recovery import closing_meter

T0 = datetime(2026, 12, 2, 22, 0, tzinfo=timezone.utc)


def holding(run_id: str, pid: int, started: str, **extra) -> Holding:
    return Holding(flow_run_id=run_id, worker_pid=pid, worker_started=started, job_name="train",
                   devices=[0, 1], workspace="/nowhere", gpus=2, **extra)


def test_entries_of_live_workers_are_not_orphans_and_dead_ones_are(tmp_path):
    ledger = Ledger(tmp_path)
    pid, started = this_process()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    ledger.record(holding("alive", pid, started))
    ledger.record(holding("dead", int(dead.stdout), "12345"))
    assert [h.flow_run_id for h in ledger.orphans()] == ["dead"]


def test_a_reused_pid_is_not_the_same_worker(tmp_path):
    ledger = Ledger(tmp_path)
    ledger.record(holding("reused", os.getpid(), "not-this-process-start"))
    assert [h.flow_run_id for h in ledger.orphans()] == ["reused"]
    assert process_start_time(os.getpid()) is not None


def test_forget_and_rewrite(tmp_path):
    ledger = Ledger(tmp_path)
    entry = holding("r", 1, "x")
    ledger.record(entry)
    entry.heartbeat = T0.isoformat()
    ledger.record(entry)
    assert [h.heartbeat for h in ledger.entries()] == [T0.isoformat()]
    ledger.forget("r")
    ledger.forget("r")
    assert ledger.entries() == []


def test_a_dead_workers_meter_closes_at_its_last_heartbeat_not_at_recovery():
    entry = holding("r", 1, "x", marks={"picked": T0.isoformat(), "rented": (T0 + timedelta(seconds=5)).isoformat(),
                                        "running": (T0 + timedelta(seconds=6)).isoformat()},
                    heartbeat=(T0 + timedelta(seconds=65)).isoformat(), team="vision")
    meter = closing_meter(entry, now=T0 + timedelta(hours=3))
    assert meter.billed_seconds == 60.0
    assert meter.billed_gpu_seconds == 120.0
    assert meter.marks["released"] == T0 + timedelta(hours=3)
    assert meter.team == "vision"


def test_a_run_that_never_beat_is_billed_nothing():
    entry = holding("r", 1, "x", marks={"rented": T0.isoformat()})
    assert closing_meter(entry, now=T0 + timedelta(hours=1)).billed_seconds == 0.0


def test_process_running_tells_live_from_gone_and_unreaped():
    from e31_prefect.ledger import process_running

    assert process_running(os.getpid())
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert not process_running(int(finished.stdout))
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = datetime.now() + timedelta(seconds=10)
    while process_running(zombie.pid) and datetime.now() < deadline:
        pass
    assert not process_running(zombie.pid)  # exited, not yet reaped: a zombie is not running
    zombie.wait()
