"""Ending an attempt that its host or its GPU lost: billed to its last heartbeat, then requeued or ended.

    E31_HOST_LOST_SECONDS=120 E31_HOST_ATTEMPTS=2 prefect worker start --pool gpu --type e31

Any live worker of the pool ends the attempts of a lost host (:mod:`e31_prefect.surface.host_watch`); a host's
own worker ends the attempts its fence stopped, or whose GPU failed. Either way, one at a time in the pool
(:func:`pool_turn`, a Prefect concurrency lease), from the run as Prefect has it now:

- the attempt's meter closes at its last heartbeat (its devices' hand-over from the run's ``e31.rented``
  label): tags, one ``e31-meter`` table of its own, an ``e31.job.host-lost`` event; its quota lease is freed;
- the run goes back to the queue as a new attempt (a Scheduled state named ``HostLost``, due now), where its
  deadline still allows (planned by its learned run time, as a poll plans it) and it has attempts left;
  else it ends (``HostLost``, or ``DeadlineMissed`` when its deadline passed), saying why. Its own Prefect
  retries are left whole. A loss before its devices were handed over costs it no attempt: it is handed back.

What the lost host says when it comes back never overrides the new attempt: its worker finds the requeue
in the run's history (:func:`e31_prefect.model.attempts.superseded`) and keeps its outputs in its spool.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any
from uuid import UUID

from prefect.client.schemas.objects import StateType
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

from e31_prefect.model import attempts, endings
from e31_prefect.model.attempts import Loss
from e31_prefect.model.job_values import job_name
from e31_prefect.model.meter import Meter
from e31_prefect.surface import quotas, reporting
from e31_prefect.surface.life_terms import scheduled_start

if TYPE_CHECKING:
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.objects import FlowRun, State

ACTIVE = (StateType.PENDING, StateType.RUNNING, StateType.CANCELLING)
TURN_LEASE_SECONDS = 60  # Prefect's shortest lease: a judge that dies mid-turn delays the next this long at most


def turn_limit(pool: str) -> str:
    """The concurrency limit (one slot) that lets one worker of a pool at a time end lost attempts."""
    return f"e31-hosts-{pool}"


@asynccontextmanager
async def pool_turn(client: PrefectClient, pool: str) -> AsyncIterator[bool]:
    """This worker's turn to end lost attempts of ``pool`` (True), or another worker's now (False)."""
    name = turn_limit(pool)
    for _ in range(2):
        try:
            answer = (await client.increment_concurrency_slots_with_lease(
                names=[name], slots=1, mode="concurrency", lease_duration=TURN_LEASE_SECONDS)).json()
        except PrefectHTTPStatusError as exc:
            if exc.response.status_code != 423:
                raise
            yield False
            return
        lease = UUID(answer["lease_id"])
        if answer.get("limits"):
            break
        # No such limit yet, so the lease held nothing: the limit is made, and taken again.
        await quotas.release(client, lease)
        await quotas.set_quota(client, name, 1)
    else:
        yield False
        return
    try:
        yield True
    finally:
        await quotas.release(client, lease)


def _moment(text: Any) -> datetime | None:
    with contextlib.suppress(TypeError, ValueError):
        return datetime.fromisoformat(str(text)) if text else None
    return None


def _attempt_marks(states: list[State], labels: dict[str, Any]) -> tuple[datetime | None, datetime | None,
                                                                         datetime | None]:
    """When the current attempt was taken, when its devices were handed over, when its flow started running."""
    takes = [i for i, state in enumerate(states) if state.type is StateType.PENDING]
    after = states[takes[-1]:] if takes else states
    taken = after[0].timestamp if takes else None
    running = next((state.timestamp for state in after if state.type is StateType.RUNNING), None)
    # The worker labels its hand-over; an older worker's (or one that died first) is the flow's start.
    return taken, _moment(labels.get(attempts.RENTED_LABEL)) or running, running


async def end_lost_attempt(worker: Any, flow_run_id: UUID, loss: Loss, host: str | None = None,
                           state_id: UUID | None = None, failed_too: bool = False) -> endings.Ending | None:
    """End the run's current attempt as ``loss`` says, if it is still the one judged lost: held by ``host``
    (where given) in state ``state_id`` (where given). ``failed_too``: also where its flow ended in another
    state than Completed as its work was stopped for the loss (a failed GPU's). Returns its ending (None:
    nothing to do)."""
    client: PrefectClient = worker.client
    try:
        run = await client.read_flow_run(flow_run_id)
    except ObjectNotFound:
        return None
    state = run.state
    labels = dict(run.labels or {})
    stopped = failed_too and state is not None and state.is_final() and not state.is_completed()
    if state is None or (state.type not in ACTIVE and not stopped) or (state_id is not None and state.id != state_id) \
            or (host is not None and labels.get(attempts.HOST_LABEL, host) != host):
        return None  # it moved on since it was judged: ended, requeued, or taken elsewhere
    states = await client.read_flow_run_states(run.id)
    taken, rented, running = _attempt_marks(states, labels)
    if attempts.taken_since_silence(taken, rented, loss.last_heard):
        return None  # another worker has it, and has not labelled it its own yet
    earlier = attempts.rented_losses(s.name or "" for s in states)
    attempt = attempts.attempt_of(labels)
    now = datetime.now(timezone.utc)
    name, team, gpus, latest, basis = await _job_of(worker, run)
    meter = Meter(gpus=int(labels.get(attempts.GPUS_LABEL) or gpus or 0), team=team)
    meter.mark("submitted", scheduled_start(run))
    for step, at in (("picked", taken), ("rented", rented), ("running", running)):
        if at is not None:
            meter.mark(step, at)
    if rented is not None:
        meter.mark("run_ended", max(rented, min(loss.last_heard, now)))
    meter.mark("released", now)
    report = reporting.JobReport(client, run, [], worker.settings.host_name)
    billed = f" Billed to then: {meter.billed_seconds:.0f} s." if rented is not None else ""
    if state.type is StateType.CANCELLING:
        ending = endings.CANCELLED.saying(f"{loss.why} It was being cancelled: it ends Cancelled.{billed}")
    elif rented is None:
        ending = endings.HANDED_BACK.saying(f"{loss.why} Its devices were not handed over yet: nothing of it ran, "
                                            "nothing was billed. Rescheduled.")
    else:
        planned = f" (planned for {basis})" if basis else ""
        verdict = attempts.verdict(loss, True, earlier, worker.settings.host_attempts, now, latest, planned)
        message = f"Attempt {attempt}: {verdict.why}{billed}"
        ending = (endings.lost(loss.kind, verdict.again) if verdict.name in attempts.LOSSES
                  else endings.DEADLINE_MISSED).saying(message)
    if labels.get(attempts.LEASE_LABEL):  # freed first: the new attempt may be taken as soon as it is queued
        with contextlib.suppress(ValueError):
            await quotas.release(client, UUID(str(labels[attempts.LEASE_LABEL])))
    await report.end(ending)
    logger = worker.get_flow_run_logger(run)
    (logger.warning if ending.handed_back else logger.error)(ending.message)
    if ending.handed_back and running is not None and run.empirical_policy.retries is not None:
        # Prefect counts each entry into Running against the run's retries: a loss gives this one back.
        policy = run.empirical_policy.model_copy(update={
            "retries": attempts.retries_after_loss(run.empirical_policy.retries, True)})
        with contextlib.suppress(Exception):
            await client.update_flow_run(run.id, empirical_policy=policy)
    if rented is None:
        await client.update_flow_run_labels(run.id, {attempts.RENTED_LABEL: "", attempts.LEASE_LABEL: ""})
        return ending
    await report.close(meter, name, ending.event, None)
    report.step(ending.event, host=loss.host, last_heard=loss.last_heard.isoformat(), attempt=attempt,
                requeued=ending.handed_back, billed_seconds=round(meter.billed_seconds, 3))
    await client.update_flow_run_labels(run.id, {
        attempts.ATTEMPT_LABEL: attempt + 1, attempts.RENTED_LABEL: "", attempts.LEASE_LABEL: "",
        attempts.EARLIER_BILLED_LABEL: round(attempts.earlier_billed(labels) + meter.billed_seconds, 3)})
    return ending


async def _job_of(worker: Any, run: FlowRun) -> tuple[str, str | None, int, datetime | None, str]:
    """The run's job as a poll reads it: its name, team, GPUs, latest start (by its learned run time) and the
    basis of that plan; a run that cannot be read as a job is planned by nothing (requeued while attempts last)."""
    deployment = None
    if run.deployment_id is not None:
        with contextlib.suppress(ObjectNotFound):
            deployment = await worker.client.read_deployment(run.deployment_id)
    name = job_name(deployment.name if deployment else run.name)
    try:
        waiting, team = await worker._waiting_run(run, deployment, name, {})
    except Exception:
        return name, None, 0, None, ""
    return name, team, waiting.gpus, waiting.latest_start, waiting.basis or ""
