"""The gateway's rules: which Prefect calls and events a running job's own flow run may make."""

from __future__ import annotations

import contextlib
import io
import json
import threading
import tracemalloc
from copy import deepcopy
from uuid import uuid4

import pytest

from e31_prefect.host import gateway
from e31_prefect.host.gateway_bodies import KEPT_BYTES, WHOLE, BodyRefused, Budget, read_json
from e31_prefect.host.gateway_rules import (
    LOCAL_ANSWERS,
    MESSAGE_READS,
    Owned,
    answer_reads,
    event_for_job,
    event_from_job,
    learn,
    refusal,
    route_for,
)
from e31_prefect.host.sandbox import View, plan_view
from e31_prefect.host.websocket_frames import (
    CLOSE,
    MAX_MESSAGE_BYTES,
    TEXT,
    Frame,
    FrameError,
    encode,
    read_frame,
    valid_close,
)

# Fixed ids: the cases below are parameters, and parallel test processes must collect the same ones.
RUN, OTHER, TASK = "28f7dc00-2d45-4dfd-a501-64c8a03c143f", "43835668-28ca-4623-ab0f-9b7619d5d5a5", \
    "9bd577a1-3a8c-42f9-a1d2-917af524c465"


def owned() -> Owned:
    return Owned(flow_runs={RUN}, task_runs={TASK})


def judge() -> gateway.Gateway:
    """A gateway with no socket: its judgement of calls and messages only."""
    made = gateway.Gateway.__new__(gateway.Gateway)
    made.token, made.owned, made.refused, made.refusals = None, owned(), [], 0
    return made


PASSING = [
    ("GET", "/health", None),
    ("GET", "/admin/version", None),
    ("GET", f"/flow_runs/{RUN}", None),
    ("GET", f"/flow_runs/{RUN.upper()}", None),
    ("POST", f"/flow_runs/{RUN}/set_state", {"state": {"type": "RUNNING"}}),
    ("PATCH", f"/flow_runs/{RUN}", {"name": "renamed"}),
    ("POST", "/task_runs/", {"flow_run_id": RUN, "name": "t"}),
    ("POST", f"/task_runs/{TASK}/set_state", {}),
    ("POST", "/flow_runs/", {"parent_task_run_id": TASK, "name": "child"}),
    ("POST", "/flow_runs/filter", {"flow_runs": {"parent_task_run_id": {"any_": [TASK]}}, "limit": 1}),
    ("POST", "/flow_runs/filter", {"flow_runs": {"id": {"any_": [RUN]}, "state": {"type": {"any_": ["PAUSED"]}}}}),
    ("POST", "/logs/", [{"flow_run_id": RUN, "task_run_id": str(uuid4()), "message": "from a task"}]),
    ("POST", "/artifacts/", {"flow_run_id": RUN, "key": "k", "data": "x"}),
    ("GET", "/events/in", None),
]


@pytest.mark.parametrize(("method", "route", "body"), PASSING)
def test_the_calls_of_its_own_flow_run_pass(method, route, body):
    assert refusal(method, route, body, owned()) is None


REFUSED = [
    ("POST", "/block_documents/filter", {"include_secrets": True}, "not a call"),
    ("GET", f"/block_documents/{RUN}", None, "not a call"),
    ("GET", "/block_types/slug/secret/block_documents/name/x", None, "not a call"),
    ("POST", "/variables/filter", {}, "not a call"),
    ("GET", "/variables/name/token", None, "not a call"),
    ("POST", "/work_pools/filter", {}, "not a call"),
    ("POST", "/v2/concurrency_limits/decrement", {"names": ["e31-pool"]}, "not a call"),
    ("GET", f"/flow_runs/{OTHER}", None, "not this job's own"),
    ("POST", f"/flow_runs/{OTHER}/set_state", {}, "not this job's own"),
    ("DELETE", f"/flow_runs/{RUN}", None, "not a call"),
    ("POST", "/task_runs/", {"flow_run_id": OTHER}, "not this job's own"),
    ("POST", "/flow_runs/", {"parent_task_run_id": str(uuid4())}, "not this job's own"),
    ("POST", "/flow_runs/filter", {}, "not this job's own"),
    ("POST", "/flow_runs/filter", {"flow_runs": {"id": {"any_": [RUN, OTHER]}}}, "not this job's own"),
    ("POST", "/flow_runs/filter", {"flow_runs": {"operator": "or_", "id": {"any_": [RUN]},
                                                  "name": {"like_": ""}}}, "not this job's own"),
    ("POST", "/flow_runs/filter", {"flow_runs": {"id": {"any_": [RUN]}}, "deployments": {"id": {"any_": []}}},
     "not this job's own"),
    ("POST", "/logs/", [{"flow_run_id": RUN}, {"flow_run_id": OTHER}], "not this job's own"),
    ("POST", "/logs/", [], "not this job's own"),
    ("POST", "/artifacts/", {"key": "no-run"}, "not this job's own"),
    ("GET", "/deployments/44d43d78-2225-4b4b-9f71-4dcc207e279a", None, "not this job's own"),
]


def test_the_servers_default_result_storage_is_never_the_jobs():
    # A job keeps its result with its outputs; a block the server names would be read through calls it may not
    # make (its credentials), so its engine is told there is none, by the gateway itself.
    assert LOCAL_ANSWERS[("GET", "/admin/storage")] == {"default_result_storage_block_id": None}
    assert route_for("GET", "/admin/storage") is None, "never passed on to the server"


