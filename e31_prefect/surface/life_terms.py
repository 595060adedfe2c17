"""The terms a job's life is lived by (pure): its scheduled start, its infrastructure id, how its work
ended and its meter from the ledger; and what it needs of the worker that lives it (:class:`LifeWorker`).
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from uuid import UUID

import httpx
from prefect.client.schemas.objects import FlowRun, State

from e31_prefect.host.inventory import Device
from e31_prefect.host.ledger import Holding, Record, now
from e31_prefect.model import endings, timing
from e31_prefect.model.endings import Ending
from e31_prefect.model.job import Job
from e31_prefect.model.job_values import Problem
from e31_prefect.model.meter import Meter, work_end

if TYPE_CHECKING:
    import logging

    from prefect.client.orchestration import PrefectClient

    from e31_prefect.host.inventory import Inventory
    from e31_prefect.host.ledger import Ledger
    from e31_prefect.host.settings import E31Settings
    from e31_prefect.surface.run_states import RunStates


def scheduled_start(flow_run: FlowRun) -> datetime:
    """When Prefect scheduled the run to start (its creation time if it has none)."""
    moment = flow_run.expected_start_time or flow_run.next_scheduled_start_time or flow_run.created
    return timing.utc(moment) if moment else now()


class Ends(Exception):
    """A step ended the run's life."""

    def __init__(self, ending: Ending):
        super().__init__(ending.message)
        self.ending = ending


@dataclasses.dataclass(frozen=True)
class Rental:
    """The devices rented for a run (its quota slots are the life's lease)."""

    devices: list[Device]


def never_ready(why: str, rented: bool, tail: str = "") -> Ending:
    """The ending of a run whose work ended before it was handed its devices: nothing of the job ran."""
    billed = "its devices went back at once" if rented else "nothing was billed"
    return endings.NOT_STARTED.saying(f"The work did not start: {why}. Nothing of the job ran; {billed}."
                                      + (f" Its last output:\n{tail}" if tail else ""))


def judge(record: Record | None, flow_state: State | None, died: Ending, job: Job, tail: str = "") -> Ending | None:
    """The ending a run deserves from how its work ended; None where the flow's own final state stands."""
    if record is None or record.ending is None:
        return died.saying("The run's supervisor left no record of how the work ended; outputs written so far "
                           "were kept.")
    if record.ending == "not-started":
        return endings.NOT_STARTED.saying(f"The work did not start: {record.message or 'unknown reason'}. "
                                          "Nothing ran; the devices went back at once.")
    if record.ending == "timed-out":
        return endings.TIMED_OUT.saying(f"Timed out: stopped at its time limit {record.stop_requested}; outputs "
                                        "written so far were kept.")
    if record.ending == "stopped":
        return endings.CANCELLED.saying("Cancelled while running: stopped, devices released, outputs so far kept.")
    if record.ending == "out-of-memory":
        return endings.OUT_OF_MEMORY.saying(f"Out of memory: the work was killed at its memory limit (request.memory "
                                            f"= {job.request.memory}); outputs written so far were kept.")
    if record.ending == "kept-running":
        # Whatever the job reported: a flow that returned leaves; this one's processes went on.
        return endings.KEPT_RUNNING.saying(
            f"The job said its flow returned ({record.outcome or 'no outcome named'}) at {record.work_ended}, but "
            f"its processes went on and were killed at {record.stop_requested}, after its report grace; it is "
            "billed until then. A flow's threads, children and exit handlers end with it: finish the work before "
            "the flow returns.")
    if flow_state is not None and flow_state.is_final():
        return None
    unreported = endings.reported_by_worker(record.outcome or "") if record.work_ended else None
    if unreported is not None and record.exit_code in (0, 1):
        # The engine named the flow's outcome, could not report it, and its process left on its own.
        return unreported.saying(
            f"The flow returned at {record.work_ended} ({record.outcome}), but its engine could not report it to "
            "the Prefect API in time; e31 reports it. Its outputs were sent.")
    return died.saying(f"The run's {died.name.removesuffix('Died').lower()} died with exit code "
                       f"{record.exit_code} before the flow reported a final state; outputs written so far "
                       "were kept." + (f" Its last output:\n{tail}" if tail else ""))


def infrastructure_id(flow_run_id: UUID | str, host: str) -> str:
    """How e31 names a run's infrastructure to Prefect (``infrastructure_pid``): its host (``E31_HOST_NAME``)
    and flow run.

    The run's supervisor is found from these, whatever the runtime, by the worker's kill_infrastructure.
    """
    return f"e31:{host}:{flow_run_id}"


