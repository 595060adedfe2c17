"""A job outlives its host: hosts lost with everything on them, hosts cut off (stopped) and back.

Two e31 hosts on this machine (each its own E31_HOST_NAME, E31_HOME and device locks) share one pool. A host
whose processes are all SIGKILLed, or whose worker and supervisors are stopped, is judged lost by the other
after E31_HOST_LOST_SECONDS (a few seconds here): the attempt it held is billed to its last heartbeat and
requeued, and runs again on the other host; what the lost host says when it comes back changes nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from datetime import datetime
from pathlib import Path
from uuid import UUID

import pytest
from prefect import get_client

from e31_prefect.host.disk import unmount_under
from e31_prefect.host.ledger import process_running
from tests.integration.conftest import Host, cli, cmdline, flow_run_id
from tests.integration.test_jobs_end_to_end import read_run, write_job
from tests.integration.test_worker_faults import until

pytestmark = pytest.mark.integration

FLOW = """
import json, os, time
from datetime import datetime, timezone
from prefect import flow
from prefect.runtime import flow_run
from e31_prefect import output_dir

@flow(retries=1)
def work(seconds: float = 3, fail_on_run: int = 0, first_seconds: float = 0) -> dict:
    out = output_dir()
    started = datetime.now(timezone.utc).isoformat()
    (out / "started.txt").write_text(started)
    if flow_run.run_count == fail_on_run:  # its own failure, which its own retry is for
        raise RuntimeError(f"failing run {fail_on_run}, as asked")
    end = time.time() + (first_seconds if first_seconds and flow_run.run_count == 1 else seconds)
    while time.time() < end:
        (out / "alive.txt").write_text(datetime.now(timezone.utc).isoformat())  # the last moment it ran
        time.sleep(0.1)
    ran = {"started": started, "ended": datetime.now(timezone.utc).isoformat(), "run_count": flow_run.run_count,
           "devices": os.environ["CUDA_VISIBLE_DEVICES"]}
    (out / "ran.json").write_text(json.dumps(ran))
    return ran
"""


def working(pid: int) -> bool:
    """Whether a process runs and is not on its way out (a killed PID namespace's init waits, exiting, for its
    stopped parent to reap the job's last process: it runs nothing of the job's)."""
    try:
        flags = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[6])
    except (OSError, IndexError, ValueError):
        return False
    return process_running(pid) and not flags & 0x4  # PF_EXITING


def submit(tmp_path: Path, pool: str, name: str, **parameters: object) -> UUID:
    job = write_job(tmp_path / name, f"""
        name: {name}
        work: {{flow: flow.py:work, parameters: {json.dumps(parameters)}}}
        request: {{gpus: 1, max_duration: 10m, deadline: +1h}}
        output: {{to: ./out/}}
        """, flow=FLOW)
    submitted = cli("e31", "submit", str(job), "--pool", pool)
    assert submitted.returncode == 0, submitted.stderr
    return flow_run_id(submitted.stdout)


def states(run_id: UUID) -> list:
    with get_client(sync_client=True) as client:
        return client.read_flow_run_states(run_id)


def meters(run_id: UUID) -> dict[str, list[dict]]:
    """Each attempt's e31-meter table (its latest version), by key."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[run_id])))
    tables: dict[str, list[dict]] = {}
    for artifact in sorted(found, key=lambda a: a.created):
        if artifact.key and artifact.key.startswith("e31-meter"):
            tables.setdefault(artifact.key, []).append(json.loads(artifact.data))
    return {key: versions for key, versions in tables.items()}


def running_on(host: Host, run_id: UUID) -> bool:
    """The run works on the host, and its hand-over is labelled (the host says so a moment after the work starts,
    in the background: a host lost before then leaves its quota slots to expire with their lease)."""
    run = read_run(run_id)
    labels = run.labels or {}
    return run.state.is_running() and labels.get("e31.host") == host.name and bool(labels.get("e31.rented")) and \
        (host.home / "workspaces" / str(run_id) / "output" / "alive.txt").exists()


