"""The pool's watch over its hosts: each worker writes its host's heartbeat, and ends the attempts of hosts
that stopped (:mod:`e31_prefect.surface.lost_attempts`).

    E31_HOST_LOST_SECONDS=120 prefect worker start --pool gpu --type e31

Every :func:`~e31_prefect.model.attempts.beat_seconds` a pool's worker writes its host's heartbeat variable
(:mod:`e31_prefect.host.heartbeat`; the runs' supervisors write it too), reads every host's in one call, and,
where a host has been silent for ``E31_HOST_LOST_SECONDS``, reads the pool's active runs and ends those that
host held. A host's own worker, as it starts, also ends the runs its host held that no ledger of it knows
(its ``E31_HOME`` was wiped with the host): nothing else would ever end them.

A worker knows when it itself may have been cut off long enough for the pool to requeue its runs (its own
heartbeats stopped reaching the API for a fence time): only then does a run it lives read its history to
learn whether it is still its own (:meth:`HostWatching.superseded`).

:class:`HostWatching` is a part of :class:`e31_prefect.surface.worker.E31Worker`.
"""

from __future__ import annotations

import contextlib
import functools
import time
from datetime import datetime, timezone
from typing import Any
from uuid import UUID

import anyio

from e31_prefect.host import device_health
from e31_prefect.host.device_health import NvmlHealth
from e31_prefect.host.heartbeat import write_host_reached
from e31_prefect.model import attempts
from e31_prefect.model.attempts import Beat, Loss
from e31_prefect.surface import drains, hosts_table
from e31_prefect.surface.beats import read_active_runs, read_beats, write_beat
from e31_prefect.surface.lost_attempts import end_lost_attempt, pool_turn
from e31_prefect.surface.plan_artifact import PlanWriter

TURN_TRIES = 30  # a host ending its own lost attempt waits this many seconds at most for the pool's turn


