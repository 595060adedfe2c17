"""The host ledger: which runs a gone worker left behind, and where their meters close."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone

from e31_prefect.host.ledger import (
    Holding,
    Ledger,
    Record,
    process_running,
    process_start_time,
    same_process,
    this_process,
)
from e31_prefect.surface.life_terms import meter_from

T0 = datetime(2026, 12, 2, 22, 0, tzinfo=timezone.utc)


def holding(run_id: str, **extra) -> Holding:
    pid, started = this_process()
    return Holding(flow_run_id=run_id, worker_pid=pid, worker_started=started, job_name="train",
                   devices=[0, 1], workspace="/nowhere", gpus=2, **extra)


def at(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).isoformat()


def test_a_run_owned_by_a_live_worker_is_not_an_orphan(tmp_path):
    ledger = Ledger(tmp_path)
    folder = ledger.folder("alive")
    owner = folder.own()
    assert owner is not None
    folder.write_holding(holding("alive"))
    assert ledger.claim_orphans() == []
    os.close(owner)  # the worker is gone: the kernel drops its lock
    [(claimed, lock)] = ledger.claim_orphans()
    assert claimed.run_id == "alive" and claimed.holding().job_name == "train"
    assert ledger.claim_orphans() == [], "an orphan is adopted by one worker only"
    os.close(lock)


def test_a_host_adopts_only_its_own_runs_where_two_hosts_share_a_ledger(tmp_path):
    ledger = Ledger(tmp_path)
    for run_id, host in (("a-run", "host-a"), ("b-run", "host-b"), ("old-run", None)):
        ledger.folder(run_id).write_holding(holding(run_id, host=host))
    claimed = ledger.claim_orphans("host-a")
    assert sorted(folder.run_id for folder, _ in claimed) == ["a-run", "old-run"], "an entry of an earlier version " \
        "names no host: its ledger's worker adopts it"
    assert [folder.run_id for folder, _ in ledger.claim_orphans("host-b")] == ["b-run"]
    for _, lock in claimed:
        os.close(lock)


def test_a_killed_workers_runs_are_orphans(tmp_path):
    code = ("import sys, time; from pathlib import Path; from e31_prefect.host.ledger import Ledger;"
            f"f = Ledger(Path({str(tmp_path)!r})).folder('r'); assert f.own() is not None;"
            "f.holding_file.write_text('{}'); print('owned', flush=True); time.sleep(600)")
    worker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline().strip() == "owned"
    ledger = Ledger(tmp_path)
    assert ledger.claim_orphans() == []
    worker.kill()
    worker.wait()
    assert [folder.run_id for folder, _ in ledger.claim_orphans()] == ["r"]


def test_a_folder_without_a_holding_is_not_a_run_yet(tmp_path):
    ledger = Ledger(tmp_path)
    ledger.folder("starting").path.mkdir(parents=True)
    assert ledger.folders() == [] and ledger.claim_orphans() == []


def test_rewrite_and_forget(tmp_path):
    ledger = Ledger(tmp_path)
    folder = ledger.folder("r")
    entry = holding("r")
    folder.write_holding(entry)
    entry.marks = {"rented": T0.isoformat()}
    folder.write_holding(entry)
    assert folder.holding().marks == {"rented": T0.isoformat()}
    assert [p.name for p in folder.path.iterdir()] == ["holding.json"], "no temporary file is left"
    ledger.forget("r")
    ledger.forget("r")
    assert ledger.folders() == []


def test_an_unreadable_file_reads_as_none_and_unknown_keys_are_ignored(tmp_path):
    folder = Ledger(tmp_path).folder("r")
    folder.path.mkdir()
    folder.record_file.write_text("{not json")
    assert folder.record() is None
    folder.record_file.write_text('{"ending": "exited", "from_a_newer_version": 1}')
    assert folder.record().ending == "exited"


def test_the_meter_runs_from_rent_to_the_works_true_end():
    entry = holding("r", marks={"picked": at(0), "rented": at(5)}, team="vision")
    record = Record(started=at(6), ended=at(65), ending="exited")
    meter = meter_from(entry, record, grace_seconds=10)
    assert meter.billed_seconds == 60.0
    assert meter.billed_gpu_seconds == 120.0
    assert meter.run_seconds == 59.0
    assert meter.team == "vision"


def test_the_meter_stops_when_the_last_process_is_gone_not_at_the_jobs_word():
    entry = holding("r", marks={"rented": at(0)})
    record = Record(started=at(1), work_ended=at(20), outcome="completed", ended=at(104), ending="exited")
    assert meter_from(entry, record, grace_seconds=10).billed_seconds == 104.0
    liar = Record(started=at(1), work_ended=at(1), outcome="completed", stop_reason="report-overdue",
                  stop_requested=at(61), ended=at(61), ending="kept-running")
    assert meter_from(entry, liar, grace_seconds=10).billed_seconds == 61.0


def test_a_stopped_run_is_billed_at_most_its_grace_past_the_stop():
    entry = holding("r", marks={"rented": at(0)})
    stubborn = Record(started=at(1), stop_requested=at(15), stop_reason="time-limit", ended=at(48),
                      ending="timed-out")
    assert meter_from(entry, stubborn, grace_seconds=10).billed_seconds == 25.0
    prompt = Record(started=at(1), stop_requested=at(15), stop_reason="time-limit", ended=at(16),
                    ending="timed-out")
    assert meter_from(entry, prompt, grace_seconds=10).billed_seconds == 16.0


def test_a_run_whose_work_never_ended_has_no_end_yet():
    entry = holding("r", marks={"rented": at(0)})
    meter = meter_from(entry, Record(started=at(1)), grace_seconds=10)
    assert "run_ended" not in meter.marks and meter.billed_seconds == 0.0


def test_processes_are_told_apart_by_pid_and_start_time():
    pid, started = this_process()
    assert same_process(pid, started)
    assert not same_process(pid, "not-this-process-start")
    assert process_start_time(pid) == started
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert not process_running(int(finished.stdout))
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = datetime.now() + timedelta(seconds=10)
    while process_running(zombie.pid) and datetime.now() < deadline:
        pass
    assert not process_running(zombie.pid)  # exited, not yet reaped: a zombie is not running
    zombie.wait()


# -- a container that will not stop -------------------------------------------------------------


class StubbornEngine:
    """A Docker API whose stop answers 500, as a fork bomb's container made one answer."""

    def __init__(self, kill_fails: bool):
        self.kill_fails = kill_fails
        self.calls: list[str] = []

    def stop(self, container_id: str, timeout: int) -> None:
        import docker.errors

        self.calls.append("stop")
        raise docker.errors.APIError("500 Server Error: cannot stop container")

    def kill(self, container_id: str) -> None:
        import docker.errors

        self.calls.append("kill")
        if self.kill_fails:
            raise docker.errors.APIError("500 Server Error: cannot kill container")

    def remove_container(self, container_id: str, force: bool) -> None:
        self.calls.append("remove")


def test_a_container_that_will_not_stop_is_killed_then_removed():
    from types import SimpleNamespace

    from e31_prefect.host.ledger import Spec
    from e31_prefect.host.supervised_work import ContainerWork

    for kill_fails, expected in ((False, ["stop", "kill"]), (True, ["stop", "kill", "remove"])):
        engine = StubbornEngine(kill_fails)
        work = ContainerWork(Spec(run_id="r", runtime="container", stop_at=None), ["c0ffee"],
                             client=SimpleNamespace(api=engine, close=lambda: None))
        work._stop(grace_seconds=1)
        assert engine.calls == expected