def requeued(run_id: UUID) -> object:
    return next((s for s in states(run_id) if s.name == "HostLost"), None)


def completed(run_id: UUID, attempts: int = 2) -> bool:
    """The run completed and its last attempt's meter is closed (its outputs went before)."""
    return read_run(run_id).state.is_completed() and len(meters(run_id)) >= attempts


def test_a_host_lost_with_everything_on_it_costs_its_run_a_delay_not_its_night(prefect_server, tmp_path, pool,
                                                                               hosts):
    assert cli("e31", "quota", "set", "--pool", pool, "1").returncode == 0  # one GPU's slots in all
    run_id = submit(tmp_path, pool, "survivor", seconds=8, fail_on_run=2)
    a = hosts("host-a").start()
    until(lambda: running_on(a, run_id), 180, "the run starting on host A")
    b = hosts("host-b").start()
    a.lose()
    lost = until(lambda: requeued(run_id), 120, "the pool requeuing the run lost with host A")
    assert f"Host {a.name} was lost" in lost.message and "no heartbeat since" in lost.message, lost.message
    assert "Requeued as attempt 2" in lost.message, lost.message
    until(lambda: completed(run_id), 180, "the run completing on host B")
    run = read_run(run_id)
    assert run.state.is_completed(), (run.state, b.output())
    assert run.labels["e31.host"] == b.name
    # Its own retry was kept for its own failure: it failed once on host B (run 2) and completed on its retry.
    assert json.loads((tmp_path / "survivor" / "out" / "ran.json").read_text())["run_count"] == 3
    # Each attempt has its meter: the lost one billed to host A's last heartbeat, then the new one.
    tables = meters(run_id)
    assert sorted(tables) == ["e31-meter-survivor", "e31-meter-survivor-attempt-2"], tables
    assert all(len(versions) == 1 for versions in tables.values()), "an attempt's meter was recorded twice"
    first = {row["step"]: row for row in tables["e31-meter-survivor"][0]}
    heard = datetime.fromisoformat(lost.message.split("no heartbeat since ")[1].split(" ")[0])
    # Billed to the last heartbeat (named in the message to the second), or nothing if it came before the rent.
    rented, ended = (datetime.fromisoformat(first[step]["at"]) for step in ("rented", "run_ended"))
    assert abs((ended - max(heard, rented)).total_seconds()) < 1, (first, heard)
    assert "e31:attempts=2" in run.tags
    # The lost attempt's quota slots were freed with it: the new one never waited for them.
    history = [(s.timestamp.isoformat(), s.name, s.message) for s in states(run_id)]
    assert not [s for s in history if s[2] and "Quota full" in s[2]], history

    # Host A comes back with its E31_HOME: its worker adopts what its ledger held, and says nothing of it.
    a.start()
    until(lambda: not (a.home / "ledger" / str(run_id)).exists(), 120, "host A letting its lost attempt go")
    a.stop()
    assert read_run(run_id).state.is_completed()
    assert sorted(meters(run_id)) == sorted(tables) and all(len(v) == 1 for v in meters(run_id).values())
    assert (a.home / "spool" / "superseded" / f"{run_id}-attempt-1" / "outputs" / "alive.txt").exists(), \
        "the lost attempt's outputs are kept in its host's spool"


def test_a_host_that_comes_back_wiped_ends_the_runs_it_held_at_once(prefect_server, tmp_path, pool, hosts):
    # Long enough to be seen working on a loaded machine: the test looks for it between its hand-over's label
    # and its end (4 s left that window shut, once in a few runs under load).
    run_id = submit(tmp_path, pool, "wiped", seconds=12)
    a = hosts("host-a").start()
    until(lambda: running_on(a, run_id), 180, "the run starting on host A")
    a.lose()
    unmount_under(a.home)  # a host that starts again mounts nothing of what it had
    shutil.rmtree(a.home)
    a.start()  # alone in the pool, at once: its heartbeat never stops long enough for it to be judged lost
    lost = until(lambda: requeued(run_id), 120, "host A ending the run its wiped ledger forgot")
    assert "E31_HOME wiped" in lost.message, lost.message
    until(lambda: completed(run_id), 180, "the run completing on host A again")
    assert sorted(meters(run_id)) == ["e31-meter-wiped", "e31-meter-wiped-attempt-2"]


