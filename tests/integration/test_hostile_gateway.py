"""A running job tries to start work, write its own bill and send the worker's events (issue 21).

Work and bills come from the worker alone: through its gateway a job cannot make a run a worker of
its pool would pick up (a subflow with a deployment, pool, queue, job variables or a schedulable state,
or a later move there), end its own run while its work goes on, tag a run or task with the worker's
``e31`` tags, write an ``e31-meter`` artifact, or send ``e31.*``, worker, pool or run-state events. What
a legitimate job does (tasks, subflows, artifacts, its own events) still reaches Prefect, and ``e31
usage`` bills the run to its own team, naming and skipping a meter that is not the worker's.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

import pytest
from prefect import get_client
from prefect.client.schemas.actions import ArtifactCreate
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterName,
    FlowRunFilterParentFlowRunId,
    FlowRunFilterTags,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.sorting import LogSort
from prefect.events.filters import EventAnyResourceFilter, EventFilter, EventNameFilter
from prefect.states import Scheduled

from e31_prefect.host.ledger import RunFolder, Spec, now
from e31_prefect.host.supervision import Supervisor as SupervisorSide
from e31_prefect.host.supervision import make_api_socket, make_hand_over_pipe, make_work_ended_pipe
from tests.integration.conftest import cli, flow_run_id
from tests.integration.test_hostile_jobs import API_CALL
from tests.integration.test_jobs_end_to_end import read_run, write_job
from tests.unit.test_life import GATE

pytestmark = pytest.mark.integration

VICTIM = "gw-victim"  # the team a job tries to bill

ATTACKER = """
import json, os, urllib.error, urllib.request
from pathlib import Path
from prefect import flow, task
from prefect.events import emit_event

@task
def step(x: int) -> int:
    return x + 1

@flow
def child() -> int:
    return step(1)

