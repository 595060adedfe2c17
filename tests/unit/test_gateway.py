"""The gateway's rules: which Prefect calls and events a running job's own flow run may make."""

from __future__ import annotations

import io
import json
from uuid import uuid4

import pytest

from e31_prefect import gateway
from e31_prefect.gateway import Owned, event_for_job, event_from_job, learn, refusal
from e31_prefect.sandbox import View, plan_view
from e31_prefect.websocket_frames import CLOSE, TEXT, Frame, FrameError, encode, read_frame

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
    learn("POST", "/flow_runs/", {"id": child}, mine)
    learn("POST", "/artifacts/", {"id": artifact}, mine)
    assert refusal("GET", f"/deployments/{deployment}", None, mine) is None
    assert refusal("GET", f"/work_queues/{queue}", None, mine) is None
    assert refusal("GET", "/work_pools/GPU%20Pool", None, mine) is None
    assert refusal("GET", "/work_pools/other-pool", None, mine) is not None
    assert refusal("POST", f"/task_runs/{task}/set_state", {}, mine) is None
    assert refusal("POST", f"/flow_runs/{child}/set_state", {}, mine) is None
    assert refusal("PATCH", f"/artifacts/{artifact}", {}, mine) is None


def test_events_a_job_sends_name_no_run_but_its_own():
    mine = owned()
    task = str(uuid4())
    own = {"event": "prefect.task-run.Completed", "resource": {"prefect.resource.id": f"prefect.task-run.{task}"},
           "related": [{"prefect.resource.id": f"prefect.flow-run.{RUN}", "prefect.resource.role": "flow-run"}]}
    forged = {"event": "prefect.flow-run.Completed", "resource": {"prefect.resource.id": f"prefect.flow-run.{OTHER}"}}
    custom = {"event": "model.saved", "resource": {"prefect.resource.id": "acme.model.7"}}
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
