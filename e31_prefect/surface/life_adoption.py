"""A job's life adopted from the host's ledger: a run whose worker died (or whose host went down and came back),
finished from the step its ledger folder reached.

A worker that starts, and every worker at each heartbeat, adopts the runs in its host's ledger that no live
worker owns. A run the pool requeued meanwhile (its host was lost or cut off for ``E31_HOST_LOST_SECONDS``) is
no longer this host's: whatever is left of its work is stopped, its outputs are kept in the spool and nothing
of it is reported. A run whose supervisor died with its work (the host went down and came back sooner) is a
lost attempt of this host: it is ended as the pool ends one, and requeued where it may be.

:class:`Adoption` is a part of :class:`e31_prefect.surface.life.JobLife`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any
from uuid import UUID

import anyio
from prefect.exceptions import ObjectNotFound

from e31_prefect.data.blocks import StorageBlockError, load_job_storage
from e31_prefect.host import cgroups
from e31_prefect.host.inventory import Device
from e31_prefect.host.ledger import Record, RunFolder, now
from e31_prefect.host.output_bounds import OutputBounds
from e31_prefect.host.supervision import Supervisor
from e31_prefect.model import endings
from e31_prefect.model.endings import Ending
from e31_prefect.model.job import Job
from e31_prefect.surface.life_terms import LifeWorker, meter_from


class Adoption:
    """The part of :class:`e31_prefect.surface.life.JobLife` that finishes a run another worker left."""

    @classmethod
    async def adopt(cls, worker: LifeWorker, folder: RunFolder, owner: int) -> Ending | None:
        """Finish the life of a run whose worker died, from the step its ledger folder reached.

        ``owner``: the run's owner lock, taken by the adopting worker.
        """
        holding = folder.holding()
        try:
            flow_run = await worker.client.read_flow_run(UUID(folder.run_id))
        except (ObjectNotFound, ValueError):
            flow_run = None
        except BaseException:
            os.close(owner)  # the API is down: the next sweep adopts it again (a lock kept here never would be)
            raise
        if holding is None or flow_run is None:
            _stop_leftovers(folder)
            worker.ledger.forget(folder.run_id)
            os.close(owner)
            return None
        life: Any = cls(worker, flow_run, None, owner=owner)  # type: ignore[call-arg]
        try:
            life.job_name, life.holding = holding.job_name, holding
            life.taken, life.attempt = holding.taken, holding.attempt
            life.workspace = Path(holding.workspace)
            life.lease = UUID(holding.lease) if holding.lease else None
            with contextlib.suppress(TypeError):
                life.bounds = OutputBounds(**holding.output_bounds) if holding.output_bounds else None
            life.meter = meter_from(holding, folder.record(), worker.settings.stop_grace_seconds)
            life.log.warning("Adopting this run, left by a worker that is gone (pid %s)", holding.worker_pid)
            if not await life.still_ours(always=True):
                # Requeued by the pool while this host was cut off or down: whatever is left of it stops here.
                supervisor = Supervisor(folder)
                if supervisor.alive():
                    supervisor.stop()
                    with anyio.move_on_after(60):
                        await supervisor.wait()
                _stop_leftovers(folder)
                ending = life.stand_down()
            elif "rented" not in holding.marks:  # never handed its devices: its supervisor, if any, ends the work
                with anyio.move_on_after(60):
                    await Supervisor(folder).wait()
                _stop_leftovers(folder)  # and whatever a supervisor that died first left
                ending = await life._never_started()
            else:
                ending = await life._resume(folder, Job.model_validate(holding.job))
            # The slots go back with the devices, before the meter is recorded, as in a run's own life:
            # a worker stopped once the run's tags are written holds nothing of it.
            await life._release_lease()
            await life.release(ending)
            return ending
        except BaseException:
            life._let_go()  # whatever failed, the next sweep adopts it again (a lock kept here never would be)
            raise

    async def _never_started(self) -> Ending | None:
        """Taken (perhaps rented), never handed its devices: nothing of the job ran. The run goes back to the
        pool."""
        state = await self._flow_state()
        if state is not None and state.is_final():
            return None
        ending = endings.HANDED_BACK.saying("The e31 worker that took it is gone; nothing of it ran. Rescheduled.")
        await self._set_state(ending)
        return ending

    async def _resume(self, folder: RunFolder, job: Job) -> Ending | None:
        try:
            self.storage = await load_job_storage(job.storage, job.team) if job.storage else None
            self.options = self.storage.fsspec_options() if self.storage else None
        except StorageBlockError as exc:
            self.log.warning("Outputs of this run may go to the spool: %s", exc)
        supervisor = Supervisor(folder)
        if supervisor.alive():
            async with self.watching(supervisor):
                record = await supervisor.wait()
        else:
            record = folder.record()
            if record is None or not record.finished:
                # The supervisor itself died (its host went down with it, say): whatever it left runs
                # unbounded, so it goes now, and the attempt is this host's loss.
                _stop_leftovers(folder)
                record = record or Record()
                record.ended, record.ending = now().isoformat(), "exited"
                record.message = "the run's supervisor died; its work was stopped by the adopting worker"
                self.supervisor_died = record.started is not None
        if record.ending == "not-started" and not record.started:
            return await self._never_started()  # its worker died between the rent and the hand-over
        if (lost := await self.lost_here(record)) is not None:
            return lost
        self.devices = [Device(index, "GPU") for index in (self.holding.devices if self.holding else [])]
        died = endings.CONTAINER_DIED if self.holding and self.holding.runtime == "container" else \
            endings.PROCESS_DIED
        if "output" in self.meter.marks:
            return None
        return await self.after_work(job, record, died)


def _stop_leftovers(folder: RunFolder) -> None:
    """Kill what a run whose supervisor is gone left running: its cgroup, or its container."""
    record = folder.record()
    holding = folder.holding()
    if record is not None:
        cgroups.kill_path(record.cgroup)
    if holding is not None and holding.runtime == "container":
        with contextlib.suppress(Exception):
            import docker
            from e31_prefect.runtimes.container import RUN_LABEL

            client = docker.from_env(timeout=30)
            try:
                for container in client.containers.list(
                        all=True, filters={"label": f"{RUN_LABEL}={folder.run_id}"}):
                    container.remove(force=True)
            finally:
                client.close()