""" + API_CALL + """
@flow
def attacker(victim: str) -> int:
    me = os.environ["PREFECT__FLOW_RUN_ID"]
    seen = {}
    run = json.loads(call("GET", f"/flow_runs/{me}")[1])
    made = call("POST", "/task_runs/", {"flow_run_id": me, "name": "steal", "task_key": "steal", "dynamic_key": "0"})
    assert made[0] == 201, made
    parent = json.loads(made[1])["id"]
    sub = {"flow_id": run["flow_id"], "name": "stolen", "parent_task_run_id": parent}
    stolen = {**sub, "deployment_id": run["deployment_id"], "work_pool_name": run["work_pool_name"],
              "work_queue_name": run["work_queue_name"], "state": {"type": "SCHEDULED"},
              "parameters": {"command": ["sleep", "1"]}, "job_variables": {"team": victim}}
    seen["stolen run"] = call("POST", "/flow_runs/", stolen)
    seen["subflow with a deployment"] = call("POST", "/flow_runs/", {**sub, "deployment_id": run["deployment_id"]})
    seen["subflow in the pool"] = call("POST", "/flow_runs/", {**sub, "work_pool_name": run["work_pool_name"],
                                                             "work_queue_name": run["work_queue_name"]})
    seen["subflow with job variables"] = call("POST", "/flow_runs/", {**sub, "job_variables": {"team": victim}})
    seen["subflow scheduled"] = call("POST", "/flow_runs/", {**sub, "state": {"type": "SCHEDULED"}})
    seen["subflow with e31 tags"] = call("POST", "/flow_runs/", {**sub, "tags": ["e31", f"e31:team={victim}",
                                                                              "e31:billed-s=99999"]})
    made = call("POST", "/flow_runs/", {**sub, "name": "sub", "state": {"type": "PENDING"}})
    assert made[0] == 201, made
    child_id = json.loads(made[1])["id"]
    seen["subflow moved to Scheduled"] = call("POST", f"/flow_runs/{child_id}/set_state",
                                              {"state": {"type": "SCHEDULED"}, "force": True})
    seen["subflow given job variables"] = call("PATCH", f"/flow_runs/{child_id}", {"job_variables": {"team": victim}})
    seen["subflow given e31 tags"] = call("PATCH", f"/flow_runs/{child_id}", {"tags": ["e31", "e31:billed-s=1"]})
    seen["own run's tags"] = call("PATCH", f"/flow_runs/{me}", {"tags": ["e31", "e31:billed-s=0", "e31:gpus=0"]})
    seen["own run's job variables"] = call("PATCH", f"/flow_runs/{me}", {"job_variables": {"team": victim}})
    seen["own run's labels"] = call("PATCH", f"/flow_runs/{me}/labels", {"e31:team": victim})
    seen["own run Scheduled"] = call("POST", f"/flow_runs/{me}/set_state",
                                     {"state": {"type": "SCHEDULED"}, "force": True})
    seen["own run forced Running"] = call("POST", f"/flow_runs/{me}/set_state",
                                          {"state": {"type": "RUNNING"}, "force": True})
    seen["own run Completed while working"] = call("POST", f"/flow_runs/{me}/set_state",
                                                   {"state": {"type": "COMPLETED"}})
    seen["own run Cancelled while working"] = call("POST", f"/flow_runs/{me}/set_state",
                                                   {"state": {"type": "CANCELLED"}, "force": True})
    seen["state after"] = json.loads(call("GET", f"/flow_runs/{me}")[1])["state"]["type"]
    rows = [{"step": "total billed", "at": "", "seconds": 0}]
    seen["a meter of its own"] = call("POST", "/artifacts/", {"flow_run_id": me, "key": "e31-meter-attacker",
                                                              "type": "table", "data": json.dumps(rows)})
    seen["a malformed meter"] = call("POST", "/artifacts/", {"flow_run_id": me, "key": "e31-meter-broken",
                                                             "type": "table", "data": [1, 2]})
    made = call("POST", "/artifacts/", {"flow_run_id": me, "key": "notes", "type": "markdown", "data": "# notes"})
    assert made[0] == 201, made
    seen["an artifact re-keyed"] = call("PATCH", f"/artifacts/{json.loads(made[1])['id']}",
                                        {"key": "e31-meter-attacker", "data": json.dumps(rows)})
    seen["a task with e31 tags"] = call("POST", "/task_runs/", {"flow_run_id": me, "name": "t", "task_key": "t",
                                                                "dynamic_key": "1", "tags": [f"e31:team={victim}"]})
    own = {"prefect.resource.id": f"prefect.flow-run.{me}"}
    for name, resource, related in [
        ("e31.job.deadline-missed", {"prefect.resource.id": "e31.forged.1"}, []),
        ("prefect.work-pool.not-ready", {"prefect.resource.id": "prefect.work-pool.forged"}, []),
        ("prefect.worker.heartbeat", {"prefect.resource.id": "prefect.worker.e31.forged"}, []),
        ("e31.job.released", own, []),
        ("prefect.flow-run.Completed", own, []),
        ("hostile.role-trick", own, [{**own, "prefect.resource.role": "deployment"}]),
        ("hostile.other-deployment", own, [{"prefect.resource.id": f"prefect.deployment.{parent}",
                                             "prefect.resource.role": "deployment"}]),
    ]:
        emit_event(name, resource=resource, related=related, payload={"forged": "yes"})
    seen["child"] = child()
    emit_event("hostile.marker", resource=own)  # its own event about its own run: it passes
    Path(os.environ["E31_OUTPUT_DIR"], "seen.json").write_text(json.dumps(seen))
    return step(41)
