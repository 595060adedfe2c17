"""A job's life while its work runs: watch its bounds and its slots, echo its output.

:class:`Watching` is a part of :class:`e31_prefect.surface.life.JobLife`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path

import anyio
import anyio.abc
from prefect.exceptions import ObjectNotFound

from e31_prefect.host import disk, output_bounds
from e31_prefect.host.ledger import now
from e31_prefect.host.supervision import Supervisor
from e31_prefect.surface import quotas

GONE = ("the flow run is gone from Prefect (deleted while this worker had it); its devices, ledger entry and "
        "workspace are released, and nothing more of it is recorded")


class Watching:
    """The part of :class:`e31_prefect.surface.life.JobLife` that watches the work while it runs."""

    @asynccontextmanager
    async def watching(self, supervisor: Supervisor, labelled: bool = False) -> AsyncIterator[None]:
        """While the work runs: stop it when the run is cancelled, and keep the quota lease renewed.

        A worker run by ``e31 run`` also shows the work's output as it comes. ``labelled``: the run is labelled
        with its hand-over first (for the pool, should this host be lost).
        """
        echo = OutputEcho(self.folder.output_log) if self.worker._only_flow_run_ids is not None else None
        async with anyio.create_task_group() as watchers:
            watchers.start_soon(self._watch, supervisor)
            if labelled:
                watchers.start_soon(self.label_rent)
            if echo is not None:
                watchers.start_soon(echo.follow)
            try:
                yield
            finally:
                watchers.cancel_scope.cancel()
                if echo is not None:
                    echo.flush()

    async def _watch(self, supervisor: Supervisor) -> None:
        renewed: datetime | None = now() if self.lease is not None and self.infrastructure else None
        while True:
            await anyio.sleep(self.worker.settings.watch_seconds)
            if renewed is None or (now() - renewed).total_seconds() > quotas.LEASE_SECONDS / 3:
                with contextlib.suppress(Exception):
                    await self._keep_slots()
                    renewed = now()
            with contextlib.suppress(OSError):  # a folder the job removes while it is counted: counted next time
                if self._passed is None and await self._over_bounds():
                    supervisor.stop()
            if self.device_failure is None and (failed := self.failed_device()) is not None:
                # Its GPU failed its health check: the run is requeued (e31_prefect.surface.life_attempts).
                self.device_failure = failed
                self.log.error("GPU %s failed (%s): stopping the work; the run is requeued", failed[0], failed[1])
                supervisor.stop()
            with contextlib.suppress(Exception):
                state = await self.worker.run_states.state(self.run_id)  # one read for all runs here
                if state is not None and state.is_cancelling():
                    self.log.info("Cancellation requested: stopping the run")
                    supervisor.stop()
                elif state is None and await self._gone_from_prefect():
                    # Deleted while it runs: its work would hold the devices to its time limit, billed to nobody.
                    self.log.warning("Stopping the work: %s", GONE)
                    supervisor.stop()
                    return

    async def _gone_from_prefect(self) -> bool:
        """Whether the flow run itself was deleted from Prefect (a 404 may name something else)."""
        try:
            await self.worker.client.read_flow_run(self.run_id)
        except ObjectNotFound:
            return True
        except Exception:
            return False
        return False

    async def _over_bounds(self) -> bool:
        """Where the output dir is no disk of its own, whether the work wrote past its bounds (then it is stopped)."""
        output_dir = self.workspace / "output"
        if self.bounds is None or os.path.ismount(output_dir):
            return False  # the kernel bounds a disk of its own
        usage = await anyio.to_thread.run_sync(disk.measure, output_dir, self.bounds)
        self._passed = output_bounds.overrun(self.bounds, usage)
        if self._passed is not None:
            self.log.error("%s The work is stopped.", self._passed.message)
        return self._passed is not None

    async def _keep_slots(self) -> None:
        """Renew the run's quota lease; one that expired (its worker died, the API was down longer than a
        lease) is taken again, so a running run counts against its quotas."""
        if self.holding is None or self.holding.gpus == 0:
            return
        if self.lease is not None and await quotas.renew(self.worker.client, self.lease):
            return
        names = quotas.limit_names(self.holding.pool or self.worker._work_pool_name, self.holding.team)
        try:
            self.lease = await quotas.acquire(self.worker.client, names, self.holding.gpus, self.run_id)
        except (quotas.QuotaFull, quotas.OverQuota) as exc:
            self.lease = None
            self.log.warning("This running run holds no quota slots (its lease expired and %s)", exc)
            return
        self.holding.lease = str(self.lease) if self.lease else None
        self._save()


class OutputEcho:
    """The work's output (its supervisor writes it to a file) copied to this process's output as it grows."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0

    def flush(self) -> None:
        """Copy what was written since the last time."""
        try:
            with open(self.path, "rb") as log:
                log.seek(self.offset)
                data = log.read()
        except OSError:
            return
        self.offset += len(data)
        if data:
            sys.stdout.write(data.decode(errors="replace"))
            sys.stdout.flush()

    async def follow(self) -> None:
        """Flush every fraction of a second, until cancelled."""
        while True:
            self.flush()
            await anyio.sleep(0.2)
