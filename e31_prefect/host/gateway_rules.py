"""What a running job may ask of the Prefect API through its gateway, and what it learns it owns (pure).

Every call the job makes is judged by :func:`refusal` against what it owns (:class:`Owned`), learned from
the answers with :func:`learn`; events go both ways through :func:`event_from_job` and :func:`event_for_job`.
Each route also says how big its body may be and what of it the judge reads (:class:`Route`), so the gateway
holds and builds no more of a body than that (:mod:`e31_prefect.host.gateway_bodies`).
:mod:`e31_prefect.host.gateway` serves these rules on the job's socket.

Only the standard library: it runs in the supervisor.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple
from urllib.parse import unquote

from e31_prefect.host.gateway_bodies import EVERY_KEY, WHOLE, MiB

_ID = r"([0-9a-fA-F-]{36})"


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


# How big a call's body may be: what Prefect's engine sends there, with room to spare. A bigger one is refused
# (413) before the gateway reads any of it; the gateway holds each body whole while it judges it.
NO_BODY = 0  # the engine's reads send none
CALL_BYTES = 1 * MiB  # a run's name and retries, its labels, a filter, a lease: a few kB
# A subflow's run or a paused run's input: the server takes parameters of up to 512 KiB, written compactly
# (PREFECT_SERVER_API_MAX_PARAMETER_SIZE). A task run, with one reference per upstream future it waits on.
RUN_BYTES = 4 * MiB
# A state: its message carries an exception's text, and the server's refusal of a call quotes the call (1.4 MB
# for the Failed state of a flow whose subflow had 589 kB of parameters).
STATE_BYTES = 4 * MiB
LOGS_BYTES = 8 * MiB  # a batch of logs: the engine sends at most 4,000,000 bytes (PREFECT_LOGGING_TO_API_BATCH_SIZE)
ARTIFACT_BYTES = 8 * MiB  # an artifact's data (a report, a table): unbounded by Prefect; a bigger one is an output

# What each judge reads of a body (gateway_bodies.read_json): the rest of it is passed over, never built.
_RUN_STATE_READS = {"state": {"type": WHOLE, "state_details": {"pause_reschedule": WHOLE}}, "force": WHOLE}
_SUBFLOW_READS = {EVERY_KEY: None, "parent_task_run_id": WHOLE, "idempotency_key": WHOLE, "state": {"type": WHOLE},
                  "tags": WHOLE}
_TASK_RUN_READS = {"flow_run_id": WHOLE, "state": {"state_details": {"deferred": WHOLE}}, "tags": WHOLE}
_ENTRY_READS = {"flow_run_id": WHOLE, "task_run_id": WHOLE}


class Route(NamedTuple):
    """One call a job's flow run may make: its method and path (under the API root), its judge, the biggest
    body it takes, and what of that body the judge reads."""

    method: str
    pattern: re.Pattern[str]
    check: Any
    cap: int
    reads: Any


# Prefect's engine's calls for one flow run, and nothing else.
ROUTES: list[Route] = [
    Route(method, re.compile(pattern), check, cap, reads) for method, pattern, check, cap, reads in [
        ("GET", r"/health", _always, NO_BODY, None),
        ("GET", r"/admin/version", _always, NO_BODY, None),
        ("GET", r"/csrf-token", _always, NO_BODY, None),
        ("GET", rf"/flow_runs/{_ID}", _own("flow_runs"), NO_BODY, None),
        ("PATCH", rf"/flow_runs/{_ID}", _own_run_update, CALL_BYTES, {EVERY_KEY: None, "empirical_policy": WHOLE}),
        ("PATCH", rf"/flow_runs/{_ID}/labels", _own_run_labels, CALL_BYTES, {EVERY_KEY: None}),
        ("POST", rf"/flow_runs/{_ID}/set_state", _own_run_state, STATE_BYTES, _RUN_STATE_READS),
        ("GET", rf"/flow_runs/{_ID}/input(?:/[^/]+)?", _own("flow_runs"), NO_BODY, None),
        ("POST", rf"/flow_runs/{_ID}/input(?:/[^/]+)?", _own("flow_runs"), RUN_BYTES, None),
        ("POST", r"/flow_runs/?", _subflow_of_own_task, RUN_BYTES, _SUBFLOW_READS),
        ("POST", r"/flow_runs/filter", _filter_of_own_runs, CALL_BYTES, WHOLE),
        ("GET", rf"/deployments/{_ID}", _own("deployments"), NO_BODY, None),
        ("GET", rf"/work_queues/{_ID}", _own("work_queues"), NO_BODY, None),
        ("GET", r"/work_pools/([^/]+)", _own("work_pools"), NO_BODY, None),
        ("GET", rf"/flows/{_ID}", _always, NO_BODY, None),  # a flow is a name; its runs are what is guarded
        ("POST", r"/flows/?", _always, CALL_BYTES, None),
        ("POST", r"/task_runs/?", _task_of_own_flow, RUN_BYTES, _TASK_RUN_READS),
        ("GET", rf"/task_runs/{_ID}", _own("task_runs"), NO_BODY, None),
        ("POST", rf"/task_runs/{_ID}/set_state", _own_task_state, STATE_BYTES,
         {"state": {"state_details": {"deferred": WHOLE}}}),
        ("POST", r"/logs/?", _own_entries, LOGS_BYTES, [_ENTRY_READS]),
        ("POST", r"/artifacts/?", _own_artifact, ARTIFACT_BYTES, {**_ENTRY_READS, "key": WHOLE}),
        ("PATCH", rf"/artifacts/{_ID}", _own_artifact_update, ARTIFACT_BYTES, {EVERY_KEY: None}),
        ("GET", r"/events/in", _always, NO_BODY, None),  # the events websockets, judged message by message
        ("GET", r"/events/out", _always, NO_BODY, None),
        # A tagged task holds a slot of each of its tags' limits (`tag:NAME`, task_engine.py): never another
        # kind of limit (a team's GPU quota is the worker's), and only the leases it took.
        ("POST", r"/v2/concurrency_limits/increment-with-lease", _tag_slots, CALL_BYTES, {"names": WHOLE}),
        ("POST", rf"/v2/concurrency_limits/leases/{_ID}/renew", _own("leases"), CALL_BYTES, None),
        ("POST", r"/v2/concurrency_limits/decrement-with-lease", _own_lease_released, CALL_BYTES, {"lease_id": WHOLE}),
    ]
]


# Calls the gateway answers itself, never passing them on. A job's result is kept in its output dir and sent with
# its outputs (e31_prefect.data.results); the job holds no storage credentials, so a default result storage the
# server names (a block, read through calls no job may make) is not the job's: its engine is told there is none.
LOCAL_ANSWERS: dict[tuple[str, str], Any] = {
    ("GET", "/admin/storage"): {"default_result_storage_block_id": None},
}


def route_for(method: str, route: str) -> tuple[Route, tuple[str, ...]] | None:
    """The route a call takes, with the ids in its path (None: no call a job's flow run makes)."""
    for allowed in ROUTES:
        matched = allowed.pattern.fullmatch(route)
        if matched and method == allowed.method:
            return allowed, tuple(unquote(i).lower() for i in matched.groups())
    return None


def refusal(method: str, route: str, body: Any, owned: Owned) -> str | None:
    """Why the gateway refuses this call (None: it passes). ``route`` is the path under the API root; ``body``
    holds at least what the route reads (:attr:`Route.reads`)."""
    found = route_for(method, route)
    if found is None:
        return f"{method} {route} is not a call a job's own flow run needs"
    verdict = found[0].check(owned, found[1], body)
    if verdict is True:
        return None
    if isinstance(verdict, str):
        return f"{method} {route}: {verdict}"
    return f"{method} {route} touches a run or object that is not this job's own"


# What :func:`learn` reads of an answer (None: nothing; the answer goes to the job as it comes).
_CREATED_READS = {"id": WHOLE, "parent_task_run_id": WHOLE, "deployment_id": WHOLE, "work_queue_id": WHOLE,
                  "work_pool_name": WHOLE, "tags": WHOLE}
OWN_RUN_READS = {"state": {"type": WHOLE}, "empirical_policy": WHOLE, "run_count": WHOLE}  # the gateway's own read


def answer_reads(method: str, route: str) -> Any:
    """What :func:`learn` reads of this call's answer (None: it learns nothing from it)."""
    if method == "POST" and route == "/flow_runs/filter":
        return [{"id": WHOLE}]
    if route == "/v2/concurrency_limits/increment-with-lease":
        return {"lease_id": WHOLE}
    if (method == "POST" and re.fullmatch(r"/(task_runs|flow_runs|artifacts)/?", route)
            or method == "GET" and re.fullmatch(rf"/flow_runs/{_ID}|/deployments/{_ID}|/work_pools/([^/]+)", route)):
        return _CREATED_READS
    return None


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


# What the gateway reads of a message a job sends on an events websocket (Prefect's auth message, a subscription's
# filter, or an event: what its judge and the server's own checks read, not its payload), and of one it receives.
MESSAGE_READS = {"type": WHOLE, "occurred": WHOLE, "event": WHOLE, "resource": WHOLE, "related": WHOLE,
                 "payload": {"task_run": {"tags": WHOLE}}, "id": WHOLE, "follows": WHOLE}
SUBSCRIBED_READS = {"type": WHOLE, "event": {"resource": WHOLE, "related": WHOLE}}

# What Prefect's server checks of an event (prefect.server.events.schemas.events.Event, at its default settings).
# One it cannot read ends the job's websocket, and leaves about 90 lines of traceback in the server's log.
MAX_EVENT_NAME = 1024  # PREFECT_SERVER_EVENTS_MAXIMUM_EVENT_NAME_LENGTH
MAX_LABELS = 500  # PREFECT_SERVER_EVENTS_MAXIMUM_LABELS_PER_RESOURCE
MAX_RELATED = 100  # PREFECT_SERVER_EVENTS_MAXIMUM_RELATED_RESOURCES
# A time as the engine writes it, from 1970 on (one near the ends of time would overflow the server's arithmetic).
_MOMENT = re.compile(r"(19[7-9]\d|2\d{3})-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,6})?(Z|[+-]\d\d:\d\d)")


def _moment(value: Any) -> bool:
    if not isinstance(value, str) or not _MOMENT.fullmatch(value):
        return False
    try:
        datetime.fromisoformat(value)
    except ValueError:
        return False
    return True


def _uuid(value: Any) -> bool:
    try:
        return isinstance(value, str) and len(value) == 36 and str(uuid.UUID(value)) == value.lower()
    except ValueError:
        return False


def _labels_refusal(resource: Any, related: bool) -> str | None:
    where = "a related resource" if related else "an event's resource"
    if not isinstance(resource, dict) or not all(isinstance(v, str) for v in resource.values()):
        return f"{where} is an object of text labels"
    if len(resource) > MAX_LABELS:
        return f"{where} has at most {MAX_LABELS} labels"
    if not resource.get("prefect.resource.id") or related and not resource.get("prefect.resource.role"):
        return f"{where} names its prefect.resource.id{' and prefect.resource.role' if related else ''}"
    return None


def event_shape_refusal(event: Any) -> str | None:
    """Why Prefect's server could not read this event (None: it can), checked before the event is judged and
    passed: its name, time, id, resource, related resources and payload, as the server's model has them."""
    if not isinstance(event, dict):
        return "an event is an object"
    name, related = event.get("event"), event.get("related", [])
    if not isinstance(name, str) or not 0 < len(name) <= MAX_EVENT_NAME:
        return f"an event's name is text of 1 to {MAX_EVENT_NAME} characters"
    if not _moment(event.get("occurred")):
        return "an event's time (occurred) is written as Prefect writes it: 2024-01-31T12:00:00.000000Z"
    if not _uuid(event.get("id")) or event.get("follows") is not None and not _uuid(event["follows"]):
        return "an event's id (and follows) is a UUID"
    if not isinstance(related, list) or len(related) > MAX_RELATED:
        return f"an event's related resources are a list of at most {MAX_RELATED}"
    if not isinstance(event.get("payload", {}), dict):
        return "an event's payload is an object"
    return next((why for why in (_labels_refusal(event.get("resource"), False),
                                 *(_labels_refusal(r, True) for r in related)) if why is not None), None)