def parse_infrastructure_id(text: str) -> tuple[str, str]:
    """The host and flow run id in an :func:`infrastructure_id`; InfrastructureNotFound for anything else."""
    from prefect.exceptions import InfrastructureNotFound

    kind, _, rest = text.partition(":")
    host, _, run_id = rest.rpartition(":")
    if kind != "e31" or not host or not run_id:
        raise InfrastructureNotFound(f"{text!r} is not an e31 run's infrastructure id (e31:HOST:FLOW_RUN_ID)")
    return host, run_id


def transient(exc: BaseException) -> bool:
    """Whether a failure is the Prefect API's, likely gone on a later try (unreachable, 5xx)."""
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500
    return isinstance(exc, httpx.TransportError)


def meter_from(holding: Holding, record: Record | None, grace_seconds: float) -> Meter:
    """The run's meter: the worker's marks, and the work's own start and true end from its supervisor."""
    meter = Meter(gpus=holding.gpus, team=holding.team, devices=list(holding.devices))
    for step, at in holding.marks_as_datetimes().items():
        meter.mark(step, at)
    if record is not None and record.ready:
        meter.mark("ready", datetime.fromisoformat(record.ready))
    if record is not None and record.started:
        meter.mark("running", datetime.fromisoformat(record.started))
    if record is not None and record.ended:
        meter.mark("run_ended", work_end(
            datetime.fromisoformat(record.ended),
            datetime.fromisoformat(record.stop_requested) if record.stop_requested else None, grace_seconds))
    return meter


class LifeWorker(Protocol):
    """What a job's life needs of the worker that lives it (:class:`e31_prefect.surface.worker.E31Worker`).

    A Protocol, so that the life (below the worker) never imports the worker (which starts lives).
    """

    name: str
    client: PrefectClient
    settings: E31Settings
    inventory: Inventory
    ledger: Ledger
    meters: dict[UUID, Meter]
    run_states: RunStates
    holds_until: dict[UUID, datetime]
    admitted_latest: dict[UUID, datetime]
    taken_states: dict[UUID, str]
    failed_devices: dict[int, tuple[str, datetime]]
    at_keyboard: bool
    _only_flow_run_ids: set[UUID] | None
    _work_pool_name: str

    def get_flow_run_logger(self, flow_run: FlowRun) -> logging.LoggerAdapter[Any]: ...

    def _event_related_resources(self, configuration: Any = None, include_self: bool = False) -> list[Any]: ...

    def rented(self, run_id: UUID, at: datetime) -> None: ...

    def warm_interpreter(self) -> Any: ...

    def return_devices(self, flow_run_id: UUID) -> None: ...

    def maybe_superseded(self, since: float) -> bool: ...

    async def superseded(self, run_id: UUID, taken: str | None) -> bool: ...

    async def lose_attempt(self, run_id: UUID, loss: Any) -> Any: ...


class LifeConfiguration(Protocol):
    """What a job's life needs of its run's configuration (:class:`e31_prefect.surface.worker.E31JobConfiguration`)."""

    _job_name: str

    def job(self) -> Job: ...

    def setting_problems(self, allowed_volumes: list[Path]) -> list[Problem]: ...


# Refused whatever the runtime: the command and the environment, which a process job would replace too.
REFUSED_IN_EITHER_RUNTIME = ("command",)


class RunRefused(ValueError):
    """A run that cannot start as it was given: every problem of its job and every refused setting, at once."""

    def __init__(self, job_problems: str | None, refused: list[Problem]):
        self.refused = refused
        parts = ["The job is not valid:\n" + job_problems] if job_problems else []
        if refused:
            parts.append("The run's worker settings are not valid:\n" + "\n".join(map(str, refused)))
        super().__init__("\n".join(parts))


def admitted(configuration: LifeConfiguration, allowed_volumes: list[Path]) -> tuple[Job, list[Problem]]:
    """The run's valid job, and the container settings it leaves unused (a process job's, to warn of).

    Raises :class:`RunRefused` naming every problem of the run in one message: its job's fields and the
    settings an e31 pool refuses, so that a user fixes them all in one round trip, not one per run.
    """
    settings = configuration.setting_problems(allowed_volumes)
    try:
        job = configuration.job()
    except ValueError as exc:  # a JobError names each bad field
        work = getattr(configuration, "work", None)  # the raw values: is it a container job, as given?
        image = getattr(configuration, "image", None) or (isinstance(work, dict) and work.get("image"))
        raise RunRefused(str(exc), _refused(settings, bool(image))) from None
    refused = _refused(settings, bool(job.work.image))
    if refused:
        raise RunRefused(None, refused)
    return job, [problem for problem in settings if problem not in refused]


def _refused(problems: list[Problem], container: bool) -> list[Problem]:
    """The settings problems a run's runtime refuses: all of a container's; of a local process, those it would
    replace (the rest it leaves unused)."""
    if container:
        return problems
    return [p for p in problems if p.field in REFUSED_IN_EITHER_RUNTIME or p.field.startswith("env.")]