@pytest.mark.parametrize(("method", "route", "body", "why"), REFUSED)
def test_everything_else_is_refused_saying_why(method, route, body, why):
    assert why in (refusal(method, route, body, owned()) or "passed")


def test_what_a_job_creates_or_reads_of_its_own_becomes_its_own():
    mine = owned()
    deployment, queue, child, task, artifact = (str(uuid4()) for _ in range(5))
    learn("GET", f"/flow_runs/{RUN}", {"id": RUN, "deployment_id": deployment, "work_queue_id": queue,
                                        "work_pool_name": "GPU Pool"}, mine)
    learn("POST", "/task_runs/", {"id": task}, mine)
    learn("POST", "/flow_runs/", {"id": child, "parent_task_run_id": task}, mine)
    learn("POST", "/artifacts/", {"id": artifact}, mine)
    assert refusal("GET", f"/deployments/{deployment}", None, mine) is None
    assert refusal("GET", f"/work_queues/{queue}", None, mine) is None
    assert refusal("GET", "/work_pools/GPU%20Pool", None, mine) is None
    assert refusal("GET", "/work_pools/other-pool", None, mine) is not None
    assert refusal("POST", f"/task_runs/{task}/set_state", {}, mine) is None
    assert refusal("POST", f"/flow_runs/{child}/set_state", {"state": {"type": "RUNNING"}}, mine) is None
    assert refusal("PATCH", f"/artifacts/{artifact}", {}, mine) is None


def test_events_a_job_sends_name_no_run_but_its_own():
    mine = owned()
    task = str(uuid4())
    own = {"event": "prefect.task-run.Completed", "resource": {"prefect.resource.id": f"prefect.task-run.{task}"},
           "related": [{"prefect.resource.id": f"prefect.flow-run.{RUN}", "prefect.resource.role": "flow-run"}]}
    forged = {"event": "prefect.flow-run.Completed", "resource": {"prefect.resource.id": f"prefect.flow-run.{OTHER}"}}
    custom = {"event": "model.saved", "resource": {"prefect.resource.id": f"prefect.flow-run.{RUN}"}}
    assert event_from_job(own, mine) and task in mine.task_runs  # its task runs become its own
    assert not event_from_job(forged, mine)
    assert not event_from_job({**own, "related": [*own["related"], forged["resource"]]}, mine)
    assert event_from_job(custom, mine)
    assert not event_from_job("not an event", mine)


def test_a_subscription_brings_the_job_only_its_own_runs_events():
    mine = owned()
    own = {"event": "prefect.flow-run.Cancelling", "resource": {"prefect.resource.id": f"prefect.flow-run.{RUN}"}}
    other = {"event": "prefect.flow-run.Cancelling", "resource": {"prefect.resource.id": f"prefect.flow-run.{OTHER}"}}
    assert event_for_job(own, mine)
    assert not event_for_job(other, mine)
    assert not event_for_job({"event": "prefect.deployment.updated",
                              "resource": {"prefect.resource.id": "prefect.deployment.1"}}, mine)


def test_the_gateway_gives_the_auth_message_the_workers_token_and_drops_forged_events():
    door = judge()
    door.token = "the-worker-token"
    assert json.loads(door.from_job("/events/in", '{"type": "auth", "token": null}', 0)) == {
        "type": "auth", "token": "the-worker-token"}
    forged = json.dumps({**EVENT, "resource": {"prefect.resource.id": f"prefect.flow-run.{OTHER}"}})
    assert door.from_job("/events/in", forged, 1) is None and door.refused
    own = json.dumps(EVENT)
    assert door.from_job("/events/in", own, 1) == own
    other = json.dumps({"type": "event", "event": json.loads(forged)})
    assert door.to_job("/events/out", other) is None
    assert door.to_job("/events/out", '{"type": "auth_success"}') == '{"type": "auth_success"}'


# An event as Prefect's engine sends it: what the server's model needs, about the job's own run.
EVENT = {"occurred": "2026-01-31T12:00:00.123456Z", "event": "model.saved",
         "resource": {"prefect.resource.id": f"prefect.flow-run.{RUN}"}, "related": [], "payload": {},
         "id": "01a24e4c-1479-7664-9531-cd41d645dbaf", "follows": None}


@pytest.mark.parametrize(("message", "why"), [
    ({**EVENT, "id": None}, "UUID"),
    ({k: v for k, v in EVENT.items() if k != "id"}, "UUID"),
    ({**EVENT, "follows": "not-a-uuid"}, "UUID"),
    ({k: v for k, v in EVENT.items() if k != "occurred"}, "occurred"),
    ({**EVENT, "occurred": "2026-13-31T12:00:00Z"}, "occurred"),
    ({**EVENT, "occurred": 1769860800}, "occurred"),
    ({**EVENT, "occurred": "9999-12-31T23:59:59-23:00"}, "occurred"),
    ({**EVENT, "event": ""}, "name"),
    ({**EVENT, "event": "x" * 1025}, "name"),
    ({**EVENT, "resource": {"prefect.resource.name": "no id"}}, "prefect.resource.id"),
    ({**EVENT, "resource": {"prefect.resource.id": f"prefect.flow-run.{RUN}", "count": 1}}, "text labels"),
    ({**EVENT, "related": [{"prefect.resource.id": f"prefect.flow-run.{RUN}"}]}, "prefect.resource.role"),
    ({**EVENT, "related": None}, "related"),
    ({**EVENT, "related": [{"prefect.resource.id": f"prefect.flow-run.{RUN}", "prefect.resource.role": "flow-run"}]
      * 101}, "at most 100"),
    ({**EVENT, "payload": None}, "payload"),
    ({**EVENT, "payload": [1, 2]}, "payload"),
    ({"type": "auth", "token": None}, "auth message comes first, once"),
    ([EVENT], "an event is an object"),
])
def test_an_event_the_server_could_not_read_never_reaches_it(message, why):
    """Each would end the job's websocket with about 90 lines of traceback in the server's log."""
    door = judge()
    assert door.from_job("/events/in", json.dumps(message), 1) is None
    assert why in door.refused[-1]
    assert door.from_job("/events/in", json.dumps(EVENT), 1) is not None


