"""A job's life as one attempt of its run: what the pool needs to end it if its host is lost, and what this
host does when its attempt was lost, or requeued while it was cut off.

A pool's worker labels the run with its attempt's hand-over (when, how many GPUs, its quota lease), so that any
worker of the pool can close the attempt's meter and free its slots should this host be lost
(:mod:`e31_prefect.surface.lost_attempts`). When the attempt's work was stopped by its fence (this host was
cut off) or its supervisor died with it, this host ends the attempt itself, the same way, unless the pool
already requeued the run: then this attempt is no longer the run's, and nothing this host says overrides
the new one. It keeps what the work wrote in its spool (``$E31_HOME/spool/superseded/<run>-attempt-<n>/``,
never sent: the run's outputs are the new attempt's), says so in the run's log, and writes nothing else.

:class:`Attempts` is a part of :class:`e31_prefect.surface.life.JobLife`.
"""

from __future__ import annotations

import contextlib
from datetime import datetime
from typing import Any

import anyio
from prefect.exceptions import ObjectNotFound

from e31_prefect.host.heartbeat import read_lease
from e31_prefect.host.ledger import Record, now
from e31_prefect.model import attempts, endings
from e31_prefect.model.attempts import Loss
from e31_prefect.model.endings import Ending
from e31_prefect.surface import spool
from e31_prefect.surface.life_terms import transient

SUPERSEDED_SPOOL = "superseded"


class Attempts:
    """The part of :class:`e31_prefect.surface.life.JobLife` that knows its run's attempt."""

    async def label_rent(self) -> None:
        """Label the run with this attempt's hand-over, GPUs and quota lease (for the pool, should this host be
        lost); in the background, after the meter started, so it costs the run nothing."""
        if self.worker.settings.host_lost_seconds <= 0 or "rented" not in self.meter.marks:
            return
        labels = {attempts.RENTED_LABEL: self.meter.marks["rented"].isoformat(), attempts.GPUS_LABEL: len(self.devices),
                  attempts.LEASE_LABEL: str(self.lease) if self.lease else ""}
        for pause in (1, 2, 5, 10, None):
            try:
                await self.worker.client.update_flow_run_labels(self.run_id, labels)
                return
            except Exception as exc:
                if pause is None or not transient(exc):
                    self.log.warning("The run's hand-over could not be labelled (%s): were this host lost, the pool "
                                     "would bill its attempt from the flow's start", exc)
                    return
                await anyio.sleep(pause)

    async def still_ours(self, always: bool = False) -> bool:
        """Whether the run is still this attempt's. Its history is read only where this worker may have been cut
        off long enough for the pool to requeue it (or ``always``: a worker adopting it after a restart)."""
        if self.superseded:
            return False
        if self.taken is None or not (always or self.worker.maybe_superseded(self.taken_at)):
            return True
        try:
            self.superseded = await self.worker.superseded(self.run_id, self.taken)
        except ObjectNotFound:
            return True  # deleted: the life's own paths say so
        except Exception as exc:
            if not transient(exc):
                raise
            return True  # the API is down: whatever this life writes next waits for it, and asks again then
        return not self.superseded

    def stand_down(self) -> Ending:
        """This attempt is no longer the run's (the pool requeued it): keep what its work wrote in this host's
        spool, say so in the run's log, and write nothing else of it to Prefect."""
        where = self._keep_outputs("Superseded", "the run was requeued elsewhere while this host was cut off or lost")
        self.log.warning("Attempt %s of this run on host %s was requeued elsewhere by the pool while this host was "
                         "cut off or lost; the new attempt is the run's. Nothing of this one is reported: %s.",
                         self.attempt, self.worker.settings.host_name, where)
        return endings.SUPERSEDED

    def failed_device(self) -> tuple[int, str, datetime] | None:
        """One of the run's devices that failed its health check (its index, why and when), if any."""
        failed = self.worker.failed_devices
        return next(((d.index, *failed[d.index]) for d in self.devices if d.index in failed), None)

    async def lost_here(self, record: Record | None) -> Ending | None:
        """Where this host lost the attempt itself (its GPU failed; its fence stopped the work; its supervisor died
        with it), end it as the pool ends a lost host's: billed to its last heartbeat (to the GPU's failure),
        requeued where it may be. None: it was not lost. A run already requeued is stood down; one whose flow
        reported its end before keeps it (a failed GPU's run, unless it completed)."""
        fenced = record is not None and record.ending == "fenced"
        failure = self.device_failure
        if failure is None and not fenced and not self.supervisor_died:
            return None
        if not await self.still_ours(always=True):
            return self.stand_down()
        state = (await self.worker.client.read_flow_run(self.run_id)).state
        if state is not None and state.is_final() and (failure is None or state.is_completed()):
            return None  # its flow reported its end before: that stands
        _, reached = read_lease(self.folder.path)
        last = reached or self._last_mark()
        host = self.worker.settings.host_name
        if failure is not None:
            index, reason, last = failure
            loss = Loss(attempts.DEVICE_FAILED, host, last, f"GPU {index} of host {host} failed at "
                        f"{last.isoformat(timespec='seconds')} ({reason}); it is drained, and the run's work was "
                        "stopped.")
        elif fenced:
            loss = Loss(attempts.HOST_LOST, host, last, f"Host {host} was cut off from the Prefect API: its last "
                        f"heartbeat reached it at {last.isoformat(timespec='seconds')}, and the run's work was "
                        "stopped (fenced) so that it never runs in two places.")
        else:
            loss = Loss(attempts.HOST_LOST, host, last, f"The run's supervisor on host {host} died with its work "
                        f"(last heartbeat at {last.isoformat(timespec='seconds')}).")
        if await self.worker.lose_attempt(self.run_id, loss) is None:
            return self.stand_down()  # the pool ended it first
        where = self._keep_outputs(loss.kind, loss.why)
        self.log.warning("%s Its outputs are not sent: %s.", loss.why, where)
        return endings.SUPERSEDED

    def _keep_outputs(self, state: str, reason: str) -> str:
        """Keep what a lost attempt's work wrote in this host's spool, never to be sent; where they are."""
        self.superseded = True
        output_dir = self.workspace / "output"
        with contextlib.suppress(OSError):
            if output_dir.exists() and any(output_dir.iterdir()):
                kept = spool.keep(output_dir, self.worker.settings.spool / SUPERSEDED_SPOOL,
                                  f"{self.run_id}-attempt-{self.attempt}", None, None, self.job_name, state, reason)
                return f"its outputs are kept at {kept.outputs} on host {self.worker.settings.host_name}"
        return "it wrote no outputs"

    def _last_mark(self) -> datetime:
        marks = self.meter.marks
        return max(marks.values()) if marks else now()

    @staticmethod
    def attempt_of(flow_run: Any) -> int:
        """The attempt number the run carried when it was taken."""
        return attempts.attempt_of(getattr(flow_run, "labels", None))
