"""After a worker was killed: stop the runs it left behind, close their meters at their last heartbeat.

Called by every e31 worker as it starts. Nothing a dead worker held stays
held: its run's process group or container is stopped, the flow run ends
Crashed (if it had not ended), outputs written so far are sent (or kept in the
spool), and the meter is closed at the last heartbeat, never later.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from uuid import UUID

import anyio
from prefect.client.orchestration import PrefectClient
from prefect.exceptions import ObjectNotFound
from prefect.states import Crashed

from e31_prefect import quotas, reporting
from e31_prefect import spool as spooling
from e31_prefect.blocks import StorageBlockError, storage_options
from e31_prefect.ledger import Holding, Ledger
from e31_prefect.meter import Meter
from e31_prefect.staging import UploadError, remove_workspace, upload_outputs

logger = logging.getLogger("e31.recovery")


def stop_infrastructure(holding: Holding) -> None:
    """Stop what the run was running on: its process group, or its container."""
    if not holding.infrastructure:
        return
    if holding.runtime == "process":
        with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
            os.killpg(int(holding.infrastructure), signal.SIGKILL)
        return
    import docker

    with contextlib.suppress(Exception):
        client = docker.from_env()
        try:
            client.containers.get(holding.infrastructure).remove(force=True)
        finally:
            client.close()


def closing_meter(holding: Holding, now: datetime) -> Meter:
    """The run's meter, its work ended at the last heartbeat (or at rent, if none was recorded)."""
    meter = Meter(gpus=holding.gpus, team=holding.team, devices=list(holding.devices))
    for step, at in holding.marks_as_datetimes().items():
        meter.mark(step, at)
    last_seen = datetime.fromisoformat(holding.heartbeat) if holding.heartbeat else meter.marks.get("rented", now)
    if "rented" in meter.marks:
        meter.mark("run_ended", max(last_seen, meter.marks["rented"]))
    meter.mark("released", now)
    return meter


async def recover(client: PrefectClient, ledger: Ledger, spool: Path) -> list[UUID]:
    """Clean up after every dead worker on this host; returns the flow runs recovered."""
    recovered = []
    for holding in ledger.orphans():
        run_id = UUID(holding.flow_run_id)
        await anyio.to_thread.run_sync(stop_infrastructure, holding)
        if holding.lease:
            await quotas.release(client, UUID(holding.lease))
        now = datetime.now(timezone.utc)
        meter = closing_meter(holding, now)
        try:
            flow_run = await client.read_flow_run(run_id)
        except ObjectNotFound:
            ledger.forget(holding.flow_run_id)
            continue
        last_seen = meter.marks.get("run_ended", now).isoformat(timespec="seconds")
        if flow_run.state is None or not flow_run.state.is_final():
            await client.set_flow_run_state(run_id, Crashed(
                message=f"The e31 worker running this job died (last heartbeat {last_seen}); its "
                "run was stopped, its devices released and its meter closed at that heartbeat."), force=True)
        try:
            options, sendable = await storage_options(holding.storage), True
        except StorageBlockError as exc:
            # Without the job's credentials its outputs cannot be sent now: the spool keeps them,
            # with their destination, for `e31 outputs retry`.
            logger.warning("Outputs of %s go to the spool: %s", run_id, exc)
            options, sendable = None, False
        outputs = await anyio.to_thread.run_sync(_send_what_was_written, holding, spool, options, sendable)
        report = reporting.JobReport(client, flow_run, [])
        await report.close(meter, holding.job_name, "worker-lost", outputs)
        report.step("released", recovered=True, billed_seconds=round(meter.billed_seconds, 3))
        remove_workspace(Path(holding.workspace))
        ledger.forget(holding.flow_run_id)
        logger.warning("Recovered flow run %s left by a dead worker: closed at %s", run_id, last_seen)
        recovered.append(run_id)
    return recovered


def _send_what_was_written(holding: Holding, spool: Path, options: dict[str, Any] | None,
                           sendable: bool) -> str | None:
    output_dir = Path(holding.workspace) / "output"
    if not output_dir.exists() or not any(output_dir.rglob("*")):
        return None
    if holding.destination and sendable:
        with contextlib.suppress(UploadError):
            upload_outputs(output_dir, holding.destination, options, attempts=2)
            return holding.destination
    # The manifest keeps where they were going, so `e31 outputs retry` can send them later.
    return spooling.keep(output_dir, spool, holding.flow_run_id, holding.destination, holding.storage,
                         job_name=holding.job_name,
                         reason="the store did not take them while a dead worker's run was recovered").outputs_url