def test_an_events_websocket_takes_the_auth_message_first_and_a_subscription_one_filter():
    door = judge()
    auth, subscribe = '{"type": "auth", "token": null}', '{"type": "filter", "filter": {}}'
    assert door.from_job("/events/in", json.dumps(EVENT), 0) is None  # the server would read it as the auth
    assert door.from_job("/events/out", subscribe, 0) is None
    assert door.from_job("/events/out", subscribe, 1) == subscribe
    assert door.from_job("/events/out", subscribe, 2) is None
    assert door.from_job("/events/out", auth, 2) is None
    assert door.from_job("/events/in", b"\xff\xfe not json", 1) is None


def test_auth_header_carries_a_key_or_an_auth_string():
    assert gateway.auth_header("pnu_1", None) == {"Authorization": "Bearer pnu_1"}
    assert gateway.auth_header(None, "admin:pass") == {"Authorization": "Basic YWRtaW46cGFzcw=="}
    assert gateway.auth_header(None, None) == {}


@pytest.mark.parametrize("size", [0, 5, 125, 126, 65535, 65536, 200_000])
@pytest.mark.parametrize("masked", [True, False])
def test_frames_round_trip_masked_or_not(size, masked):
    frame = Frame(TEXT, ("x" * (size - 9) + "é€😀").encode() if size >= 9 else b"x" * size)
    assert read_frame(io.BytesIO(encode(frame, masked))) == frame


def test_fragmented_or_truncated_frames_are_not_passed():
    whole = encode(Frame(TEXT, b'{"a": 1}'), masked=True)
    with pytest.raises(FrameError):
        read_frame(io.BytesIO(bytes([whole[0] & 0x7F]) + whole[1:]))  # FIN unset: a fragment
    with pytest.raises(FrameError):
        read_frame(io.BytesIO(bytes([whole[0] | 0x40]) + whole[1:]))  # RSV1: a compressed frame
    assert read_frame(io.BytesIO(whole[:-2])) is None
    assert read_frame(io.BytesIO(encode(Frame(CLOSE, b""), masked=False))) == Frame(CLOSE, b"")


def test_the_job_sees_root_only_folders_only_as_far_as_what_it_needs(tmp_path):
    closed = {tmp_path / "root", tmp_path / "root" / "deeper"}

    def passable(folder):
        return folder not in closed

    python = tmp_path / "root" / ".pyenv" / "3.11"
    code = tmp_path / "root" / "deeper" / "project"
    open_folder = tmp_path / "srv" / "venv"
    view = plan_view([python, code, python / "lib", open_folder], passable)
    assert view == View(covers=[tmp_path / "root"], shows=[python, code])
    assert plan_view([open_folder], passable) == View()


# Issue 21: work and bills come from the worker alone. Each case is an attack a running job tried.
DEPLOYMENT, QUEUE, POOL_ID = "5b0d7a62-0f0e-4a39-9a4a-3d0bd1c1c0de", "7f6c1f0e-51a4-4c55-8a43-2a9d2b6f0a11", \
    "0a3e4f55-7c1b-4d2e-9f3a-6b5c4d3e2f1a"


def known() -> Owned:
    mine = Owned(flow_runs={RUN}, task_runs={TASK}, run=RUN)
    learn("GET", f"/flow_runs/{RUN}", {"id": RUN, "deployment_id": DEPLOYMENT, "work_queue_id": QUEUE,
                                        "work_pool_name": "gpu", "tags": ["e31", "e31:team=vision"]}, mine)
    learn("GET", "/work_pools/gpu", {"id": POOL_ID, "name": "gpu"}, mine)
    return mine


def with_child() -> tuple[Owned, str]:
    mine, child = known(), str(uuid4())
    learn("POST", "/flow_runs/", {"id": child, "parent_task_run_id": TASK}, mine)
    return mine, child


SUBFLOW = {"flow_id": str(uuid4()), "name": "child", "parameters": {}, "context": {}, "tags": [],
           "parent_task_run_id": TASK, "state": {"type": "PENDING", "name": "Pending"},
           "empirical_policy": {"retries": 0, "retry_delay": 0}}


SUBFLOWS = [
    ({**SUBFLOW, "deployment_id": DEPLOYMENT}, "deployment_id"),
    ({**SUBFLOW, "work_pool_name": "gpu", "work_queue_name": "default"}, "work_pool_name, work_queue_name"),
    ({**SUBFLOW, "job_variables": {"team": "research"}}, "job_variables"),
    ({**SUBFLOW, "infrastructure_document_id": str(uuid4())}, "infrastructure_document_id"),
    ({**SUBFLOW, "state": {"type": "SCHEDULED"}}, "'SCHEDULED'"),
    ({**SUBFLOW, "state": {"type": "RUNNING"}}, "'RUNNING'"),
    ({**SUBFLOW, "tags": ["e31:billed-s=0"]}, "e31:billed-s=0"),
    ({**SUBFLOW, "tags": ["E31:team=research"]}, "E31:team=research"),
]