"""

FORGED_EVENTS = ["e31.job.deadline-missed", "prefect.work-pool.not-ready", "prefect.worker.heartbeat",
                 "e31.job.released", "prefect.flow-run.Completed", "hostile.role-trick", "hostile.other-deployment"]


def events_about(run_id: UUID, names: list[str]) -> list:
    with get_client(sync_client=True) as client:
        return client.read_events(filter=EventFilter(
            event=EventNameFilter(name=names),
            any_resource=EventAnyResourceFilter(id=[f"prefect.flow-run.{run_id}"])), limit=50).events


@pytest.mark.parametrize("runtime", ["process", "container"])
def test_a_job_cannot_start_work_write_its_bill_or_send_the_workers_events(runtime, prefect_server, tmp_path, pool,
                                                                           request):
    image = f", image: {request.getfixturevalue('job_image')}" if runtime == "container" else ""
    team = f"gw-attacker-{runtime}"
    job = write_job(tmp_path / "attacker", f"""
        name: attacker
        team: {team}
        work: {{flow: flow.py:attacker{image}, parameters: {{victim: {VICTIM}}}}}
        request: {{gpus: 1, max_duration: 5m}}
        output: {{to: ./out/, expect: [seen.json]}}
        """, flow=ATTACKER)
    result = cli("e31", "run", str(job), "--pool", pool, gpus="1xH100", timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    run_id = flow_run_id(result.stdout)
    seen = json.loads((tmp_path / "attacker" / "out" / "seen.json").read_text())

    # Each attack was refused, saying why; every one that got through is listed at the end.
    got_through = [f"{attack}: {answer[0]}" for attack, answer in seen.items()
                   if attack not in ("state after", "child") and answer[0] != 403]
    if seen["state after"] != "RUNNING":
        got_through.append(f"the job made its own run {seen['state after']} while its work went on")

    # No run for a worker exists, nor any bill but the worker's: its run is billed to its own team.
    run = read_run(run_id)
    assert run.state.is_completed(), run.state
    if "e31:billed-s=0" in run.tags or any(t.startswith("e31:team=") and t != f"e31:team={team}"
                                           for t in run.tags):
        got_through.append(f"its run's tags: {run.tags}")
    with get_client(sync_client=True) as client:
        stolen = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["stolen"])))
        billed_to_victim = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[f"e31:team={VICTIM}"])))
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run_id])))
    got_through += [f"a run {r.name} in {r.work_pool_name}, {r.state_name}, job variables {r.job_variables}"
                    for r in stolen]
    got_through += [f"a run tagged for {VICTIM}: {r.name}" for r in billed_to_victim]
    got_through += [f"its subflow {c.name}: {c.state_name}, tags {c.tags}" for c in children
                    if c.name == "sub" and c.state_type.value != "PENDING" or any(t.startswith("e31") for t in c.tags)]
    report = cli("e31", "usage", "--by", "team", "--format", "json")
    assert report.returncode == 0, report.stderr
    totals = {row["team"]: row for row in json.loads(report.stdout)}
    if totals.get(team, {}).get("gpu_hours_billed", 0) <= 0 or VICTIM in totals:
        got_through.append(f"e31 usage billed: {totals.get(team)}, {VICTIM}: {totals.get(VICTIM)}")

    # Its own event arrived; none of the forged ones did (events on one websocket arrive in order).
    deadline = time.monotonic() + 60
    while not events_about(run_id, ["hostile.marker"]) and time.monotonic() < deadline:
        time.sleep(1)
    assert events_about(run_id, ["hostile.marker"]), "the job's own event never arrived"
    got_through += [f"the event {e.event}" for e in events_about(run_id, FORGED_EVENTS) if e.payload.get("forged")]
    assert got_through == [], "got through:\n" + "\n".join(got_through)
    assert "ends" in seen["own run Completed while working"][1]


def test_e31_usage_names_and_skips_a_malformed_meter(prefect_server, tmp_path):
    """A meter artifact with its data a JSON list of numbers (as a job could write before its gateway
    refused e31-* keys) does not crash `e31 usage` for everyone: the run is named and skipped."""
    from prefect import flow

    @flow(name="gw-malformed-meter")
    def nothing() -> None:
        return None

    with get_client(sync_client=True) as client:
        broken = client.create_flow_run(nothing, name="gw-broken-meter", state=Scheduled(),
                                        tags=["e31", "e31:gpus=1", "e31:billed-s=5", "e31:team=gw-broken"])
        client.create_artifact(ArtifactCreate(key="e31-meter-broken", type="table", data=[1, 2],
                                              flow_run_id=broken.id))
        whole = client.create_flow_run(nothing, name="gw-whole-meter", state=Scheduled(),
                                       tags=["e31", "e31:gpus=2", "e31:billed-s=1800", "e31:team=gw-whole"])
        client.create_artifact(ArtifactCreate(key="e31-meter-whole", type="table", flow_run_id=whole.id,
                                              data=json.dumps([{"step": "total billed", "at": "", "seconds": 1800}])))
    report = cli("e31", "usage", "--by", "team", "--format", "json")
    assert report.returncode == 0, report.stderr
    assert str(broken.id) in report.stderr and "not a list of rows" in report.stderr
    totals = {row["team"]: row for row in json.loads(report.stdout)}
    assert "gw-broken" not in totals
    assert totals["gw-whole"]["gpu_hours_billed"] == pytest.approx(1.0)


FLAKY = """
import os
from pathlib import Path
from prefect import flow

