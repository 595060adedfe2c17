"""The gateway's rules: which Prefect calls and events a running job's own flow run may make."""

from __future__ import annotations

import io
import json
import threading
from uuid import uuid4

import pytest

from e31_prefect.host import gateway
from e31_prefect.host.gateway_rules import Owned, event_for_job, event_from_job, learn, refusal
from e31_prefect.host.sandbox import View, plan_view
from e31_prefect.host.websocket_frames import CLOSE, TEXT, Frame, FrameError, encode, read_frame

# Fixed ids: the cases below are parameters, and parallel test processes must collect the same ones.
RUN, OTHER, TASK = "28f7dc00-2d45-4dfd-a501-64c8a03c143f", "43835668-28ca-4623-ab0f-9b7619d5d5a5", \
    "9bd577a1-3a8c-42f9-a1d2-917af524c465"


def owned() -> Owned:
    return Owned(flow_runs={RUN}, task_runs={TASK})


@pytest.mark.parametrize(("method", "route", "body"), [
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
])
def test_the_calls_of_its_own_flow_run_pass(method, route, body):
    assert refusal(method, route, body, owned()) is None


@pytest.mark.parametrize(("method", "route", "body", "why"), [
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
])
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
    door = gateway.Gateway.__new__(gateway.Gateway)
    door.token, door.owned, door.refused = "the-worker-token", owned(), []
    assert json.loads(door.from_job("/events/in", '{"type": "auth", "token": null}')) == {
        "type": "auth", "token": "the-worker-token"}
    forged = json.dumps({"resource": {"prefect.resource.id": f"prefect.flow-run.{OTHER}"}})
    assert door.from_job("/events/in", forged) is None and door.refused
    other = json.dumps({"type": "event", "event": json.loads(forged)})
    assert door.to_job("/events/out", other) is None
    assert door.to_job("/events/out", '{"type": "auth_success"}') == '{"type": "auth_success"}'


def test_auth_header_carries_a_key_or_an_auth_string():
    assert gateway.auth_header("pnu_1", None) == {"Authorization": "Bearer pnu_1"}
    assert gateway.auth_header(None, "admin:pass") == {"Authorization": "Basic YWRtaW46cGFzcw=="}
    assert gateway.auth_header(None, None) == {}


@pytest.mark.parametrize("size", [0, 5, 125, 126, 65535, 65536, 200_000])
@pytest.mark.parametrize("masked", [True, False])
def test_frames_round_trip_masked_or_not(size, masked):
    frame = Frame(TEXT, bytes(range(256)) * (size // 256) + b"x" * (size % 256))
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


@pytest.mark.parametrize(("body", "why"), [
    ({**SUBFLOW, "deployment_id": DEPLOYMENT}, "deployment_id"),
    ({**SUBFLOW, "work_pool_name": "gpu", "work_queue_name": "default"}, "work_pool_name, work_queue_name"),
    ({**SUBFLOW, "job_variables": {"team": "research"}}, "job_variables"),
    ({**SUBFLOW, "infrastructure_document_id": str(uuid4())}, "infrastructure_document_id"),
    ({**SUBFLOW, "state": {"type": "SCHEDULED"}}, "'SCHEDULED'"),
    ({**SUBFLOW, "state": {"type": "RUNNING"}}, "'RUNNING'"),
    ({**SUBFLOW, "tags": ["e31:billed-s=0"]}, "e31:billed-s=0"),
    ({**SUBFLOW, "tags": ["E31:team=research"]}, "E31:team=research"),
])
def test_a_job_cannot_create_a_subflow_a_worker_would_run_or_bill(body, why):
    assert why in (refusal("POST", "/flow_runs/", body, known()) or "passed")


def test_the_engines_own_subflow_passes():
    assert refusal("POST", "/flow_runs/", SUBFLOW, known()) is None
    assert refusal("POST", "/flow_runs/", {k: v for k, v in SUBFLOW.items() if k != "state"}, known()) is None


@pytest.mark.parametrize("target", ["own", "child"])
@pytest.mark.parametrize(("method", "tail", "body", "why"), [
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
])
def test_a_job_cannot_move_its_runs_to_a_worker_or_change_their_bill(target, method, tail, body, why):
    mine, child = with_child()
    run = RUN if target == "own" else child
    assert why in (refusal(method, f"/flow_runs/{run}{tail}", body, mine) or "passed")


def test_its_own_run_may_not_go_pending_again_but_a_subflow_may():
    mine, child = with_child()
    assert "'PENDING'" in refusal("POST", f"/flow_runs/{RUN}/set_state", {"state": {"type": "PENDING"}}, mine)
    assert refusal("POST", f"/flow_runs/{child}/set_state", {"state": {"type": "PENDING", "name": "NotReady"},
                                                             "force": True}, mine) is None


@pytest.mark.parametrize("target", ["own", "child"])
@pytest.mark.parametrize(("method", "tail", "body"), [
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
])
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


@pytest.mark.parametrize("event", [
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
])
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
    made = gateway.Gateway.__new__(gateway.Gateway)
    made.owned, made.refused, made.work_ending = known(), [], threading.Event()
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