@pytest.mark.parametrize(("body", "why"), SUBFLOWS)
def test_a_job_cannot_create_a_subflow_a_worker_would_run_or_bill(body, why):
    assert why in (refusal("POST", "/flow_runs/", body, known()) or "passed")


def test_the_engines_own_subflow_passes():
    assert refusal("POST", "/flow_runs/", SUBFLOW, known()) is None
    assert refusal("POST", "/flow_runs/", {k: v for k, v in SUBFLOW.items() if k != "state"}, known()) is None


RUN_CHANGES = [
    ("POST", "/set_state", {"state": {"type": "SCHEDULED"}}, "'SCHEDULED'"),
    ("POST", "/set_state", {"state": {"type": "SCHEDULED"}, "force": True}, "'SCHEDULED'"),
    ("POST", "/set_state", {"state": {"type": "AWAITINGRETRY"}}, "AWAITINGRETRY"),
    ("POST", "/set_state", {"state": {"type": "RUNNING"}, "force": True}, "force=True"),
    ("POST", "/set_state", {"state": {"type": "COMPLETED"}, "force": True}, "force=True"),
    ("POST", "/set_state", {"state": {"type": "PAUSED", "state_details": {"pause_reschedule": True}}}, "suspend"),
    ("POST", "/set_state", {"state": "COMPLETED"}, "not this job's own"),
    ("PATCH", "", {"tags": ["e31", "e31:billed-s=0"]}, "not tags"),
    ("PATCH", "", {"job_variables": {"team": "research"}}, "not job_variables"),
    ("PATCH", "", {"parameters": {"command": ["mine"]}}, "not parameters"),
    ("PATCH", "", {"infrastructure_pid": "e31:host:x"}, "not infrastructure_pid"),
    ("PATCH", "/labels", {"prefect.deployment.id": DEPLOYMENT}, "prefect.deployment.id"),
]


@pytest.mark.parametrize("target", ["own", "child"])
@pytest.mark.parametrize(("method", "tail", "body", "why"), RUN_CHANGES)
def test_a_job_cannot_move_its_runs_to_a_worker_or_change_their_bill(target, method, tail, body, why):
    mine, child = with_child()
    run = RUN if target == "own" else child
    assert why in (refusal(method, f"/flow_runs/{run}{tail}", body, mine) or "passed")


def test_its_own_run_may_not_go_pending_again_but_a_subflow_may():
    mine, child = with_child()
    assert "'PENDING'" in refusal("POST", f"/flow_runs/{RUN}/set_state", {"state": {"type": "PENDING"}}, mine)
    assert refusal("POST", f"/flow_runs/{child}/set_state", {"state": {"type": "PENDING", "name": "NotReady"},
                                                             "force": True}, mine) is None


ENGINE_CALLS = [
    ("POST", "/set_state", {"state": {"type": "RUNNING"}}),
    ("POST", "/set_state", {"state": {"type": "COMPLETED"}}),
    ("POST", "/set_state", {"state": {"type": "FAILED"}, "force": False}),
    ("POST", "/set_state", {"state": {"type": "CRASHED"}, "force": True}),
    ("POST", "/set_state", {"state": {"type": "CANCELLING"}, "force": True}),
    ("POST", "/set_state", {"state": {"type": "CANCELLED"}, "force": True}),
    ("POST", "/set_state", {"state": {"type": "PAUSED", "state_details": {"pause_reschedule": False}}}),
    ("PATCH", "", {"name": "renamed"}),
    ("PATCH", "", {"flow_version": "abc", "empirical_policy": {"retries": 2, "retry_delay": 0}}),
    ("PATCH", "/labels", {"__OTEL_TRACEPARENT": "00-abc-def-01"}),
]


@pytest.mark.parametrize("target", ["own", "child"])
@pytest.mark.parametrize(("method", "tail", "body"), ENGINE_CALLS)
def test_the_engines_own_state_and_update_calls_pass(target, method, tail, body):
    mine, child = with_child()
    run = RUN if target == "own" else child
    assert refusal(method, f"/flow_runs/{run}{tail}", body, mine) is None


def test_task_runs_and_artifacts_carry_no_worker_marks():
    mine = known()
    artifact = str(uuid4())
    learn("POST", "/artifacts/", {"id": artifact}, mine)
    assert "e31:team=research" in refusal("POST", "/task_runs/", {"flow_run_id": RUN, "tags": ["e31:team=research"]},
                                          mine)
    assert refusal("POST", "/task_runs/", {"flow_run_id": RUN, "tags": ["nightly"]}, mine) is None
    for key in ("e31-meter-train", "E31-meter", "e31-outputs-x"):
        assert f"{key!r} is the worker's" in refusal("POST", "/artifacts/", {"flow_run_id": RUN, "key": key,
                                                                            "type": "table", "data": "[]"}, mine)
    assert refusal("POST", "/artifacts/", {"flow_run_id": RUN, "key": "my-table", "data": "[]"}, mine) is None
    for key in ("e31-shards", "e31-shard-failures"):  # e31's command flow reports its shards from the job
        assert refusal("POST", "/artifacts/", {"flow_run_id": RUN, "key": key, "data": "[]"}, mine) is None
    assert "key" in refusal("PATCH", f"/artifacts/{artifact}", {"key": "e31-meter-x", "data": "[]"}, mine)
    assert "flow_run_id" in refusal("PATCH", f"/artifacts/{artifact}", {"flow_run_id": OTHER}, mine)
    assert refusal("PATCH", f"/artifacts/{artifact}", {"data": "# new", "description": "d"}, mine) is None


