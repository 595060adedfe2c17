"""A job's life after its work: judge how it ended, then send its outputs.

:class:`Sending` is a part of :class:`e31_prefect.surface.life.JobLife`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from prefect.client.schemas.objects import State

from e31_prefect.data import results
from e31_prefect.data.staging import UploadError, missing_outputs, upload_outputs
from e31_prefect.host import disk, output_bounds
from e31_prefect.host.ledger import Record, now, output_tail
from e31_prefect.model import endings
from e31_prefect.model.endings import Ending
from e31_prefect.model.job import Job
from e31_prefect.surface import reporting, spool
from e31_prefect.surface.life_terms import Ends, judge, meter_from, scheduled_start


class Sending:
    """The part of :class:`e31_prefect.surface.life.JobLife` from the work's end to its outputs sent."""

    @asynccontextmanager
    async def output_disk(self) -> AsyncIterator[None]:
        """The run's output dir as a disk of its own (:mod:`e31_prefect.host.disk`) from staging until its outputs
        are sent, where the host allows; else the worker's watch bounds what the work writes.

        Unmounted once the outputs are sent or kept. A life that ends otherwise (a step failed, the worker
        is stopping, the API is down) leaves it to the removal of the workspace, which unmounts it where
        the run is released, here or by the worker that adopts it: its outputs may still be to send.
        """
        output_dir = self.workspace / "output"
        output_dir.mkdir(parents=True, exist_ok=True)
        why_not = disk.can_mount() if self.bounds is not None else "no bounds"
        if why_not is None and not os.path.ismount(output_dir):
            try:
                await anyio.to_thread.run_sync(disk.mount, self.workspace, output_dir, self.bounds)
            except disk.DiskError as exc:
                why_not = str(exc)
        if why_not is not None:
            self.log.info("The output dir is not a disk of its own (%s): the worker watches its size and files",
                          why_not)
        yield
        await anyio.to_thread.run_sync(disk.unmount_under, self.workspace)


    # -- judge and send ---------------------------------------------------------------------------

    async def after_work(self, job: Job, record: Record | None, died: Ending) -> Ending | None:
        """Judge how the work ended, then send its outputs (which may end the run in turn)."""
        assert self.holding is not None
        self.meter = meter_from(self.holding, record, self.worker.settings.stop_grace_seconds)
        self.worker.meters[self.run_id] = self.meter
        self._save()
        self.after_work_run = await self.worker.client.read_flow_run(self.run_id)
        state = self.after_work_run.state
        ending = judge(record, state, died, job, output_tail(self.folder.output_log))
        passed = await self._bound_passed()
        stopped_for_it = self._passed is not None or (record is not None and record.ending == "output-bound")
        if passed is not None and (output_bounds.stops_ending(ending) or stopped_for_it):
            ending = passed
        if ending is not None:
            self.report.step(ending.event, self.devices)
            state = await self._set_state(ending) or state
        sent = await self.send(job, state)
        if sent is not None:
            await self._set_state(sent)
        return sent or ending

    async def _bound_passed(self) -> Ending | None:
        """The ending for a bound the work passed (its disk, its number of outputs), if it did."""
        if self.bounds is None:
            return self._passed
        usage = await anyio.to_thread.run_sync(disk.measure, self.workspace / "output", self.bounds)
        return output_bounds.overrun(self.bounds, usage) or self._passed

    async def _flow_state(self) -> State | None:
        return (await self.worker.client.read_flow_run(self.run_id)).state

    async def send(self, job: Job, state: State | None) -> Ending | None:
        """Send the output dir to its destination; keep it in the spool if the store will not take it.
        ``state`` is the run's as its work left it (or as this worker judged it).

        Only the job's own files go (regular files with one name); a link or special file it left is
        not followed, and the log, the ``output`` event, an artifact and the run's final message name it.
        """
        from e31_prefect.data import confine

        assert self.holding is not None
        output_dir = self.workspace / "output"
        destination = self.holding.destination or self._destination(job)
        try:
            sent = await anyio.to_thread.run_sync(functools.partial(
                upload_outputs, output_dir, destination, self.options, 3, 1.0, self.log, **self._send_bounds()),
                abandon_on_cancel=True)
        except UploadError as exc:
            bounded = self._send_bounds()
            kept = await anyio.to_thread.run_sync(functools.partial(
                spool.keep, output_dir, self.worker.settings.spool, str(self.run_id), destination, job.storage,
                job.name, state.name if state else None, str(exc), bounded["max_entries"], bounded["max_bytes"]))
            self.holding.destination = kept.outputs_url
            await spool.record_kept(self.worker.client, self.run_id, kept)
            return endings.OUTPUT_NOT_SENT.saying(kept.message())
        self.meter.mark("output", now())
        self._save()
        self.report.step("output", files=sent.files, bytes=sent.bytes, destination=destination,
                         skipped=[str(item) for item in sent.skipped])
        if sent.skipped:
            await self._record_skipped(job, sent.skipped)
        missing = missing_outputs(output_dir, job.output.expect)
        not_sent = f" {confine.skipped_summary(sent.skipped)}." if sent.skipped else ""
        if missing and state is not None and state.is_completed():
            return endings.OUTPUT_MISSING.saying("Expected output missing: " + ", ".join(missing)
                                                 + f" (the run wrote {sent.files} file(s) to {destination})."
                                                 + not_sent)
        await results.point_result_at_outputs(self.worker.client, self.run_id, state, output_dir, destination,
                                              self.storage, self.log)
        if sent.skipped:
            await self._say_in_final_state(not_sent.strip())
        return None

    def _send_bounds(self) -> dict[str, Any]:
        """What :func:`~e31_prefect.data.staging.upload_outputs` may send: the run's files, bytes and time."""
        bounds = self.bounds or output_bounds.bounds_for(None, None, None, None)
        return {"max_entries": bounds.max_files, "max_bytes": bounds.disk_bytes, "time_limit": bounds.send_seconds}

    async def _record_skipped(self, job: Job, skipped: tuple[Any, ...]) -> None:
        """An artifact on the run naming each entry of its output dir that was not sent, and why."""
        from prefect.client.schemas.actions import ArtifactCreate

        lines = [f"**{len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'} of the output dir not sent.** Only "
                 "regular files with one name are the job's own bytes: links (symbolic or hard) are never "
                 "followed and special files are never read.", "",
                 *(f"- `{item.path}`: {item.why}" for item in skipped)]
        try:
            await self.worker.client.create_artifact(ArtifactCreate(
                key=reporting.artifact_key("e31-skipped", job.name), type="markdown",
                description=f"{len(skipped)} output(s) of {job.name} not sent: links, special files or past its "
                            "bounds",
                data="\n".join(lines), flow_run_id=self.run_id))
        except Exception as exc:  # the log and the final message still name them
            self.log.warning("The artifact naming the outputs not sent could not be created: %s", exc)

    async def _say_in_final_state(self, note: str) -> None:
        """Add ``note`` to the run's final state message, keeping its state and result."""
        from prefect.results import ResultRecord, ResultRecordMetadata

        state = await self._flow_state()
        if state is None or not state.is_final() or note in (state.message or ""):
            return
        data: Any = state.data
        if isinstance(data, ResultRecordMetadata):
            data = ResultRecord(result=None, metadata=data)
            data.mark_persisted()  # already written: Prefect sends its metadata only
        message = f"{state.message.rstrip()} {note}" if state.message else note
        await self.worker.client.set_flow_run_state(
            self.run_id, State(type=state.type, name=state.name, message=message, data=data), force=True)

    def _destination(self, job: Job) -> str:
        """Where the run's outputs go: ``output.to`` with each template value one path segment.

        A ``file://`` destination is returned as its real path, and only under the folders this run may
        write: the job's folder, the team's roots (``E31_FILE_ROOTS``) and the run's own folder of the
        worker's outputs; anywhere else ends the run ``InvalidJob``.
        """
        from e31_prefect.data import confine

        settings = self.worker.settings
        outputs = settings.home.expanduser() / "outputs"
        template = job.output.to or f"file://{outputs}/{{flow_run.id}}/"
        url = confine.format_destination(template, str(self.run_id), self.flow_run.name,
                                         scheduled_start(self.flow_run).date().isoformat(), job.name)
        if "://" in url and not url.startswith("file://"):
            return url
        roots = [*self._file_roots(job), outputs / str(self.run_id)]
        try:
            real = confine.confine_file_url(url, roots, "output.to", job.team)
        except confine.PathRefused as exc:
            raise Ends(endings.INVALID_JOB.saying(f"The job's outputs may not go there: {exc}.")) from None
        return f"file://{real.rstrip('/')}/"

    def _file_roots(self, job: Job) -> list[Path]:
        """The folders the run may name in ``file://``: its team's (``E31_FILE_ROOTS``) and its job's folder
        (the job file's, else the deployment's code folder)."""
        from e31_prefect.data import confine

        folder = getattr(self.configuration, "_job_folder", None) or getattr(self.configuration, "_code_folder", None)
        return confine.run_roots(self.worker.settings.file_roots, job.team, folder)
