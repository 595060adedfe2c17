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
import time
from uuid import UUID

import pytest
from prefect import get_client
from prefect.client.schemas.actions import ArtifactCreate
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterName,
    FlowRunFilterParentFlowRunId,
    FlowRunFilterTags,
)
from prefect.events.filters import EventAnyResourceFilter, EventFilter, EventNameFilter
from prefect.states import Scheduled

from tests.integration.conftest import cli, flow_run_id
from tests.integration.test_hostile_jobs import API_CALL
from tests.integration.test_jobs_end_to_end import read_run, write_job

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