def flow_run_event(name, related=(), **resource):
    return {"event": name, "resource": {"prefect.resource.id": f"prefect.flow-run.{RUN}", **resource},
            "related": list(related)}


def related(kind, ident, role=None):
    return {"prefect.resource.id": f"prefect.{kind}.{ident}", "prefect.resource.role": role or kind}


def context_related():
    """What Prefect's events worker adds to each event a job's engine sends (related_resources_from_run_context)."""
    return [related("flow-run", RUN), related("flow", str(uuid4())), related("deployment", DEPLOYMENT),
            related("work-queue", QUEUE), related("work-pool", POOL_ID), related("tag", "e31"),
            related("tag", "e31:team=vision")]


FORGED_EVENTS = [
    {"event": "e31.job.deadline-missed", "resource": {"prefect.resource.id": "e31.job.x"}},
    {"event": "e31.job.deadline-missed", "resource": {"prefect.resource.id": "prefect.deployment.1"}},
    {"event": "prefect.work-pool.not-ready", "resource": {"prefect.resource.id": f"prefect.work-pool.{POOL_ID}"}},
    {"event": "prefect.worker.heartbeat", "resource": {"prefect.resource.id": "prefect.worker.e31.w1"}},
    {"event": "acme.model.saved", "resource": {"prefect.resource.id": "acme.model.7"}},
    {"event": "nothing named", "resource": {}},
    flow_run_event("e31.job.released"),
    flow_run_event("E31.job.deadline-missed"),
    flow_run_event("prefect.flow-run.Completed"),
    flow_run_event("prefect.work-pool.not-ready"),
    flow_run_event("prefect.worker.heartbeat"),
    flow_run_event("model.saved", [related("flow-run", RUN, role="deployment")]),
    flow_run_event("model.saved", [related("deployment", str(uuid4()))]),
    flow_run_event("model.saved", [related("deployment", DEPLOYMENT, role="flow-run")]),
    flow_run_event("model.saved", [related("work-pool", str(uuid4()))]),
    flow_run_event("model.saved", [related("work-queue", str(uuid4()))]),
    flow_run_event("model.saved", [related("tag", "e31:billed-s=0")]),
    flow_run_event("model.saved", [{"prefect.resource.id": "acme.thing.1", "prefect.resource.role": "x"}]),
    flow_run_event("model.saved", "not a list"),
    {"event": "prefect.task-run.Completed", "resource": {"prefect.resource.id": f"prefect.task-run.{uuid4()}"},
     "related": [related("flow-run", RUN)], "payload": {"task_run": {"tags": ["e31:team=research"]}}},
    {"event": "prefect.task-run.Completed", "resource": {"prefect.resource.id": f"prefect.task-run.{uuid4()}"},
     "related": [related("flow-run", RUN, role="parent")]},
    {"event": "prefect.artifact.created", "resource": {"prefect.resource.id": f"prefect.artifact.{uuid4()}"}},
]


@pytest.mark.parametrize("event", FORGED_EVENTS)
def test_a_job_cannot_send_the_workers_or_prefects_events(event):
    assert not event_from_job(event, known())


def test_the_engines_own_events_pass_with_what_prefect_relates_to_them():
    mine = known()
    task, artifact = str(uuid4()), str(uuid4())
    learn("POST", "/artifacts/", {"id": artifact}, mine)
    task_event = {"event": "prefect.task-run.Running",
                  "resource": {"prefect.resource.id": f"prefect.task-run.{task}", "prefect.state-type": "RUNNING"},
                  "related": [related("tag", "nightly"), *context_related()],
                  "payload": {"task_run": {"name": "step", "tags": ["nightly"]}}}
    assert event_from_job(task_event, mine) and task in mine.task_runs
    assert event_from_job({**task_event, "event": "prefect.task-run.Completed",
                           "related": [*context_related(), related("task-run", task)]}, mine)
    assert event_from_job(flow_run_event("prefect.flow-run.heartbeat", context_related()), mine)
    assert event_from_job(flow_run_event("prefect.flow-run.pull-step.executed",
                                         [related("deployment", DEPLOYMENT)]), mine)
    assert event_from_job(flow_run_event("model.saved", context_related()), mine)
    assert event_from_job({"event": "prefect.artifact.created", "related": context_related(),
                           "resource": {"prefect.resource.id": f"prefect.artifact.{artifact}"}}, mine)


def door(run_has_retries=False) -> gateway.Gateway:
    """A gateway with no socket: only its judgement of the job's own run's end."""
    made = judge()
    made.owned, made.work_ending = known(), threading.Event()
    made._retries_left = lambda: run_has_retries
    return made


@pytest.mark.parametrize("kind", ["COMPLETED", "CANCELLED", "CANCELLING", "CRASHED", "FAILED"])
def test_its_own_run_ends_only_when_its_work_does(kind, monkeypatch):
    monkeypatch.setattr(gateway, "END_HOLD_SECONDS", 0.05)
    early = door()
    force = kind in ("CANCELLED", "CANCELLING", "CRASHED")
    why = early.end_refusal({"state": {"type": kind}, "force": force})
    assert why and f"goes {kind} only when its work ends" in why
    ended = door()
    ended.work_ending.set()
    assert ended.end_refusal({"state": {"type": kind}, "force": force}) is None
    assert door().end_refusal({"state": {"type": "RUNNING"}}) is None


