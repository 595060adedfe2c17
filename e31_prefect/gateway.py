"""The Prefect API as a running job reaches it: only its own flow run's calls, with the worker's credentials.

A job's code is not trusted, and Prefect's open-source API answers anyone who reaches it with
everything it holds (every block document's secrets, every variable, every other run). So a job
never reaches it: its supervisor serves this gateway on a Unix socket in the run's ledger folder,
the job's entry forwards its loopback Prefect URL to that socket from inside the job's own network
namespace (or its container with no network), and the gateway forwards only what Prefect's engine
needs for the job's own flow run: its state, its task runs and subflows, logs, artifacts and events
(so the UI shows them all). It refuses everything else with 403 and a line saying why.

Which runs are the job's own is learned as it goes: its flow run, the task runs and subflow runs it
creates, the deployment its flow run names, the artifacts it creates.

Work and bills come from the worker alone: a job's subflows run in its own process (no deployment,
pool, queue, job variables or schedulable state, now or later), its own run ends only when its work
does, and nothing it writes (tags, artifacts, events) can look like the worker's (``e31`` tags,
``e31-*`` artifacts, ``e31.*`` or Prefect's worker and pool events).

Only the standard library: it runs in the supervisor.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import re
import socket
import ssl
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from socketserver import ThreadingMixIn, UnixStreamServer
from typing import Any
from urllib.parse import unquote, urlsplit

from e31_prefect.websocket_frames import CLOSE, TEXT, Frame, FrameError, encode, read_frame

END_HOLD_SECONDS = 20.0  # how long a final state of the job's run waits for the supervisor to see the work end
JOB_API_PATH = "/api"  # the job's PREFECT_API_URL is http://127.0.0.1:PORT/api, whatever the real one is
MAX_BODY_BYTES = 64 * 2**20  # a batch of logs or an artifact; more is not a Prefect call
MAX_CONNECTIONS = 64  # at once, from one job
_ID = r"([0-9a-fA-F-]{36})"
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-authorization", "proxy-authenticate", "host", "content-length", "accept-encoding",
              "authorization"}


WORKER_MARK = "e31"  # the worker's tags (e31, e31:billed-s=...), artifact keys (e31-meter-...) and events
FINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED", "CANCELLING"}  # CANCELLING: the UI can no longer stop it
# States Prefect's engine proposes for a flow run (flow_engine.py: begin_run, handle_*; flow_runs.pause_flow_run).
# SCHEDULED is the server's answer to a FAILED with retries left, never the engine's proposal: a run a job
# moved there would be picked up by a worker of its pool and run again.
ENGINE_STATES = {"PENDING", "RUNNING", "PAUSED", *FINAL_STATES}
# The events Prefect's engine sends about a flow run itself (flow_engine.py, deployments/steps/core.py).
ENGINE_FLOW_RUN_EVENTS = {"prefect.flow-run.heartbeat", "prefect.flow-run.pull-step.executed",
                          "prefect.flow-run.pull-step.failed"}
FORCED_STATES = {"CRASHED", "CANCELLING", "CANCELLED"}  # the engine's force=True (and a subflow's PENDING)
# A subflow is created by the engine with these fields only (client create_flow_run); a deployment, pool,
# queue or job variables would make it a run a worker picks up, on a GPU, billed to whatever team it names.
SUBFLOW_FIELDS = {"flow_id", "flow_version", "name", "parameters", "context", "tags", "parent_task_run_id",
                  "state", "empirical_policy", "idempotency_key"}
RUN_UPDATE_FIELDS = {"name", "flow_version", "empirical_policy"}  # the engine's PATCH: its name, its retries
LABELS = {"__OTEL_TRACEPARENT"}  # the engine's only label (prefect.telemetry.run_telemetry)
ARTIFACT_UPDATE_FIELDS = {"data", "description", "metadata_"}
SHARDS_PROGRESS_KEY, SHARD_FAILURES_KEY = "e31-shards", "e31-shard-failures"  # e31's command flow's, in the job
JOB_ARTIFACT_KEYS = {SHARDS_PROGRESS_KEY, SHARD_FAILURES_KEY}


def worker_marked(name: Any) -> bool:
    """Whether a tag, artifact key or event name is the worker's to write (``e31``, ``e31:...``, ``e31-...``)."""
    return isinstance(name, str) and name.strip().lower().startswith(WORKER_MARK)


