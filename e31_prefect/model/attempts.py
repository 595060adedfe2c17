"""A run's attempts: when a host counts as lost, when a cut-off host stops its own work, and what becomes of
an attempt that a lost host or a failed GPU ended. Pure: no clock (pass ``now``), no client.

    E31_HOST_LOST_SECONDS=120 E31_HOST_ATTEMPTS=2 prefect worker start --pool gpu --type e31

The rules, as Slurm's node-failure requeue and Kubernetes' node lease have them:

- every host writes a heartbeat (its workers, and each run's supervisor) every :func:`beat_seconds`;
- a host silent for ``lost_seconds`` is lost: any live worker of the pool ends each of its attempts, billed
  to its last heartbeat, and requeues it if its deadline still allows, at most ``attempts`` rented attempts
  in all (a lost host is not the job's fault: the run's own Prefect retries are left whole);
- a supervisor that has not reached the API for :func:`fence_seconds` (the lost time less a margin) stops its
  work itself, so a cut-off host never runs an attempt the pool has requeued.

An attempt is one take of the run by a worker: the Pending state its worker proposed. A requeue is a state
of its own in the run's history (Scheduled, named after the loss), so whoever held an older attempt finds,
from that history alone, that the run is no longer its own (:func:`superseded`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

# The flow run's labels e31 writes (a job's gateway lets it set none of them): which host holds the current
# attempt, and what the pool needs to close that attempt's meter if the host is lost.
HOST_LABEL = "e31.host"
RENTED_LABEL = "e31.rented"  # when this attempt's devices were handed over ("" before)
GPUS_LABEL = "e31.gpus"
LEASE_LABEL = "e31.lease"  # the attempt's quota lease, freed by whoever ends the attempt
ATTEMPT_LABEL = "e31.attempt"  # the attempt's number, for people and the meter's artifact key
EARLIER_BILLED_LABEL = "e31.billed-earlier-s"  # seconds billed to the run's earlier (lost) attempts

# State names of a requeue after a loss: counted against the run's attempts (a loss before the rent is
# handed back as any run a gone worker held, and costs the run no attempt: nothing of it ran).
HOST_LOST = "HostLost"
DEVICE_FAILED = "DeviceFailed"
LOSSES = (HOST_LOST, DEVICE_FAILED)

FENCE_SHARE = 0.75  # a supervisor cut off for this share of the lost time stops its work
BEATS_PER_LOST = 8  # heartbeats per lost time: a few lost writes never make a host look lost


def beat_seconds(lost_seconds: float) -> float:
    """How often a host's workers and supervisors write its heartbeat."""
    return max(0.2, min(15.0, lost_seconds / BEATS_PER_LOST))


def fence_seconds(lost_seconds: float) -> float:
    """How long a supervisor may go without reaching the API before it stops its work: the lost time less a
    margin (a quarter), in which the work is killed and a clock a little fast does no harm."""
    return lost_seconds * FENCE_SHARE


@dataclass(frozen=True)
class Beat:
    """A host's last heartbeat as the pool reads it: when, and the lost time it was written under."""

    host: str
    at: datetime
    lost_seconds: float


def parse_beat(value: Mapping[str, Any]) -> Beat | None:
    """A heartbeat variable's value back as a :class:`Beat`; None for anything else."""
    try:
        return Beat(str(value["host"]), datetime.fromisoformat(str(value["at"])), float(value["lost_seconds"]))
    except (KeyError, TypeError, ValueError):
        return None


def latest_beats(beats: Iterable[Beat]) -> dict[str, Beat]:
    """Each host's latest heartbeat."""
    latest: dict[str, Beat] = {}
    for beat in beats:
        if beat.host not in latest or beat.at > latest[beat.host].at:
            latest[beat.host] = beat
    return latest


def lost_hosts(beats: Mapping[str, Beat], now: datetime, lost_seconds: float, since: datetime | None = None,
               ) -> dict[str, Beat]:
    """The hosts silent for their lost time (the longer of the pool's and the one the host wrote under: a host
    whose supervisors fence later is waited for longer), each with its last heartbeat.

    ``since``: when the judge last found the API answering after it did not (None: always): a host is
    judged only on silence the judge could have heard, so an API that was down is no lost host.
    """
    found = {}
    for host, beat in beats.items():
        wait = timedelta(seconds=max(lost_seconds, beat.lost_seconds))
        if now - beat.at > wait and (since is None or now - since > wait / 4):
            found[host] = beat
    return found