def test_a_final_state_waits_for_the_supervisor_to_read_the_works_end(monkeypatch):
    monkeypatch.setattr(gateway, "END_HOLD_SECONDS", 30.0)
    held = door()
    threading.Timer(0.2, held.work_ending.set).start()  # the engine says "ended" just before it reports
    assert held.end_refusal({"state": {"type": "COMPLETED"}}) is None


def test_a_failed_with_retries_left_is_a_retry_not_an_end(monkeypatch):
    monkeypatch.setattr(gateway, "END_HOLD_SECONDS", 0.05)
    assert door(run_has_retries=True).end_refusal({"state": {"type": "FAILED"}}) is None
    assert door(run_has_retries=True).end_refusal({"state": {"type": "COMPLETED"}}) is not None
    assert door(run_has_retries=False).end_refusal({"state": {"type": "FAILED"}}) is not None


def test_a_job_keeps_its_runs_retry_type_so_no_worker_takes_a_run_awaiting_its_retry():
    # The server marks a run that failed with retries left `in_process`; cleared, a worker would start it again.
    waiting = door()
    waiting._read_own_run = lambda: {"state": {"type": "SCHEDULED", "name": "AwaitingRetry"},
                                     "empirical_policy": {"retries": 1, "retry_type": "in_process"}}
    why = waiting.policy_refusal({"empirical_policy": {"retries": 1, "retry_type": None}})
    assert why and "retry_type" in why and "worker would pick the run up" in why
    assert waiting.policy_refusal({"empirical_policy": {"retries": 1, "retry_type": "reschedule"}}) is not None
    fresh = door()  # the engine's own PATCH as it starts: the policy as read, with the flow's retries
    fresh._read_own_run = lambda: {"state": {"type": "PENDING"}, "empirical_policy": {"retries": None,
                                                                                      "retry_type": None}}
    assert fresh.policy_refusal({"flow_version": "1", "empirical_policy": {"retries": 2, "retry_type": None}}) is None
    assert fresh.policy_refusal({"name": "renamed"}) is None
    unread = door()  # the API did not answer: nothing to compare with, so nothing changes
    unread._read_own_run = lambda: None
    assert unread.policy_refusal({"empirical_policy": {"retry_type": None}}) is not None


def test_a_policy_sent_without_its_retry_type_clears_it_and_is_refused_as_is_a_later_one():
    waiting = door()
    waiting._read_own_run = lambda: {"state": {"type": "SCHEDULED"},
                                     "empirical_policy": {"retries": 9, "retry_type": "in_process"}}
    assert "retry_type" in waiting.policy_refusal({"empirical_policy": {"retries": 9, "retry_delay": 0}})
    running = door()  # more retries once it runs would let it end its run as a "retry"
    running._read_own_run = lambda: {"state": {"type": "RUNNING"}, "empirical_policy": {"retries": 0}}
    assert "as it starts" in running.policy_refusal({"empirical_policy": {"retries": 9}})
    starting = door()
    starting._read_own_run = lambda: {"state": {"type": "PENDING"}, "empirical_policy": {"retries": None}}
    assert starting.policy_refusal({"empirical_policy": {"retries": 9, "retry_type": None}}) is None


def test_a_subflow_with_an_idempotency_key_is_refused_and_only_a_run_of_its_own_task_is_learned():
    mine = known()
    base = {"flow_id": str(uuid4()), "parent_task_run_id": TASK, "state": {"type": "PENDING"}}
    assert "idempotency_key" in refusal("POST", "/flow_runs/", {**base, "idempotency_key": "scheduled x y z"}, mine)
    assert refusal("POST", "/flow_runs/", {**base, "idempotency_key": None}, mine) is None
    found = str(uuid4())  # the server answered with a run that is not the one asked for
    learn("POST", "/flow_runs/", {"id": found, "parent_task_run_id": None}, mine)
    assert found not in mine.flow_runs
    made = str(uuid4())
    learn("POST", "/flow_runs/", {"id": made, "parent_task_run_id": TASK}, mine)
    assert made in mine.flow_runs


def test_a_deferred_task_run_is_refused_a_task_retry_passes():
    mine = known()
    deferred = {"type": "SCHEDULED", "state_details": {"deferred": True}}
    assert "task worker" in refusal("POST", "/task_runs/", {"flow_run_id": RUN, "state": deferred}, mine)
    assert "task worker" in refusal("POST", f"/task_runs/{TASK}/set_state", {"state": deferred}, mine)
    retry = {"type": "SCHEDULED", "name": "AwaitingRetry", "state_details": {}}
    assert refusal("POST", f"/task_runs/{TASK}/set_state", {"state": retry}, mine) is None


@pytest.mark.parametrize("path", ["/api/flow_runs/x/input/%2E%2E%2Fy", "/api/flow_runs/%2e%2e/set_state",
                                  "//api/flow_runs", "/api/flow_runs/./x", "/api/a%5Cb"])
def test_a_path_a_proxy_would_read_otherwise_is_refused(path):
    judge = gateway.Gateway.__new__(gateway.Gateway)
    judge.base_path = "/api"
    assert judge.route(path) is None