@flow(retries=1, retry_delay_seconds=0)
def flaky() -> int:
    tried = Path(os.environ["E31_OUTPUT_DIR"], "tried")
    if not tried.exists():
        tried.write_text("once")
        raise RuntimeError("the first try fails")
    return 7
"""


def test_a_flow_with_retries_still_retries_through_its_gateway(prefect_server, tmp_path, pool):
    """Its first Failed comes before its work ends: the gateway lets it pass, as the server answers it
    with a retry (AwaitingRetry), not an end."""
    job = write_job(tmp_path / "flaky", """
        name: flaky
        work: {flow: flow.py:flaky}
        request: {gpus: 0, max_duration: 5m}
        output: {to: ./out/}
        """, flow=FLAKY)
    result = cli("e31", "run", str(job), "--pool", pool)
    assert result.returncode == 0, result.stdout + result.stderr
    run = read_run(flow_run_id(result.stdout))
    assert run.state.is_completed(), run.state
    assert run.run_count == 2


# Issue 31: a gateway no job can exhaust. The gateway runs in the run's supervisor, outside the job's memory
# limit: whatever a job sends it, the supervisor stays under 64 MiB, and the server's log gains no traceback.
SUPERVISOR_RSS_BOUND = 64 * 2**20
GUARD_BYTES = 3 * 2**30  # the supervisor's address space in these tests: a gateway without bounds fails here, not
# the machine (on b913ffd these attacks took it from 25 MB to between 0.4 and 2.5 GB)

WORK = r'''
import base64, json, os, socket, struct, sys, threading, time
from pathlib import Path

PATH, RUN, MiB = os.environ["API_SOCKET"], os.environ["RUN_ID"], 2**20


def connect():
    client = socket.socket(socket.AF_UNIX)
    client.connect(PATH)
    return client


def status(client):
    """The status the gateway answered (0: none, the connection ended)."""
    client.settimeout(120)
    try:
        line = client.makefile("rb").readline()
    except OSError:
        return 0
    return int(line.split()[1]) if line.startswith(b"HTTP/") else 0


def call(method, route, chunks=(), length=0):
    client = connect()
    try:
        client.sendall(f"{method} /api{route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {length}\r\n\r\n".encode())
        for chunk in chunks:
            client.sendall(chunk)
    except OSError:
        pass
    answered = status(client)
    client.close()
    return answered


def body(size, item, head=b"[", tail=b"]"):
    """(chunks, length): head item,item,... tail, about size bytes, made 1 MiB at a time."""
    block = (item + b",") * max(1, MiB // (len(item) + 1))
    blocks = max(1, (size - len(head) - len(tail)) // len(block))
    chunks = [head] + [block] * (blocks - 1) + [block[:-1], tail]
    return chunks, sum(map(len, chunks))


def together(count, one):
    answers = [None] * count
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, one(i))) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def small_keys(size):
    """(chunks, length): one object of distinct small keys in a list, under ``size`` bytes."""
    per = MiB // 14
    chunks = [b"[{"] + [b"".join(b'"k%d_%d":0,' % (i, j) for j in range(per)) for i in range(size // MiB)]
    chunks.append(b'"end":0}]')
    return chunks, sum(map(len, chunks))


def frame(opcode, payload, size=None):
    size = len(payload) if size is None else size
    head = bytes([0x80 | opcode]) + (bytes([0x80 | size]) if size < 126 else bytes([0xFF]) + struct.pack("!Q", size))
    return head + b"\0\0\0\0" + payload  # a zero mask


def websocket():
    client = connect()
    key = base64.b64encode(os.urandom(16)).decode()
    client.sendall(f"GET /api/events/in HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: prefect\r\n"
                   "\r\n".encode())
    reader = client.makefile("rb")
    while reader.readline() not in (b"\r\n", b""):
        pass
    client.sendall(frame(0x1, b'{"type": "auth", "token": null}'))
    return client, reader


EMPTY_OBJECTS = b"[" + b"{}," * (16 * MiB // 3 - 1) + b"{}]"


def huge_frame(i):
    client, reader = websocket()
    try:
        client.sendall(frame(0x1, b"", size=len(EMPTY_OBJECTS)))
        for at in range(0, len(EMPTY_OBJECTS), MiB):
            client.sendall(EMPTY_OBJECTS[at:at + MiB])
    except OSError:
        pass
    client.settimeout(60)
    seen = b""
    try:
        while more := reader.read1(65536):
            seen += more
    except OSError:
        pass
    return "closed 1009" if b"\x88" in seen and b"\x03\xf1" in seen else f"{len(seen)} bytes back"


held = []


def half_bodies(i):
    client = connect()
    held.append(client)
    try:
        client.sendall(f"POST /api/logs/ HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {8 * MiB}\r\n\r\n".encode() + b"[" + b" " * (4 * MiB))
    except OSError:
        return status(client)
    return "half sent"


def heads(i):
    client = connect()
    held.append(client)
    try:
        client.sendall(b"POST /api/logs/ HTTP/1.1\r\nHost: x\r\n" + (b"X-Pad: " + b"p" * 65526 + b"\r\n") * 98)
    except OSError:
        return status(client) or "closed"
    return "sent"


OTHERS = b'{"flow_run_id": "43835668-28ca-4623-ab0f-9b7619d5d5a5", "message": "' + b"m" * 200 + b'"}'


def each_of_64(chunks, length):
    """The same body (8 MiB at most: what /logs/ takes) on 64 connections at once."""
    return together(64, lambda i: call("POST", "/logs/", chunks, length))


ATTACKS = {
    "one refused 16 MiB body": lambda: [call("POST", "/logs/", *body(16 * MiB, OTHERS))],
    "64 connections x 64 MiB": lambda: together(64, lambda i: call("POST", "/logs/", *body(64 * MiB, OTHERS))),
    "64 x 8 MiB nested deep": lambda: each_of_64([b"[" * (4 * MiB), b"]" * (4 * MiB)], 8 * MiB),
    "64 x 8 MiB of small keys": lambda: each_of_64(*small_keys(8 * MiB)),
    "64 x 8 MiB of empty objects": lambda: each_of_64(*body(8 * MiB, b"{}")),
    "64 slow heads of 6 MiB": lambda: together(64, heads),
    "64 half-sent 8 MiB bodies": lambda: together(64, half_bodies),
    "64 websockets x 16 MiB frames": lambda: together(64, huge_frame),
}
answers = ATTACKS[sys.argv[1]]()
seen = {"answers": answers, "health": call("GET", "/health"), "own run": call("GET", f"/flow_runs/{RUN}")}
Path("seen.json").write_text(json.dumps(seen))
Path("attacked").touch()
while not Path("measured").exists():  # the test reads the supervisor's peak while the attack's sockets are open
    time.sleep(0.1)
'''


def supervise(folder: Path, run_id: UUID, script: str, *args: str) -> subprocess.Popen:
    """A run's real supervisor, started as a worker starts one (its control socket, its API gateway's socket,
    forwarding to the test's Prefect server), whose work runs ``script`` once handed its devices. Under
    :data:`GUARD_BYTES` of address space."""
    folder.mkdir(parents=True, exist_ok=True)
    run = RunFolder(folder)
    make_work_ended_pipe(run)
    make_hand_over_pipe(run)
    listening = make_api_socket(run)
    run.write_spec(Spec(
        # No cgroup: what is measured is the supervisor, and runs of other test sessions on the host share e31's.
        run_id=str(run_id), runtime="process", stop_at=None, grace_seconds=1.0, cwd=str(folder), cgroups=False,
        argv=[sys.executable, "-c", GATE + script, *args],
        env={"PATH": os.environ["PATH"], "E31_WORK_ENDED": str(run.work_ended_pipe),
             "E31_HAND_OVER": str(run.hand_over_pipe), "API_SOCKET": str(run.api_socket), "RUN_ID": str(run_id)},
        api_upstream=os.environ["PREFECT_API_URL"], api_socket_fd=listening.fileno()))
    ours, theirs = socket.socketpair()
    process = subprocess.Popen(
        [sys.executable, "-m", "e31_prefect.supervisor", str(folder)], start_new_session=True, stdin=theirs,
        pass_fds=(listening.fileno(),), stderr=(folder / "supervisor.err").open("wb"),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (GUARD_BYTES, GUARD_BYTES)))
    theirs.close()
    listening.close()
    SupervisorSide(run, None, ours).hand_over({}, None, now(), ())
    return process


def peak_rss(pid: int) -> int:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(status["VmHWM"].split()[0]) * 1024


def a_flow_run() -> UUID:
    from prefect import flow

    @flow(name="gw-exhaust")
    def nothing() -> None:
        return None

    with get_client(sync_client=True) as client:
        return client.create_flow_run(nothing, name="gw-exhaust").id


def until(check, what: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.2)
    return value


@pytest.mark.parametrize("attack", ["one refused 16 MiB body", "64 connections x 64 MiB", "64 x 8 MiB nested deep",
                                    "64 x 8 MiB of small keys", "64 x 8 MiB of empty objects",
                                    "64 slow heads of 6 MiB", "64 half-sent 8 MiB bodies",
                                    "64 websockets x 16 MiB frames"])
def test_nothing_a_job_sends_its_gateway_takes_its_supervisor_past_64_mib(attack, prefect_server, tmp_path):
    run_id = a_flow_run()
    folder = tmp_path / str(run_id)
    supervisor = supervise(folder, run_id, WORK, attack)
    until(lambda: (folder / "attacked").exists() or supervisor.poll() is not None, "the attack")
    peak = peak_rss(supervisor.pid) if supervisor.poll() is None else None
    (folder / "measured").touch()
    supervisor.wait(timeout=120)
    seen = json.loads((folder / "seen.json").read_text())
    assert peak is not None and peak <= SUPERVISOR_RSS_BOUND, f"{attack}: the supervisor peaked at {peak} bytes"
    passed = [answer for answer in seen["answers"] if answer in (200, 201)]
    assert passed == [], f"{attack}: passed to the server: {passed}"
    assert (seen["health"], seen["own run"]) == (200, 200), f"{attack}: the gateway no longer serves the job: {seen}"


BAD_FRAMES = r'''
import base64, json, os, socket, struct, sys, uuid
from datetime import datetime, timezone
from pathlib import Path

PATH, RUN = os.environ["API_SOCKET"], os.environ["RUN_ID"]


def frame(opcode, payload, fin=True, rsv=0):
    head = bytes([(0x80 if fin else 0) | rsv | opcode])
    size = len(payload)
    head += bytes([0x80 | size]) if size < 126 else bytes([0x80 | 126]) + struct.pack("!H", size)
    return head + b"\0\0\0\0" + payload


def events_in(protocol=True):
    client = socket.socket(socket.AF_UNIX)
    client.connect(PATH)
    key = base64.b64encode(os.urandom(16)).decode()
    client.sendall(f"GET /api/events/in HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n".encode()
                   + (b"Sec-WebSocket-Protocol: prefect\r\n" if protocol else b"") + b"\r\n")
    reader = client.makefile("rb")
    answered = reader.readline()
    while reader.readline() not in (b"\r\n", b""):
        pass
    return client, reader, int(answered.split()[1])


def authenticated():
    """An events websocket past Prefect's auth handshake, as Prefect's client has it."""
    client, reader, answered = events_in()
    client.sendall(frame(0x1, AUTH))
    head = reader.read(2)
    assert b"auth_success" in reader.read(head[1] & 0x7F), "no auth_success"
    return client, reader


def ended(client, reader):
    """The close code the job got (0: none), once the connection is gone."""
    client.settimeout(60)
    seen = b""
    try:
        while more := reader.read1(65536):
            seen += more
    except OSError:
        pass
    at = seen.find(b"\x88")
    return struct.unpack("!H", seen[at + 2:at + 4])[0] if at >= 0 and len(seen) >= at + 4 else 0


def event(**changed):
    own = {"occurred": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z"), "event": "hostile.frames",
           "resource": {"prefect.resource.id": f"prefect.flow-run.{RUN}"}, "related": [], "payload": {},
           "id": str(uuid.uuid4()), "follows": None}
    return json.dumps({k: v for k, v in {**own, **changed}.items() if v != "leave out"}).encode()


AUTH = b'{"type": "auth", "token": null}'
BAD = {
    "binary": frame(0x2, b'{"type": "auth"}'),
    "reserved opcode 0x3": frame(0x3, b"x"),
    "reserved opcode 0xb": frame(0xB, b"x"),
    "continuation": frame(0x0, b"x"),
    "fragmented text": frame(0x1, event()[:10], fin=False),
    "fragmented ping": frame(0x9, b"x", fin=False),
    "ping of 126 bytes": frame(0x9, b"x" * 126),
    "pong of 200 bytes": frame(0xA, b"x" * 200),
    "compressed text": frame(0x1, event(), rsv=0x40),
    "text not UTF-8": frame(0x1, b'{"event": "\xff"}'),
    "close of 1 byte": frame(0x8, b"\x03"),
    "close code 1005": frame(0x8, b"\x03\xed"),
    "an event without its id": frame(0x1, event(id="leave out")),
    "an event of another time": frame(0x1, event(occurred="not a time")),
    "a second auth message": frame(0x1, AUTH),
    "a list": frame(0x1, b"[]"),
}
codes = {}
for name, bad in BAD.items():
    client, reader = authenticated()
    try:
        client.sendall(bad)
        client.sendall(frame(0x8, b"\x03\xe8"))
    except OSError:
        pass
    codes[name] = ended(client, reader)
client, reader, answered = events_in(protocol=False)  # the server would read its auth message as an event
if answered == 101:
    client.sendall(frame(0x1, AUTH))
    ended(client, reader)
codes["no prefect subprotocol"] = answered
client, reader = authenticated()  # its own event, well formed: it arrives
client.sendall(frame(0x1, event(event="hostile.frames-done")) + frame(0x8, b"\x03\xe8"))
codes["own event"] = ended(client, reader)
Path("codes.json").write_text(json.dumps(codes))
'''


def test_a_jobs_bad_websocket_frames_never_reach_the_server_nor_its_log(prefect_server, tmp_path):
    """Each of these, passed to the server, ends the job's socket with about 90 lines of traceback in the
    server's log (on b913ffd: binary frames, the auth message without Prefect's subprotocol, an event the
    server's model rejects, a second auth message): a job could flood the operator's log."""
    log = Path(os.environ["PREFECT_HOME"]).parent / "server.log"
    before = log.read_text(errors="replace").count("Traceback")
    run_id = a_flow_run()
    folder = tmp_path / str(run_id)
    supervisor = supervise(folder, run_id, BAD_FRAMES)
    supervisor.wait(timeout=300)
    codes = json.loads((folder / "codes.json").read_text())
    until(lambda: events_about(run_id, ["hostile.frames-done"]), "the job's own event arriving", 60)
    assert events_about(run_id, ["hostile.frames"]) == [], "a malformed event reached the server"
    new_tracebacks = log.read_text(errors="replace").count("Traceback") - before
    unjudged = {name: code for name, code in codes.items()
                if code != {"no prefect subprotocol": 403, "own event": 1000}.get(name, 1000 if name.startswith(
                    ("an event", "a second", "a list", "close")) else 1003)}
    assert unjudged == {} and new_tracebacks == 0, (unjudged, f"{new_tracebacks} tracebacks in the server's log")


BIGGEST = """
import os
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.events import emit_event