@dataclass(frozen=True)
class Loss:
    """How an attempt was lost: its host (and device), when it was last heard of, and what the run's page says."""

    kind: str  # HOST_LOST or DEVICE_FAILED
    host: str
    last_heard: datetime  # where its meter closes: the host's last heartbeat, or the device's failure
    why: str  # a sentence: what happened


def rented_losses(state_names: Iterable[str]) -> int:
    """The rented attempts a run lost so far: its requeues after a loss, from its state history's names."""
    return sum(1 for name in state_names if name in LOSSES)


def attempt_of(labels: Mapping[str, Any] | None) -> int:
    """The attempt number the run's labels name (1 where none)."""
    try:
        return max(1, int((labels or {}).get(ATTEMPT_LABEL, 1)))
    except (TypeError, ValueError):
        return 1


def shown_name(name: str, labels: Mapping[str, Any] | None) -> str:
    """A run's name as ``e31 queue`` and the plan show it: with its attempt where it is a later one."""
    attempt = attempt_of(labels)
    return f"{name} (attempt {attempt})" if attempt > 1 else name


def earlier_billed(labels: Mapping[str, Any] | None) -> float:
    """Seconds billed to the run's earlier attempts (0 where none)."""
    try:
        return max(0.0, float((labels or {}).get(EARLIER_BILLED_LABEL, 0) or 0))
    except (TypeError, ValueError):
        return 0.0


@dataclass(frozen=True)
class Verdict:
    """What becomes of a lost attempt's run: requeued (``again``), or ended under ``name`` saying why."""

    again: bool
    name: str  # the state's name: the loss's (a requeue, or the end once its attempts are used), or DeadlineMissed
    why: str


def verdict(loss: Loss, rented: bool, earlier_losses: int, attempts: int, now: datetime,
            latest_start: datetime | None, planned_for: str = "") -> Verdict:
    """Requeue the run as a new attempt if it can still meet its deadline (``latest_start``, planned by its
    learned run time) and has attempts left (``attempts`` rented ones in all); otherwise it ends, saying why.

    A loss before the rent (``rented`` False) used no attempt: nothing of the job ran.
    """
    used = earlier_losses + (1 if rented else 0)
    if rented and used >= attempts:
        return Verdict(False, loss.kind, f"{loss.why} It ran {used} attempt(s), all it may (E31_HOST_ATTEMPTS="
                                         f"{attempts}); it is not requeued.")
    if latest_start is not None and now > latest_start:
        return Verdict(False, "DeadlineMissed",
                       f"{loss.why} It cannot be requeued: to meet its deadline it had to start again by "
                       f"{latest_start.isoformat(timespec='seconds')}{planned_for}.")
    by = f" by {latest_start.isoformat(timespec='seconds')}{planned_for}" if latest_start is not None else ""
    left = attempts - used
    return Verdict(True, loss.kind, f"{loss.why} Requeued as attempt {used + 1}; it starts{by} to meet its deadline "
                                    f"({left} rented attempt(s) left).")


def taken_since_silence(taken: datetime | None, handed_over: datetime | None, last_heard: datetime) -> bool:
    """Whether a run judged lost with its host was taken again after that host fell silent (by another worker,
    that has not labelled it its own yet): its last take is after the host's last heartbeat, and nothing of
    the attempt followed that take. A hand-over (or the flow's start) after the take is the lost host's own
    attempt going on: that host lived past the take, though no heartbeat said so before it was lost."""
    if taken is None or taken <= last_heard:
        return False
    return handed_over is None or handed_over < taken


def retries_after_loss(retries: int | None, was_running: bool) -> int | None:
    """The run's own Prefect retries after a loss: Prefect counts each entry into Running against them, so a
    run that was Running when its host was lost gets that one back (its own failures keep every retry)."""
    if retries is None or not was_running:
        return retries
    return retries + 1


def superseded(states: Sequence[tuple[str, str, str]], taken: str | None) -> bool:
    """Whether the attempt that took the run with the Pending state ``taken`` is no longer the run's, from its
    state history (``(id, type, name)`` oldest first): a later state sent it back to the queue (Scheduled: a
    requeue after a loss, or a hand-back), after which any take is another attempt's; or the pool ended it for a
    loss (its last attempt used: a final state named after the loss). The flow's own retries within its attempt
    (Scheduled states named AwaitingRetry) are its own.
    """
    if taken is None:
        return False
    ids = [state_id for state_id, _, _ in states]
    if taken not in ids:
        return True  # its take is not in the run's history: the run is not the one it took
    return any((kind == "SCHEDULED" and name != "AwaitingRetry") or name in LOSSES
               for _, kind, name in states[ids.index(taken) + 1:])