def test_the_call_forwarded_is_the_one_judged():
    judge = gateway.Gateway.__new__(gateway.Gateway)
    judge.base_path = "/prefect/api"
    assert judge.route("http://elsewhere/api/flow_runs/a?x=1#frag") == "/flow_runs/a"
    assert judge.upstream_path("http://elsewhere/api/flow_runs/a?x=1#frag") == "/prefect/api/flow_runs/a?x=1"
    assert judge.route("/api/work_pools/my%20pool") == "/work_pools/my%20pool"


def test_a_tagged_task_holds_its_tags_slots_and_only_its_own_leases():
    mine = known()
    take = "/v2/concurrency_limits/increment-with-lease"
    body = {"names": ["tag:database"], "slots": 1, "mode": "concurrency", "lease_duration": 60}
    assert refusal("POST", take, body, mine) is None
    assert "not a tagged task's" in refusal("POST", take, {**body, "names": ["tag:db", "e31-team-vision"]}, mine)
    lease, other = str(uuid4()), str(uuid4())
    learn("POST", take, {"lease_id": lease, "limits": []}, mine)
    assert refusal("POST", f"/v2/concurrency_limits/leases/{lease}/renew", {"lease_duration": 60}, mine) is None
    assert refusal("POST", f"/v2/concurrency_limits/leases/{other}/renew", {"lease_duration": 60}, mine)
    assert refusal("POST", "/v2/concurrency_limits/decrement-with-lease", {"lease_id": lease}, mine) is None
    assert refusal("POST", "/v2/concurrency_limits/decrement-with-lease", {"lease_id": other}, mine)


# Issue 31: a gateway no job can exhaust. What a job sends is held in its supervisor, outside its memory limit.
def wire(opcode: int, payload: bytes, fin: bool = True, rsv: int = 0) -> bytes:
    """A masked frame as a job could write it, valid or not."""
    head = bytes([(0x80 if fin else 0) | rsv | opcode])
    size = len(payload)
    head += bytes([0x80 | size]) if size < 126 else bytes([0x80 | 126]) + size.to_bytes(2, "big")
    return head + b"\0\0\0\0" + payload  # a zero mask leaves the payload as it is


@pytest.mark.parametrize(("frame", "code"), [
    (wire(0x2, b"{}"), 1003),  # binary
    *[(wire(opcode, b"x"), 1003) for opcode in (0x3, 0x4, 0x5, 0x6, 0x7, 0xB, 0xC, 0xD, 0xE, 0xF)],  # reserved
    (wire(0x0, b"x"), 1003),  # a continuation
    (wire(0x1, b'{"a": 1', fin=False), 1003),  # a fragmented message
    (wire(0x9, b"x", fin=False), 1003),  # a fragmented ping
    (wire(0x9, b"x" * 126), 1003),  # a ping over 125 bytes
    (wire(0xA, b"x" * 200), 1003),
    (wire(0x8, b"\x03\xe8" + b"x" * 124), 1003),
    (wire(0x1, b"{}", rsv=0x40), 1003),  # compressed, though no extension was negotiated
    (wire(0x1, b'{"event": "\xff\xfe"}'), 1003),  # text that is not UTF-8
    (bytes([0x81, 0x80 | 127]) + (MAX_MESSAGE_BYTES + 1).to_bytes(8, "big"), 1009),  # its header is enough
])
def test_a_frame_the_gateway_cannot_judge_is_refused_with_a_close_code(frame, code):
    with pytest.raises(FrameError) as refused:
        read_frame(io.BytesIO(frame))
    assert refused.value.code == code


def test_control_frames_and_text_pass_and_a_close_is_checked():
    assert read_frame(io.BytesIO(wire(0x9, b"x" * 125))) == Frame(0x9, b"x" * 125)
    assert read_frame(io.BytesIO(wire(0x1, "é€😀".encode()))) == Frame(TEXT, "é€😀".encode())
    assert valid_close(b"") and valid_close(b"\x03\xe8bye") and valid_close(b"\x0f\xa0")
    assert not valid_close(b"\x03") and not valid_close(b"\x03\xed") and not valid_close(b"\x03\xe8\xff")


def routes_and_bodies():
    """Every call the cases above judge: (method, route, body, what the job owns)."""
    mine, child = with_child()
    for method, route, body in PASSING + [case[:3] for case in REFUSED]:
        yield method, route, body, owned()
    for body, _ in SUBFLOWS:
        yield "POST", "/flow_runs/", body, known()
    for target in (RUN, child):
        for method, tail, body, _ in RUN_CHANGES:
            yield method, f"/flow_runs/{target}{tail}", body, mine
        for method, tail, body in ENGINE_CALLS:
            yield method, f"/flow_runs/{target}{tail}", body, mine
    yield "POST", "/logs/", [{"flow_run_id": RUN, "message": "m" * 5000, "level": 20}] * 3, owned()
    yield "POST", "/artifacts/", {"flow_run_id": RUN, "key": "e31-meter-x", "data": "x" * 9000}, known()


JUDGED = [case for case in routes_and_bodies() if route_for(case[0], case[1])]


# Ids without the cases' random run ids: every test process must collect the same names.
@pytest.mark.parametrize(("method", "route", "body", "mine"), JUDGED,
                         ids=[f"{number}-{case[0]}" for number, case in enumerate(JUDGED)])