@task
def square(x: int) -> int:
    return x * x

@flow
def child(values: list) -> int:
    return len(values)

@flow
def biggest() -> int:
    logger = get_run_logger()
    for i in range(12_000):  # 12 MB of log lines at once: batches of 4,000,000 bytes, the engine's biggest
        logger.info("line %05d %s", i, "x" * 1000)
    logger.info("long %s", "y" * 990_000)  # a line of the engine's biggest, 1,000,000 bytes with its fields
    create_markdown_artifact("#" + "z" * (6 * 2**20), key="big-report")
    run = os.environ["PREFECT__FLOW_RUN_ID"]
    emit_event("biggest.payload", resource={"prefect.resource.id": f"prefect.flow-run.{run}"},
               payload={"blob": "p" * 1_400_000})  # the client sends none over 1,500,000 bytes
    squares = square.map(range(200)).result()
    return child(list(range(70_000))) + sum(squares)  # a subflow with 400 kB of parameters (the server: 512 KiB)
"""


def test_what_prefects_engine_sends_at_its_biggest_still_passes(prefect_server, tmp_path, pool):
    """The caps on bodies and messages leave room for the engine's biggest: log batches of 4,000,000 bytes and
    a log line of 1,000,000, an artifact of 6 MiB, an event of 1.4 MB, a subflow's 400 kB of parameters."""
    job = write_job(tmp_path / "biggest", """
        name: biggest
        work: {flow: flow.py:biggest}
        request: {gpus: 0, max_duration: 5m}
        output: {to: ./out/}
        """, flow=BIGGEST)
    result = cli("e31", "run", str(job), "--pool", pool, timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    run_id = flow_run_id(result.stdout)
    run = read_run(run_id)
    assert run.state.is_completed(), run.state
    with get_client(sync_client=True) as client:
        lines: list[str] = []
        while page := client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])),
                                       sort=LogSort.TIMESTAMP_ASC, limit=200, offset=len(lines)):
            lines += [log.message[:10] for log in page]
        report = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["big-report"]), flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run_id])))
    assert sum(line.startswith("line ") for line in lines) == 12_000 and "long yyyyy" in lines
    assert [len(artifact.data) for artifact in report] == [6 * 2**20 + 1]
    assert [child.state.is_completed() for child in children] == [True]
    event = until(lambda: events_about(run_id, ["biggest.payload"]), "the job's biggest event arriving", 60)
    assert len(event[0].payload["blob"]) == 1_400_000
