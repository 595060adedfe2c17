"""How an E31 run can end, each way named once: its state, its event, its meter tag.

A job's life ends in the flow's own final state (it ran and reported), or in
one of these, set by e31 when the flow could not say it itself: refused before
renting, stopped by its supervisor, or let down by its outputs. Automations,
``e31 usage`` and the meter tags read the same names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from prefect.client.schemas.objects import StateType


@dataclass(frozen=True)
class Ending:
    """One way a run ends: the state it gets (by type and name), its ``e31.job.<event>`` and its message."""

    name: str  # the state's name, e.g. TimedOut
    event: str  # e31.job.<event>, and the meter tag e31:<event>
    state: StateType
    message: str = ""
    retry_in_seconds: float = 0.0  # for a run handed back to the pool: when it may be taken again
    billed: bool = True  # False: refused before anything was rented

    @property
    def tag(self) -> str:
        """The flow run's tag that names this ending."""
        return f"e31:{self.event}"

    @property
    def handed_back(self) -> bool:
        """Whether the run goes back to the pool rather than ending."""
        return self.state is StateType.SCHEDULED

    def saying(self, message: str, retry_in_seconds: float = 0.0) -> Ending:
        """This ending, with what happened to this run (and, handed back, when it may be taken again)."""
        return replace(self, message=message, retry_in_seconds=retry_in_seconds)

    def is_(self, other: Ending) -> bool:
        """Whether this is that way of ending, whatever its message."""
        return self.name == other.name and self.event == other.event


# Refused before any GPU was rented: billed nothing.
DEADLINE_MISSED = Ending("DeadlineMissed", "deadline-missed", StateType.FAILED, billed=False)
INVALID_JOB = Ending("InvalidJob", "invalid-job", StateType.FAILED, billed=False)
STAGING_FAILED = Ending("StagingFailed", "staging-failed", StateType.FAILED, billed=False)
NO_CONTAINER_ENGINE = Ending("NoContainerEngine", "no-container-engine", StateType.FAILED, billed=False)
HOST_CANNOT_RUN = Ending("HostCannotRun", "host-cannot-run", StateType.FAILED, billed=False)
OVER_QUOTA = Ending("OverQuota", "over-quota", StateType.FAILED, billed=False)
HANDED_BACK = Ending("Scheduled", "handed-back", StateType.SCHEDULED, billed=False)

# Ended by its supervisor or by what the work left.
TIMED_OUT = Ending("TimedOut", "timed-out", StateType.FAILED)
CANCELLED = Ending("Cancelled", "cancelled", StateType.CANCELLED)
OUT_OF_MEMORY = Ending("OutOfMemory", "out-of-memory", StateType.FAILED)
PROCESS_DIED = Ending("ProcessDied", "process-died", StateType.FAILED)
CONTAINER_DIED = Ending("ContainerDied", "container-died", StateType.FAILED)
NOT_STARTED = Ending("NotStarted", "not-started", StateType.FAILED)
REPORTED_BY_WORKER = Ending("Completed", "completed-unreported", StateType.COMPLETED)


def reported_by_worker(outcome: str) -> Ending | None:
    """The ending e31 reports for a flow whose engine named its outcome as the flow returned but could not
    report it (the API did not answer): the same state, reported by the worker. None for an unknown word."""
    state = {"completed": StateType.COMPLETED, "failed": StateType.FAILED, "crashed": StateType.CRASHED,
             "cancelled": StateType.CANCELLED}.get(outcome)
    if state is None:
        return None
    return replace(REPORTED_BY_WORKER, name=state.value.title(), event=f"{outcome}-unreported", state=state)


# Said its flow returned, then did not end within its report grace: killed, billed until its last process went.
KEPT_RUNNING = Ending("KeptRunning", "kept-running", StateType.FAILED)
OUTPUT_MISSING = Ending("OutputMissing", "output-missing", StateType.FAILED)
OUTPUT_NOT_SENT = Ending("OutputNotSent", "output-not-sent", StateType.FAILED)
DISK_LIMIT = Ending("DiskLimit", "disk-limit", StateType.FAILED)
TOO_MANY_OUTPUTS = Ending("TooManyOutputs", "too-many-outputs", StateType.FAILED)
WORKER_FAILED = Ending("Crashed", "worker-failed", StateType.CRASHED)

# Lost with its host, or on a GPU that failed (e31_prefect.model.attempts): not the job's fault. Billed to the host's
# last heartbeat (the device's failure), then requeued as a new attempt (a Scheduled state of that name), or
# ended so once the run's attempts are used.
HOST_LOST = Ending("HostLost", "host-lost", StateType.SCHEDULED)
DEVICE_FAILED = Ending("DeviceFailed", "device-failed", StateType.SCHEDULED)


# An attempt the pool requeued while its host was cut off or lost: its host reports nothing of it (never a state).
SUPERSEDED = Ending("Superseded", "superseded", StateType.SCHEDULED, billed=False)


def lost(name: str, again: bool) -> Ending:
    """The ending of an attempt lost under ``name`` (HostLost, DeviceFailed): requeued, or the run's end."""
    ending = next(e for e in (HOST_LOST, DEVICE_FAILED) if e.name == name)
    return ending if again else replace(ending, state=StateType.FAILED)

ALL = (DEADLINE_MISSED, INVALID_JOB, STAGING_FAILED, NO_CONTAINER_ENGINE, HOST_CANNOT_RUN, OVER_QUOTA,
       HANDED_BACK, TIMED_OUT, CANCELLED, OUT_OF_MEMORY, PROCESS_DIED, CONTAINER_DIED, NOT_STARTED,
       REPORTED_BY_WORKER, KEPT_RUNNING, OUTPUT_MISSING, OUTPUT_NOT_SENT, DISK_LIMIT, TOO_MANY_OUTPUTS, WORKER_FAILED,
       HOST_LOST, DEVICE_FAILED, SUPERSEDED)