def test_a_body_read_only_as_far_as_its_judge_looks_is_judged_as_the_whole_body(method, route, body, mine):
    """The gateway builds only what each route's judge reads of a body (gateway_rules.Route.reads); the rest
    is passed over. Judged so, every call gets the verdict the whole body gets."""
    read = route_for(method, route)[0].reads
    assert refusal(method, route, read_json(json.dumps(body).encode(), read), mine) == refusal(method, route, body,
                                                                                              mine)



@pytest.mark.parametrize("name", ["nightly run / ../ #1 ünï", "夜間", "🌙 run"])
def test_an_answer_with_text_past_ascii_is_learned_as_the_server_sends_it(name):
    """The server sends UTF-8 unescaped: a run named so still names its deployment to the gateway (the engine
    reads that deployment next)."""
    mine, deployment = owned(), str(uuid4())
    answer = {"id": RUN, "name": name, "deployment_id": deployment, "tags": [name], "labels": {"note": name}}
    read = answer_reads("GET", f"/flow_runs/{RUN}")
    learn("GET", f"/flow_runs/{RUN}", read_json(json.dumps(answer, ensure_ascii=False).encode(), read), mine)
    assert refusal("GET", f"/deployments/{deployment}", None, mine) is None
    assert name in mine.tags

@pytest.mark.parametrize("event", [*FORGED_EVENTS, "own task", "own flow run", "own artifact"])
def test_an_event_read_only_as_far_as_its_judge_looks_is_judged_as_the_whole_event(event):
    mine, task, artifact = known(), str(uuid4()), str(uuid4())
    learn("POST", "/artifacts/", {"id": artifact}, mine)
    own = {"own task": {"event": "prefect.task-run.Running", "related": [related("tag", "nightly"),
                                                                           *context_related()],
                        "resource": {"prefect.resource.id": f"prefect.task-run.{task}"},
                        "payload": {"task_run": {"name": "step", "tags": ["nightly"]}, "x": list(range(50))}},
           "own flow run": flow_run_event("model.saved", context_related()),
           "own artifact": {"event": "prefect.artifact.created", "related": context_related(),
                            "resource": {"prefect.resource.id": f"prefect.artifact.{artifact}"}}}
    whole = own[event] if isinstance(event, str) else event
    as_read = read_json(json.dumps(whole).encode(), MESSAGE_READS)
    assert event_from_job(as_read, deepcopy(mine)) == event_from_job(whole, deepcopy(mine))


MiB = 2**20
LOG_BATCH = [{"flow_run_id": WHOLE, "task_run_id": WHOLE}]


def many_keys(size: int) -> bytes:
    return b"[{" + b",".join(b'"k%d":0' % i for i in range(size // 10)) + b"}]"


@pytest.mark.parametrize(("name", "body"), [
    ("empty objects", b"[" + b"{}," * (2 * MiB // 3 - 1) + b"{}]"),
    ("empty arrays", b"[" + b"[]," * (2 * MiB // 3 - 1) + b"[]]"),
    ("small keys", many_keys(2 * MiB)),
    ("nested deep", b"[" * (4 * MiB) + b"]" * (4 * MiB)),
    ("short strings", b"[" + b'"ab",' * (8 * MiB // 5 - 1) + b'"ab"]'),
    ("a key of 8 MiB", b'[{"' + b"k" * 8 * MiB + b'": 1}]'),
    ("astral text", b'[{"flow_run_id": "\xf0\x9f\x98\x80' + b"a" * (8 * MiB) + b'"}]'),
    ("ids of 4 kB", b"[" + b",".join([b'{"flow_run_id": "' + b"a" * 4000 + b'"}'] * 2000) + b"]"),
])
def test_what_the_gateway_builds_to_judge_a_hostile_body_is_bounded(name, body):
    """Python's json makes 30 to 60 times a body's size of these (a 16 MiB one took the supervisor to 437 MB);
    the gateway's reader keeps at most KEPT_BYTES of it, or refuses it (413)."""
    tracemalloc.start()
    try:
        try:
            read_json(body, LOG_BATCH)
        except BodyRefused as refused:
            assert refused.status == 413
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * KEPT_BYTES, f"{name}: {peak} bytes built"


def test_a_batch_of_logs_at_the_engines_biggest_is_read_whole_and_kept_small():
    entry = {"name": "prefect.task_runs", "level": 20, "message": "step finished", "timestamp":
             "2026-01-31T12:00:00.000000Z", "flow_run_id": RUN, "task_run_id": None, "worker_id": None}
    batch = json.dumps([entry] * (4_000_000 // len(json.dumps(entry)))).encode()  # PREFECT_LOGGING_TO_API_BATCH_SIZE
    tracemalloc.start()
    try:
        read = read_json(batch, LOG_BATCH)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(read) == len(json.loads(batch)) and refusal("POST", "/logs/", read, owned()) is None
    assert peak < KEPT_BYTES


def test_the_budget_holds_no_more_than_its_bytes_over_all_connections():
    budget = Budget(10)
    with contextlib.ExitStack() as later:
        with budget.hold(6, wait=0) as first:
            with budget.hold(5, wait=0.05) as second:
                assert first and not second
            got: list[bool] = []
            waiting = threading.Thread(target=lambda: got.append(later.enter_context(budget.hold(5, wait=30))))
            waiting.start()
        waiting.join()  # it had its room once the first let go
        assert got == [True] and budget.held == 5
    assert budget.held == 0 and budget.peak == 6
    with budget.hold(11, wait=0) as too_big:
        assert not too_big