@dataclass
class Owned:
    """What a job's flow run is allowed to touch: its own runs and what it created."""

    flow_runs: set[str]
    task_runs: set[str] = field(default_factory=set)
    deployments: set[str] = field(default_factory=set)
    artifacts: set[str] = field(default_factory=set)
    leases: set[str] = field(default_factory=set)  # the concurrency slots its tagged tasks hold
    work_queues: set[str] = field(default_factory=set)  # its flow run's queue and pool, which Prefect's
    work_pools: set[str] = field(default_factory=set)  # engine names on each event it sends (names and ids)
    tags: set[str] = field(default_factory=set)  # its flow run's tags, which the engine names on its events
    run: str | None = None  # its own flow run (the others in flow_runs are its subflows)

    def __post_init__(self) -> None:
        if self.run is None and len(self.flow_runs) == 1:
            self.run = next(iter(self.flow_runs))

    def _entry_is_owned(self, entry: Any) -> bool:
        # A task's logs and artifacts carry its flow run's id; its task run may be known only to the
        # events it sent (Prefect reports task runs by events), so the flow run decides.
        if not isinstance(entry, dict):
            return False
        flow_run, task_run = entry.get("flow_run_id"), entry.get("task_run_id")
        if flow_run is not None:
            return str(flow_run).lower() in self.flow_runs
        return task_run is not None and str(task_run).lower() in self.task_runs