def test_a_cut_off_host_stops_its_work_before_the_pool_runs_it_elsewhere(prefect_server, tmp_path, pool, hosts):
    run_id = submit(tmp_path, pool, "partitioned", seconds=10)
    a = hosts("host-a").start()
    until(lambda: running_on(a, run_id), 180, "the run starting on host A")
    b = hosts("host-b").start()
    stopped = [a.worker.pid, *a.supervisors()]
    # The job's processes and their launcher; not the host's warm interpreter, which runs nothing of a job.
    job = [pid for pid in a.processes() if pid not in stopped and b"fence" not in cmdline(pid)
           and b"e31_prefect.host.warm_interpreter" not in cmdline(pid)]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)  # a host that stops answering; its jobs' processes go on
    try:
        try:
            until(lambda: not any(working(pid) for pid in job), 60, "host A's fence stopping the work")
        except AssertionError:
            left = {pid: cmdline(pid).replace(b"\0", b" ")[:200] for pid in job if working(pid)}
            raise AssertionError(f"host A's fence left {left} running; stopped {stopped}") from None
        until(lambda: requeued(run_id), 120, "the pool requeuing the run of host A")
        try:
            until(lambda: completed(run_id), 180, "the run completing on host B")
        except AssertionError:
            run = read_run(run_id)
            history = [(s.timestamp, s.name, s.message) for s in states(run_id)]
            raise AssertionError(f"the run did not complete on host B: {run.state!r} {run.labels} {history} "
                                 f"{sorted(meters(run_id))}\n{b.output()}") from None
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    until(lambda: not (a.home / "ledger" / str(run_id)).exists(), 120, "host A letting its fenced attempt go")
    kept = a.home / "spool" / "superseded" / f"{run_id}-attempt-1" / "outputs"
    last_alive = datetime.fromisoformat((kept / "alive.txt").read_text())
    second_start = datetime.fromisoformat((tmp_path / "partitioned" / "out" / "started.txt").read_text())
    assert last_alive < second_start, "the run worked in two places at once"
    run = read_run(run_id)
    assert run.state.is_completed() and run.labels["e31.host"] == b.name, run.state
    assert sorted(meters(run_id)) == ["e31-meter-partitioned", "e31-meter-partitioned-attempt-2"]
    assert all(len(versions) == 1 for versions in meters(run_id).values())


def ended_and_billed(run_id: UUID) -> bool:
    run = read_run(run_id)
    return run.state.is_final() and any(t.startswith("e31:billed-s=") for t in run.tags)


def test_a_run_out_of_attempts_ends_host_lost_saying_why(prefect_server, tmp_path, pool, hosts):
    run_id = submit(tmp_path, pool, "once", seconds=600)
    a = hosts("host-a", E31_HOST_ATTEMPTS="1").start()
    until(lambda: running_on(a, run_id), 180, "the run starting on host A")
    hosts("host-b", E31_HOST_ATTEMPTS="1").start()
    a.lose()
    # Its bill's tags come just after its final state (as every run's do): waited for both.
    until(lambda: ended_and_billed(run_id), 120, "the pool ending the run and closing its meter")
    run = read_run(run_id)
    assert run.state.name == "HostLost" and run.state.is_failed(), run.state
    assert "all it may (E31_HOST_ATTEMPTS=1)" in run.state.message
    assert "e31:host-lost" in run.tags and any(t.startswith("e31:billed-s=") for t in run.tags)
