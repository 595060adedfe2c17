"""What a job's life tells Prefect: an event per step, named final states, and the closed meter.

Events are ``e31.job.<step>`` about the flow run (related: deployment, flow,
work pool, devices), each following the last, so the event feed and
automations see every job. At release the flow run gets its meter as tags, a
table artifact and a link artifact to its outputs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.actions import ArtifactCreate
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.events import Event, RelatedResource, emit_event
from prefect.states import Cancelled, Completed, Crashed, Failed, Scheduled, State

from e31_prefect.host.inventory import Device
from e31_prefect.model import attempts, endings
from e31_prefect.model import meter as metering
from e31_prefect.model.endings import Ending

# State names of the endings others look for by name (`e31 outputs retry`, the tests).
DEADLINE_MISSED = endings.DEADLINE_MISSED.name
OUTPUT_NOT_SENT = endings.OUTPUT_NOT_SENT.name


def state_of(ending: Ending) -> State:
    """The Prefect state a run that ends this way gets."""
    if ending.state is StateType.SCHEDULED:
        at = datetime.now(timezone.utc) + timedelta(seconds=ending.retry_in_seconds)
        return Scheduled(scheduled_time=at, message=ending.message, name=ending.name)
    if ending.state is StateType.CANCELLED:
        return Cancelled(message=ending.message)
    if ending.state is StateType.CRASHED:
        return Crashed(message=ending.message)
    if ending.state is StateType.COMPLETED:
        return Completed(message=ending.message)
    return Failed(name=ending.name, message=ending.message)


def device_resources(devices: Sequence[Device], host: str) -> list[RelatedResource]:
    """The rented GPUs as related resources of an event: ``e31.gpu.<host>.<index>``."""
    return [
        RelatedResource.model_validate({
            "prefect.resource.id": f"e31.gpu.{host}.{d.index}",
            "prefect.resource.role": "gpu",
            "prefect.resource.name": d.name,
        })
        for d in devices
    ]


def artifact_key(prefix: str, name: str) -> str:
    """An artifact key (lowercase letters, digits, dashes) for a job name."""
    return f"{prefix}-" + re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")


class JobReport:
    """Reports the steps of one flow run's life as events, states and, at the end, its meter."""

    def __init__(self, client: PrefectClient, flow_run: FlowRun, related: list[RelatedResource], host: str):
        self.client = client
        self.flow_run = flow_run
        self.related = related
        self.host = host  # the host's name (E31_HOST_NAME): its devices are e31.gpu.<host>.<index>
        self._last: Event | None = None

    def step(self, step: str, held: Sequence[Device] = (), **payload: Any) -> None:
        """Emit ``e31.job.<step>`` about the flow run, following the previous step."""
        event = emit_event(
            event=f"e31.job.{step}",
            resource={
                "prefect.resource.id": f"prefect.flow-run.{self.flow_run.id}",
                "prefect.resource.name": self.flow_run.name,
            },
            related=[*self.related, *device_resources(held, self.host)],
            payload=payload,
            follows=self._last,
        )
        self._last = event or self._last

    async def fail(self, name: str, message: str) -> State:
        """End the flow run Failed under ``name`` (forced: the worker's verdict is final)."""
        state = Failed(name=name, message=message)
        await self.client.set_flow_run_state(self.flow_run.id, state, force=True)
        return state

    async def end(self, ending: Ending) -> State:
        """Give the flow run the state of ``ending`` (forced: the worker's verdict is final)."""
        state = state_of(ending)
        await self.client.set_flow_run_state(self.flow_run.id, state, force=True)
        return state

    async def close(
        self, meter: metering.Meter, job_name: str, outcome: str | None, outputs: str | None,
        current: FlowRun | None = None,
    ) -> None:
        """Record the closed meter: tags, a table artifact and a link artifact to the outputs. The run's tags
        and labels are ``current``'s, a read of it since its work ended, else read now.

        Each attempt of the run (a lost host's, then its requeue's: its ``e31.attempt`` label) has a meter
        table of its own, ``e31-meter-<job>`` then ``e31-meter-<job>-attempt-<n>``; the tags bill them all.
        """
        if current is None:
            current = await self.client.read_flow_run(self.flow_run.id)
        labels = getattr(current, "labels", None) or {}
        attempt = attempts.attempt_of(labels)
        tags = [t for t in current.tags if not t.startswith("e31")] + metering.tags(
            meter, outcome, attempt, attempts.earlier_billed(labels))
        await self.client.update_flow_run(self.flow_run.id, tags=tags)
        await self.client.create_artifact(ArtifactCreate(
            key=artifact_key("e31-meter", job_name if attempt == 1 else f"{job_name}-attempt-{attempt}"),
            type="table",
            # The UI's artifact card shows only the first ~45 characters: the bill comes first.
            description=f"{meter.billed_gpu_seconds:.3f} GPU-seconds billed: {meter.gpus} GPU(s) x "
            f"{meter.billed_seconds:.3f} s of rent and run"
            + (f", team {meter.team}" if meter.team else "")
            + (f" (E31 meter of {job_name}, attempt {attempt})" if attempt > 1 else f" (E31 meter of {job_name})"),
            data=json.dumps(metering.table(meter)),
            flow_run_id=self.flow_run.id,
        ))
        if outputs:
            await self.client.create_artifact(ArtifactCreate(
                key=artifact_key("e31-outputs", job_name),
                type="markdown",
                description=f"Outputs of {job_name}: {outputs}",
                data=f"[{outputs}]({outputs})",
                flow_run_id=self.flow_run.id,
            ))