def _body_json(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None


def _always(owned: Owned, ids: tuple[str, ...], body: Any) -> bool:
    return True


def _own(kind: str) -> Any:
    """A check that the id in the path is one of the job's own ``kind`` (flow_runs, task_runs, ...)."""
    def check(owned: Owned, ids: tuple[str, ...], body: Any) -> bool:
        return ids[0] in getattr(owned, kind)

    return check


def _subflow_of_own_task(owned: Owned, ids: tuple[str, ...], body: Any) -> bool | str:
    # Prefect's engine creates a subflow's run with the task run that stands for it in its parent, in
    # the job's own process: Pending, no deployment, pool, queue or job variables, no worker's tags.
    if not isinstance(body, dict) or str(body.get("parent_task_run_id")).lower() not in owned.task_runs:
        return False
    if extra := sorted(set(body) - SUBFLOW_FIELDS):
        return (f"a subflow runs in the job's own process: {', '.join(extra)} (a deployment, pool, queue or "
                "job variables would make it a run for a worker) is not the job's to set")
    if body.get("idempotency_key") is not None:  # the server would answer with the run that has it, any run
        return "a subflow has no idempotency_key (the engine sets none)"
    state = body.get("state")
    if state is not None and (not isinstance(state, dict) or state.get("type") != "PENDING"):
        return f"a subflow starts PENDING, not {_state_type(state)!r}"
    return _tags_refusal(body.get("tags"))


def _state_type(state: Any) -> Any:
    return state.get("type") if isinstance(state, dict) else state


def _tags_refusal(tags: Any) -> bool | str:
    """True: tags a job may set; else why not (the e31 tags carry the bill and are the worker's)."""
    if tags is None:
        return True
    if not isinstance(tags, list):
        return False
    marked = [t for t in tags if worker_marked(t)]
    return f"tags {marked} are the worker's (e31, e31:...): a job's tags may not start with 'e31'" if marked else True


def _own_run_update(owned: Owned, ids: tuple[str, ...], body: Any) -> bool | str:
    # Its name and retries; never its tags (the bill), parameters, job variables or infrastructure.
    if ids[0] not in owned.flow_runs or not isinstance(body, dict):
        return False
    extra = sorted(set(body) - RUN_UPDATE_FIELDS)
    allowed = ", ".join(sorted(RUN_UPDATE_FIELDS))
    return f"a job may change its run's {allowed}, not {', '.join(extra)}" if extra else True


def _own_run_labels(owned: Owned, ids: tuple[str, ...], body: Any) -> bool | str:
    if ids[0] not in owned.flow_runs or not isinstance(body, dict):
        return False
    extra = sorted(set(body) - LABELS)
    return f"labels {', '.join(extra)} are not a job's to set (only {', '.join(LABELS)})" if extra else True


def _own_run_state(owned: Owned, ids: tuple[str, ...], body: Any) -> bool | str:
    """A state the engine proposes for one of the job's runs. Whether its own run may end yet is the
    gateway's to judge (:meth:`Gateway.end_refusal`): it needs the work's end, which only the supervisor knows."""
    state = body.get("state") if isinstance(body, dict) else None
    if ids[0] not in owned.flow_runs or not isinstance(state, dict):
        return False
    kind, force = state.get("type"), body.get("force", False)
    subflow = ids[0] != owned.run
    details = state.get("state_details") if isinstance(state.get("state_details"), dict) else {}
    if kind not in ENGINE_STATES or kind == "PENDING" and not subflow:
        # SCHEDULED (or its own run PENDING again) is a run for a worker of its pool, to run again.
        return f"a job's {'subflow' if subflow else 'run'} may not be moved to {kind!r} (a worker would pick it up)"
    if kind == "PAUSED" and details.get("pause_reschedule"):
        return "a job's run may pause, not suspend: a suspended run is rescheduled for a worker"
    if force not in (False, None) and not (force is True and (kind in FORCED_STATES or kind == "PENDING")):
        return f"force={force!r} is the engine's for {', '.join(sorted(FORCED_STATES))} only, not {kind!r}"
    return True


def _task_of_own_flow(owned: Owned, ids: tuple[str, ...], body: Any) -> bool | str:
    if not isinstance(body, dict) or str(body.get("flow_run_id")).lower() not in owned.flow_runs:
        return False
    return _deferred_refusal(body.get("state")) or _tags_refusal(body.get("tags"))


def _own_task_state(owned: Owned, ids: tuple[str, ...], body: Any) -> bool | str:
    if ids[0] not in owned.task_runs or not isinstance(body, dict):
        return False
    return _deferred_refusal(body.get("state")) or True


def _tag_slots(owned: Owned, ids: tuple[str, ...], body: Any) -> bool | str:
    names = body.get("names") if isinstance(body, dict) else None
    if not isinstance(names, list) or not names:
        return False
    if others := [n for n in names if not (isinstance(n, str) and n.startswith("tag:"))]:
        return f"concurrency limits {others} are not a tagged task's (tag:NAME)"
    return True


def _own_lease_released(owned: Owned, ids: tuple[str, ...], body: Any) -> bool:
    return isinstance(body, dict) and str(body.get("lease_id")).lower() in owned.leases


def _deferred_refusal(state: Any) -> str | None:
    """Why a task run's state is refused: a deferred one (``task.delay()``) is queued for Prefect's task
    workers, work started outside the job (None: it is not deferred)."""
    details = state.get("state_details") if isinstance(state, dict) else None
    if isinstance(details, dict) and details.get("deferred"):
        return "a deferred task run (task.delay()) is work for a task worker, not the job's to start"
    return None


def _filter_of_own_runs(owned: Owned, ids: tuple[str, ...], body: Any) -> bool:
    # Prefect's engine reads flow runs by filter twice: the subflow a parent task already has (by
    # parent_task_run_id) and whether its own run was suspended or cancelled (by id). Either way the
    # filter must name only the job's own runs or tasks, with every other condition narrowing it.
    if not isinstance(body, dict) or any(body.get(other) for other in
                                         ("flows", "task_runs", "deployments", "work_pools", "work_pool_queues")):
        return False
    flow_runs = body.get("flow_runs")
    if not isinstance(flow_runs, dict) or flow_runs.get("operator", "and_") != "and_":
        return False
    for key, known in (("id", owned.flow_runs), ("parent_task_run_id", owned.task_runs)):
        condition = flow_runs.get(key)
        wanted = condition.get("any_") if isinstance(condition, dict) else None
        if isinstance(wanted, list) and wanted and all(str(i).lower() in known for i in wanted):
            return True
    return False


def _own_entries(owned: Owned, ids: tuple[str, ...], body: Any) -> bool:
    entries = body if isinstance(body, list) else [body]
    return bool(entries) and all(owned._entry_is_owned(entry) for entry in entries)


def _own_artifact(owned: Owned, ids: tuple[str, ...], body: Any) -> bool | str:
    # An e31-* key is the worker's: `e31 usage` bills a run from its e31-meter artifact. The shards' progress
    # and failures are the job's own report on its own run (e31's command flow writes them in the job).
    if not isinstance(body, dict) or not _own_entries(owned, ids, body):
        return False
    key = body.get("key")
    return f"artifact key {key!r} is the worker's (e31-...): choose a key not starting with 'e31'" \
        if worker_marked(key) and key not in JOB_ARTIFACT_KEYS else True


def _own_artifact_update(owned: Owned, ids: tuple[str, ...], body: Any) -> bool | str:
    if ids[0] not in owned.artifacts or not isinstance(body, dict):
        return False
    extra = sorted(set(body) - ARTIFACT_UPDATE_FIELDS)
    return f"an artifact's {', '.join(extra)} cannot change (only its data, description, metadata)" if extra else True


# (method, path under the API root, check): Prefect's engine's calls for one flow run, and nothing else.
ROUTES: list[tuple[str, re.Pattern[str], Any]] = [
    (method, re.compile(pattern), check) for method, pattern, check in [
        ("GET", r"/health", _always),
        ("GET", r"/admin/version", _always),
        ("GET", r"/csrf-token", _always),
        ("GET", r"/admin/storage", _always),  # where the server keeps results by default (a block's id)
        ("GET", rf"/flow_runs/{_ID}", _own("flow_runs")),
        ("PATCH", rf"/flow_runs/{_ID}", _own_run_update),
        ("PATCH", rf"/flow_runs/{_ID}/labels", _own_run_labels),
        ("POST", rf"/flow_runs/{_ID}/set_state", _own_run_state),
        ("GET", rf"/flow_runs/{_ID}/input(?:/[^/]+)?", _own("flow_runs")),
        ("POST", rf"/flow_runs/{_ID}/input(?:/[^/]+)?", _own("flow_runs")),
        ("POST", r"/flow_runs/?", _subflow_of_own_task),
        ("POST", r"/flow_runs/filter", _filter_of_own_runs),
        ("GET", rf"/deployments/{_ID}", _own("deployments")),
        ("GET", rf"/work_queues/{_ID}", _own("work_queues")),
        ("GET", r"/work_pools/([^/]+)", _own("work_pools")),
        ("GET", rf"/flows/{_ID}", _always),  # a flow is a name; its runs are what is guarded
        ("POST", r"/flows/?", _always),
        ("POST", r"/task_runs/?", _task_of_own_flow),
        ("GET", rf"/task_runs/{_ID}", _own("task_runs")),
        ("POST", rf"/task_runs/{_ID}/set_state", _own_task_state),
        ("POST", r"/logs/?", _own_entries),
        ("POST", r"/artifacts/?", _own_artifact),
        ("PATCH", rf"/artifacts/{_ID}", _own_artifact_update),
        ("GET", r"/events/in", _always),  # the events websockets, judged message by message
        ("GET", r"/events/out", _always),
        # A tagged task holds a slot of each of its tags' limits (`tag:NAME`, task_engine.py): never another
        # kind of limit (a team's GPU quota is the worker's), and only the leases it took.
        ("POST", r"/v2/concurrency_limits/increment-with-lease", _tag_slots),
        ("POST", rf"/v2/concurrency_limits/leases/{_ID}/renew", _own("leases")),
        ("POST", r"/v2/concurrency_limits/decrement-with-lease", _own_lease_released),
    ]
]


def refusal(method: str, route: str, body: Any, owned: Owned) -> str | None:
    """Why the gateway refuses this call (None: it passes). ``route`` is the path under the API root."""
    for allowed_method, pattern, check in ROUTES:
        matched = pattern.fullmatch(route)
        if matched and method == allowed_method:
            ids = tuple(unquote(i).lower() for i in matched.groups())
            verdict = check(owned, ids, body)
            if verdict is True:
                return None
            if isinstance(verdict, str):
                return f"{method} {route}: {verdict}"
            return f"{method} {route} touches a run or object that is not this job's own"
    return f"{method} {route} is not a call a job's own flow run needs"


def learn(method: str, route: str, answer: Any, owned: Owned) -> None:
    """Record what a passed call created or named: the job's task runs, subflows, deployment, artifacts."""
    if method == "POST" and route == "/flow_runs/filter" and isinstance(answer, list):
        owned.flow_runs.update(str(run["id"]).lower() for run in answer if isinstance(run, dict) and "id" in run)
        return
    if route == "/v2/concurrency_limits/increment-with-lease" and isinstance(answer, dict) and answer.get("lease_id"):
        owned.leases.add(str(answer["lease_id"]).lower())
        return
    if not isinstance(answer, dict) or "id" not in answer:
        return
    created = str(answer["id"]).lower()
    if method == "POST" and re.fullmatch(r"/task_runs/?", route):
        owned.task_runs.add(created)
    elif method == "POST" and re.fullmatch(r"/flow_runs/?", route):
        if str(answer.get("parent_task_run_id")).lower() in owned.task_runs:  # a run of its own, not one found
            owned.flow_runs.add(created)
    elif method == "POST" and re.fullmatch(r"/artifacts/?", route):
        owned.artifacts.add(created)
    elif method == "GET" and re.fullmatch(rf"/flow_runs/{_ID}", route):
        for key, known in (("deployment_id", owned.deployments), ("work_queue_id", owned.work_queues),
                           ("work_pool_name", owned.work_pools)):
            if answer.get(key):
                known.add(str(answer[key]).lower())
        owned.tags.update(str(t) for t in answer.get("tags") or [] if isinstance(answer.get("tags"), list))
    elif method == "GET" and re.fullmatch(rf"/deployments/{_ID}", route):
        owned.tags.update(str(t) for t in answer.get("tags") or [] if isinstance(answer.get("tags"), list))
    elif method == "GET" and re.fullmatch(r"/work_pools/([^/]+)", route):
        owned.work_pools.add(str(answer["id"]).lower())  # events name a pool by its id


def _flow_runs_named(event: Any) -> list[str] | None:
    """The flow run ids an event names (as its resource or a related one); None: not an event."""
    if not isinstance(event, dict) or not isinstance(event.get("resource"), dict):
        return None
    resources = [event["resource"], *(event.get("related") or [])]
    return [found[1].lower() for resource in resources
            if (found := _kind_and_id(resource)) is not None and found[0] == "flow-run"]


def _kind_and_id(resource: Any) -> tuple[str, str] | None:
    """``prefect.flow-run.<id>`` as ("flow-run", "<id>"); None for anything not a Prefect object."""
    rid = resource.get("prefect.resource.id") if isinstance(resource, dict) else None
    if not isinstance(rid, str) or not rid.startswith("prefect."):
        return None
    kind, _, ident = rid.removeprefix("prefect.").partition(".")
    return (kind, ident) if ident else None


def _related_is_own(resource: Any, owned: Owned, task_run: str | None) -> bool:
    """A related resource the engine names on a job's events: its own runs, flow, deployment, queue,
    pool and tags, each in the role of its kind (a role names what a resource is to automations)."""
    found = _kind_and_id(resource)
    if found is None:
        return False
    kind, ident = found
    if resource.get("prefect.resource.role") != kind:
        return False
    if kind == "tag":
        return not worker_marked(ident) or ident in owned.tags  # its run's e31 tags, as the worker set them
    if kind == "flow":
        return True  # a flow is a name; its runs are what is guarded
    known = {"flow-run": owned.flow_runs, "task-run": owned.task_runs | {task_run}, "deployment": owned.deployments,
             "work-queue": owned.work_queues, "work-pool": owned.work_pools}.get(kind)
    return known is not None and ident.lower() in known


def event_from_job(event: Any, owned: Owned) -> bool:
    """Whether an event the job sends may pass: about its own flow run, one of its task runs or
    artifacts, with only its own objects related, and named like none of the worker's or Prefect's
    own events about pools, workers, deployments or run states (automations and alerts act on those).
    A task run it reports about its own flow run becomes the job's own."""
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        return False
    name = event["event"].strip().lower()
    found = _kind_and_id(event.get("resource"))
    related = event.get("related") or []
    if found is None or worker_marked(name) or not isinstance(related, list):
        return False
    kind, ident = found[0], found[1].lower()
    if kind == "flow-run":
        # Its state events are the server's; the engine sends only these about it.
        allowed = ident in owned.flow_runs and (name in ENGINE_FLOW_RUN_EVENTS or not name.startswith("prefect"))
    elif kind == "task-run":
        payload = event.get("payload") if isinstance(event.get("payload"), dict) else {}
        task = payload.get("task_run") if isinstance(payload.get("task_run"), dict) else {}
        parent = any(_kind_and_id(r) == ("flow-run", f) and r.get("prefect.resource.role") == "flow-run"
                     for r in related for f in owned.flow_runs)
        allowed = ((ident in owned.task_runs or parent)
                   and (name.startswith("prefect.task-run.") or not name.startswith("prefect"))
                   and _tags_refusal(task.get("tags")) is True)
    elif kind == "artifact":
        allowed = ident in owned.artifacts and name in ("prefect.artifact.created", "prefect.artifact.updated")
    else:
        allowed = False
    if not allowed or not all(_related_is_own(r, owned, ident if kind == "task-run" else None) for r in related):
        return False
    if kind == "task-run":
        owned.task_runs.add(ident)
    return True


def event_for_job(event: Any, owned: Owned) -> bool:
    """Whether an event of a subscription reaches the job: it is about one of the job's own runs."""
    named = _flow_runs_named(event)
    return bool(named) and all(i in owned.flow_runs for i in named)


def auth_header(api_key: str | None, auth_string: str | None) -> dict[str, str]:
    """The worker's credentials for the Prefect API, as the gateway adds them to each forwarded call."""
    if api_key:
        return {"Authorization": f"Bearer {api_key}"}
    if auth_string:
        return {"Authorization": "Basic " + base64.b64encode(auth_string.encode()).decode()}
    return {}


class _Server(ThreadingMixIn, UnixStreamServer):
    daemon_threads = True
    gateway: Gateway

    # A thread and a descriptor each: a job opening connections without end would take the supervisor's
    # descriptors (and with them its watch of the work). Prefect's client keeps a handful open.
    def verify_request(self, request: Any, client_address: Any) -> bool:
        with self.gateway.connections_lock:
            if len(self.gateway.open_connections) < MAX_CONNECTIONS:
                self.gateway.open_connections.add(request)
                return True
        self.gateway._refuse(f"more than {MAX_CONNECTIONS} connections at once")
        return False

    def shutdown_request(self, request: Any) -> None:
        with self.gateway.connections_lock:
            self.gateway.open_connections.discard(request)
        super().shutdown_request(request)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    upstream: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: Any) -> None:  # one line per refusal is logged instead
        return

    def address_string(self) -> str:
        return "job"

    def do_GET(self) -> None:
        self._forward()

    do_POST = do_PATCH = do_PUT = do_DELETE = do_GET

    def _forward(self) -> None:
        gateway = self.server.gateway
        route = gateway.route(self.path)
        length = self.headers.get("Content-Length") or "0"
        if self.headers.get("Transfer-Encoding") or not length.isdigit() or int(length) > MAX_BODY_BYTES:
            self.close_connection = True
            return self._answer(413, "a Prefect call's body has a length, under 64 MiB")
        body = self.rfile.read(int(length))
        parsed = _body_json(body)
        why = refusal(self.command, route, parsed, gateway.owned) if route is not None else "not the Prefect API"
        own_run = route is not None and route.lower().startswith(f"/flow_runs/{gateway.owned.run}")
        if why is not None:
            gateway._refuse(why)
            return self._answer(403, f"e31: {why}; a running job reaches only its own flow run")
        if self.headers.get("Upgrade", "").lower() == "websocket":
            return self._relay_websocket()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        headers.update(gateway.headers)
        headers["Host"] = gateway.netloc
        # Its own run's changes one at a time, judged and sent together: a FAILED judged to have retries
        # left is not raced by a PATCH of those retries.
        with gateway.own_run_lock if own_run else contextlib.nullcontext():
            if own_run and (why := gateway.end_refusal(parsed) if route.endswith("/set_state")
                            else gateway.policy_refusal(parsed) if self.command == "PATCH" else None) is not None:
                gateway._refuse(why)
                return self._answer(403, f"e31: {why}; a running job reaches only its own flow run")
            status, reason, answer_headers, answer = gateway.call(self.command, gateway.upstream_path(self.path),
                                                                  body, headers, self)
        with contextlib.suppress(Exception):
            learn(self.command, route, json.loads(answer) if answer else None, gateway.owned)
        self.send_response(status, reason)
        for name, value in answer_headers:
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def _answer(self, status: int, detail: str) -> None:
        payload = json.dumps({"detail": detail}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _relay_websocket(self) -> None:
        """Prefect's events websockets, message by message: the handshake goes upstream with no
        extension, the job's auth message carries the worker's token instead, the events it sends
        must be about its own runs, and of the events it subscribed to it receives its own runs' only."""
        gateway = self.server.gateway
        route = gateway.route(self.path)
        upstream = gateway.connect_raw()
        lines = [f"GET {gateway.upstream_path(self.path)} HTTP/1.1", f"Host: {gateway.netloc}"]
        lines += [f"{k}: {v}" for k, v in self.headers.items()
                  if k.lower() not in ("host", "authorization", "sec-websocket-extensions")]
        lines += [f"{k}: {v}" for k, v in gateway.headers.items()]
        upstream.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        self.close_connection = True
        from_upstream = upstream.makefile("rb")
        handshake = b""
        while not handshake.endswith(b"\r\n\r\n"):
            line = from_upstream.readline(65536)
            if not line:
                break
            handshake += line
        self.connection.sendall(handshake)
        if not handshake.startswith((b"HTTP/1.1 101", b"HTTP/1.0 101")):
            upstream.close()
            return
        sender = threading.Thread(target=_pass_frames, daemon=True, args=(
            from_upstream, self.connection, False, lambda text: gateway.to_job(route, text)))
        sender.start()
        _pass_frames(self.rfile, upstream, True, lambda text: gateway.from_job(route, text))
        with contextlib.suppress(OSError):
            upstream.shutdown(socket.SHUT_RDWR)
        sender.join()
        upstream.close()


def _pass_frames(source: Any, sink: socket.socket, masked: bool, judge: Any) -> None:
    """Copy frames from ``source`` to ``sink`` until either ends; each text message passes through
    ``judge`` (its replacement, or None: dropped). A frame the gateway cannot read ends the relay."""
    with contextlib.suppress(OSError, FrameError):
        while (frame := read_frame(source)) is not None:
            if frame.opcode == TEXT:
                text = judge(frame.payload.decode("utf-8", "replace"))
                if text is None:
                    continue
                frame = Frame(TEXT, text.encode())
            sink.sendall(encode(frame, masked))
            if frame.opcode == CLOSE:
                break
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


class Gateway:
    """One run's gateway to the Prefect API at ``upstream`` (``http(s)://host:port/api``)."""

    def __init__(self, listening: socket.socket, upstream: str, flow_run_id: str, headers: dict[str, str],
                 token: str | None = None):
        split = urlsplit(upstream)
        self.https = split.scheme == "https"
        self.host, self.port = split.hostname or "127.0.0.1", split.port or (443 if self.https else 80)
        self.netloc = split.netloc
        self.base_path = split.path.rstrip("/")
        self.headers = headers
        self.token = token  # the API key or auth string, for the events websockets' own auth message
        self.owned = Owned(flow_runs={flow_run_id.lower()})
        self.connections_lock = threading.Lock()
        self.open_connections: set[Any] = set()
        self.refused: list[str] = []
        self.work_ending = threading.Event()  # set by the supervisor: the work said it ended, or is being stopped
        self.own_run_lock = threading.Lock()
        self._local = threading.local()
        self.server = _Server(listening.getsockname(), _Handler, bind_and_activate=False)
        self.server.socket.close()
        self.server.socket = listening
        self.server.gateway = self

    def from_job(self, route: str | None, text: str) -> str | None:
        """A message the job sends on an events websocket, as it goes upstream (None: dropped)."""
        try:
            message = json.loads(text)
        except ValueError:
            return None
        if isinstance(message, dict) and message.get("type") == "auth":
            return json.dumps({"type": "auth", "token": self.token})
        if route == "/events/out" and isinstance(message, dict) and message.get("type") == "filter":
            return text  # what comes back is judged event by event
        if route == "/events/in" and event_from_job(message, self.owned):
            return text
        self._refuse(f"an event naming another run on {route}")
        return None

    def to_job(self, route: str | None, text: str) -> str | None:
        """A message the server sends on an events websocket, as the job receives it (None: dropped)."""
        if route != "/events/out":
            return text
        try:
            message = json.loads(text)
        except ValueError:
            return None
        if isinstance(message, dict) and message.get("type") == "event":
            return text if event_for_job(message.get("event"), self.owned) else None
        return text

    def end_refusal(self, body: Any) -> str | None:
        """Why a state for the job's own run may not pass yet (None: it may).

        A final state (or Cancelling) passes only once the supervisor knows the work is ending: the job's
        entry says so just before its engine reports the final state, and a stop sets it too. Before
        that, a Completed or Cancelled run whose work goes on could no longer be cancelled from the UI,
        and would keep its GPUs to its time limit. The call is held a moment for the supervisor to read
        the work's word. One exception: a FAILED while the run has retries left, which the server turns
        into a retry (AwaitingRetry), not an end (core_policy.RetryFailedFlows).
        """
        state = body.get("state") if isinstance(body, dict) else None
        kind = state.get("type") if isinstance(state, dict) else None
        if kind not in FINAL_STATES or self.work_ending.is_set():
            return None
        if kind == "FAILED" and body.get("force") in (False, None) and self._retries_left():
            return None
        if self.work_ending.wait(END_HOLD_SECONDS):
            return None
        return (f"its own run goes {kind} only when its work ends (the engine reports it as the flow returns); "
                "the worker reports how the work ended")

    def policy_refusal(self, body: Any) -> str | None:
        """Why a change of the job's own run's retry policy may not pass (None: it may).

        The engine sends its run's policy back once, with the flow's retries, as it starts (its run still
        Scheduled or Pending). Later, more retries would let a job end its run as a retry; and a run that
        failed with retries left waits for its retry in Scheduled, marked ``retry_type: in_process`` so that
        no worker takes it (Prefect's worker endpoint, and e31's backlog, skip it): a job that cleared that
        mark (a policy sent without it is cleared too) would hand a worker of its pool its run to start again.
        """
        policy = body.get("empirical_policy") if isinstance(body, dict) else None
        if policy is None:
            return None
        run = self._read_own_run()
        if not isinstance(policy, dict) or run is None:
            return "its run's retry policy could not be checked against the server's"
        kept = (run.get("empirical_policy") or {}).get("retry_type")
        if policy.get("retry_type") != kept:
            return f"a job may not change its run's retry_type ({kept!r}): a worker would pick the run up"
        if (run.get("state") or {}).get("type") not in ("SCHEDULED", "PENDING"):
            return "a job sets its run's retries as it starts, not once it runs"
        return None

    def _retries_left(self) -> bool:
        """Whether the job's run has a retry left, as the server will judge a FAILED (read upstream)."""
        with contextlib.suppress(Exception):
            run = self._read_own_run()
            if run is not None and (run.get("state") or {}).get("type") == "RUNNING":  # as RetryFailedFlows
                retries = (run.get("empirical_policy") or {}).get("retries")
                return retries is not None and int(run.get("run_count") or 0) <= int(retries)
        return False

    def _read_own_run(self) -> dict[str, Any] | None:
        """The job's own flow run as the API has it now, read with the worker's credentials (None: unread)."""
        with contextlib.suppress(Exception):
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            connection = cls(self.host, self.port, timeout=30)
            try:
                connection.request("GET", f"{self.base_path}/flow_runs/{self.owned.run}",
                                   headers={**self.headers, "Host": self.netloc})
                run = json.loads(connection.getresponse().read())
            finally:
                connection.close()
            return run if isinstance(run, dict) else None
        return None

    def _refuse(self, why: str) -> None:
        self.refused.append(why)
        print(f"gateway refused: {why}", file=sys.stderr, flush=True)

    def route(self, path: str) -> str | None:
        """The path under the API root the job asked for (None: not under it, or not plainly written).

        A segment that decodes to a slash, a dot or two, or a backslash is refused: a proxy before the API
        that decodes the path would send the call somewhere other than the route judged here.
        """
        asked = urlsplit(path).path
        if path.startswith("//") or asked != JOB_API_PATH and not asked.startswith(JOB_API_PATH + "/"):
            return None
        if any(unquote(segment) in (".", "..") or any(c in unquote(segment) for c in "/\\")
               for segment in asked.split("/")):
            return None
        return asked.removeprefix(JOB_API_PATH).rstrip("/") or "/"

    def upstream_path(self, path: str) -> str:
        """The same call's path (as judged) and query on the real API."""
        split = urlsplit(path)
        return self.base_path + split.path.removeprefix(JOB_API_PATH) + (f"?{split.query}" if split.query else "")

    def connect_raw(self) -> socket.socket:
        """A new connection to the Prefect API's host."""
        raw = socket.create_connection((self.host, self.port), timeout=None)
        if self.https:
            return ssl.create_default_context().wrap_socket(raw, server_hostname=self.host)
        return raw

    def call(self, method: str, path: str, body: bytes, headers: dict[str, str],
             handler: _Handler) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """Forward one call on the handler's own upstream connection (reconnecting once if it closed)."""
        for attempt in (1, 2):
            if handler.upstream is None:
                cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
                handler.upstream = cls(self.host, self.port, timeout=300)
            try:
                handler.upstream.request(method, path, body=body or None, headers=headers)
                response = handler.upstream.getresponse()
                return response.status, response.reason, response.getheaders(), response.read()
            except (OSError, http.client.HTTPException):
                handler.upstream.close()
                handler.upstream = None
                if attempt == 2:
                    return 502, "Bad Gateway", [], b'{"detail": "the Prefect API did not answer"}'
        raise AssertionError("unreachable")

    def serve(self) -> threading.Thread:
        """Serve in a thread of its own until :meth:`close`."""
        thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.5}, daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()