class HostWatching:
    """The part of :class:`e31_prefect.surface.worker.E31Worker` that keeps its host's heartbeat and ends the
    attempts of lost hosts."""

    def _init_host_watch(self) -> None:
        self.taken_states: dict[UUID, str] = {}  # each run's take (its Pending state), until its life starts
        self.failed_devices: dict[int, tuple[str, datetime]] = {}  # this host's GPUs that failed, why and when
        self._nvml: NvmlHealth | None = None
        self._health_at = -float("inf")  # when the devices' health was last checked (monotonic)
        self._watch_scope: anyio.CancelScope | None = None  # cancelled as the worker stops
        self.hosts_writer = PlanWriter(self.settings.plan_artifact_seconds)  # the e31-hosts-<pool> artifact
        self._beat_ok: float | None = None  # when this worker's heartbeat last reached the API (monotonic)
        self._gap_ended: float = -float("inf")  # when a silence of a fence time or more last ended (monotonic)
        self._api_back: datetime | None = None  # when the API answered again after it did not
        self._earlier_beat: Beat | None = None  # this host's heartbeat before this worker's first
        self._reconciled = False  # this host's runs unknown to its ledger were ended (once, as it starts)

    # -- this worker's own heartbeat --------------------------------------------------------------

    @property
    def _lost_seconds(self) -> float:
        return self.settings.host_lost_seconds

    def maybe_superseded(self, since: float) -> bool:
        """Whether this worker may have been silent long enough, since ``since`` (monotonic), for the pool to have
        requeued a run it lives: its heartbeat stopped reaching the API for a fence time or more."""
        if self._lost_seconds <= 0:
            return False
        fence = attempts.fence_seconds(self._lost_seconds)
        last = self._beat_ok if self._beat_ok is not None else since
        return self._gap_ended >= since or time.monotonic() - max(last, since) >= fence

    async def superseded(self, run_id: UUID, taken: str | None) -> bool:
        """Whether the run's attempt taken with state ``taken`` is no longer the run's (its history says a lost
        host's requeue or another take came after it)."""
        if taken is None:
            return False
        states = await self.client.read_flow_run_states(run_id)
        return attempts.superseded([(str(s.id), s.type.value, s.name or "") for s in states], taken)

    async def watch_hosts(self) -> None:
        """Write this host's heartbeat and judge the pool's hosts, every beat; check this host's GPUs and read its
        drains; until the worker stops."""
        every = min(attempts.beat_seconds(self._lost_seconds) if self._lost_seconds > 0 else 15.0,
                    self.settings.gpu_health_seconds)
        with anyio.CancelScope() as self._watch_scope:
            if self.settings.gpus is None and self.inventory.devices:
                self._nvml = await anyio.to_thread.run_sync(NvmlHealth, self.inventory.devices)
            while True:
                if self._lost_seconds > 0:
                    with contextlib.suppress(Exception):
                        await self._beat_and_judge()
                try:
                    await self.watch_devices()
                except Exception as exc:
                    self._logger.warning("Could not check or read this host's drained GPUs: %s", exc)
                await anyio.sleep(every)

    def stop_watching_hosts(self) -> None:
        """The worker stops: so does its watch (its runs' supervisors go on writing the host's heartbeat)."""
        if self._watch_scope is not None:
            self._watch_scope.cancel()

    async def watch_devices(self) -> None:
        """Check the GPUs' health when due (a failed one is drained, and its run stopped by its life), then take
        in the host's drains (an operator's, and those of failed devices)."""
        host = self.settings.host_name
        if time.monotonic() - self._health_at >= self.settings.gpu_health_seconds and (
                self.settings.gpu_health_command or self._nvml is not None):
            self._health_at = time.monotonic()
            found = await anyio.to_thread.run_sync(device_health.problems, self.inventory.devices,
                                                   self.settings.gpu_health_command, self._nvml)
            for index, reason in found.items():
                if index not in self.failed_devices:
                    self._logger.error("GPU %s of host %s failed its health check (%s): drained", index, host, reason)
                    self.failed_devices[index] = (reason, datetime.now(timezone.utc))
                    await drains.change(self.client, host, str(index), reason, "health")
        drained = drains.by_index(await drains.read(self.client, host), [d.index for d in self.inventory.devices])
        for index in [index for index in self.failed_devices if index not in drained]:
            del self.failed_devices[index]  # undrained by an operator: its next check says again if it fails
        self.inventory.set_drained(drained)
        if self.hosts_writer.due():  # the pool's hosts, in the UI (e31 hosts prints the same)
            self.hosts_writer.start(self._hosts_artifact)

    async def _hosts_artifact(self) -> tuple[list[dict[str, str]], Any]:
        table = await hosts_table.read_rows(self.client, self._work_pool_name, self._lost_seconds)
        return table, functools.partial(hosts_table.write, self.client, self._work_pool_name)

    async def _beat_and_judge(self) -> None:
        host, now = self.settings.host_name, datetime.now(timezone.utc)
        try:
            if self._beat_ok is None and self._earlier_beat is None:
                self._earlier_beat = (await read_beats(self.client)).get(host)  # its last life's, if any
            await write_beat(self.client, host, now, self._lost_seconds)
        except Exception as exc:
            if self._api_back is not None or self._beat_ok is not None:
                self._logger.warning("This host's heartbeat did not reach the Prefect API: %s", exc)
            self._api_back = None
            return
        with contextlib.suppress(OSError):  # every run's fence on this host counts from it too
            write_host_reached(self.settings.home.expanduser(), now)
        at = time.monotonic()
        if self._beat_ok is not None and at - self._beat_ok >= attempts.fence_seconds(self._lost_seconds):
            self._gap_ended = at
        self._beat_ok = at
        if self._api_back is None:
            self._api_back = now
        await self.judge_hosts()

    # -- judging the pool's hosts -----------------------------------------------------------------

    async def judge_hosts(self) -> list[UUID]:
        """End the attempts of the pool's lost hosts, and (once, as this worker starts) its own host's runs no
        ledger here knows; returns the runs ended."""
        if self._work_pool is None:
            return []
        host, now = self.settings.host_name, datetime.now(timezone.utc)
        beats = await read_beats(self.client)
        others = {name: beat for name, beat in beats.items() if name != host}
        lost = attempts.lost_hosts(others, now, self._lost_seconds, self._api_back)
        if not lost and self._reconciled:
            return []
        ended: list[UUID] = []
        async with pool_turn(self.client, self._work_pool_name) as mine:
            if not mine:
                return []  # another worker of the pool judges now
            for run in await read_active_runs(self.client, self._work_pool_name):
                loss = await self._loss_of(run, lost, now)
                if loss is None:
                    continue
                held = str((run.labels or {}).get(attempts.HOST_LABEL))
                self._logger.warning("Flow run %s: %s", run.id, loss.why)
                if await end_lost_attempt(self, run.id, loss, held, run.state.id if run.state else None):
                    ended.append(run.id)
            self._reconciled = True
        return ended

    async def _loss_of(self, run: Any, lost: dict[str, Beat], now: datetime) -> Loss | None:
        held = (run.labels or {}).get(attempts.HOST_LABEL)
        if not held:
            return None  # not held by a pool's worker (`e31 run`, an @e31 call): its caller lives it
        if held in lost:
            beat = lost[held]
            return Loss(attempts.HOST_LOST, held, beat.at,
                        f"Host {held} was lost: no heartbeat since {beat.at.isoformat(timespec='seconds')} "
                        f"(E31_HOST_LOST_SECONDS={max(self._lost_seconds, beat.lost_seconds):.0f}).")
        if held != self.settings.host_name or self._reconciled or run.id in self._living \
                or run.id in self._submitting_flow_run_ids or self.ledger.folder(str(run.id)).holding() is not None:
            return None
        # This host's, unknown to its ledger: its E31_HOME went with the host (a host started again, wiped).
        worker = (run.labels or {}).get("prefect.worker.name")
        if worker not in (None, self.name) and await self._worker_online(worker):
            return None  # another live worker of this host has it, with a home of its own
        last = self._earlier_beat.at if self._earlier_beat is not None else now
        return Loss(attempts.HOST_LOST, held, min(last, now),
                    f"Host {held} was lost and started again without the run in its ledger (E31_HOME wiped); "
                    f"its last heartbeat before was at {last.isoformat(timespec='seconds')}.")

    async def _worker_online(self, name: str) -> bool:
        with contextlib.suppress(Exception):
            for worker in await self.client.read_workers_for_work_pool(self._work_pool_name):
                if worker.name == name:
                    return str(getattr(worker.status, "value", worker.status)).upper() == "ONLINE"
        return False

    async def lose_attempt(self, run_id: UUID, loss: Loss) -> Any:
        """End a run's attempt that this host lost itself (its fence stopped the work, its GPU failed), in the
        pool's turn; its ending, or None where the run moved on."""
        for _ in range(TURN_TRIES):
            async with pool_turn(self.client, self._work_pool_name) as mine:
                if mine:
                    return await end_lost_attempt(self, run_id, loss, self.settings.host_name,
                                                  failed_too=loss.kind == attempts.DEVICE_FAILED)
            await anyio.sleep(1)
        return None
