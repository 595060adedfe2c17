"""Outputs that could not be sent: kept on host disk, sent later with ``e31 outputs retry``.

    e31 outputs retry RUN_ID          # send a run's kept outputs to their destination, then forget them

When a run's destination stays down, its outputs move to
``$E31_HOME/spool/<flow run id>/outputs/`` next to a ``manifest.json`` that says
where they were going (the destination URL and the name of the job's storage
block, never a credential), which flow run wrote them, how the flow itself
ended, and every file with its size. Nothing is removed until every file is
verified in the store; running the retry twice, or at once from two shells,
sends nothing twice and loses nothing.

Only the job's own bytes are kept and sent: the same walk as any send
(:func:`e31_prefect.data.staging.own_files`) finds the regular files with one
name; a link, hard link or special file the job left is neither moved nor
followed, and the manifest and the run's message name it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any
from uuid import UUID

from e31_prefect.data import store
from e31_prefect.data.confine import Skipped, skipped_summary
from e31_prefect.data.staging import UploadError, own_files, upload_outputs

MANIFEST = "manifest.json"
RETRY_COMMAND = "e31 outputs retry {run_id}"

logger = logging.getLogger("e31.spool")


class SpoolError(RuntimeError):
    """Nothing (or nothing usable) is kept for a run; the message says what to do."""


@dataclass
class Kept:
    """A run's outputs kept in the spool, as its manifest describes them."""

    flow_run_id: str
    destination: str | None
    storage: str | None = None
    job_name: str | None = None
    flow_state: str | None = None
    reason: str = ""
    kept_at: str = ""
    files: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)  # not kept: links and special files, and why
    entry: str = ""

    @property
    def outputs(self) -> Path:
        """The folder holding the kept files."""
        return Path(self.entry) / "outputs"

    @property
    def outputs_url(self) -> str:
        """The kept files as a ``file://`` URL."""
        return f"file://{self.outputs}/"

    @property
    def bytes(self) -> int:
        """Bytes kept."""
        return sum(int(f["size"]) for f in self.files)

    def message(self) -> str:
        """The run's state message: what happened, where the outputs are, and the command that sends them."""
        text = (f"Outputs could not be sent ({self.reason}); {len(self.files)} file(s), {self.bytes / 1e6:.2f} MB "
                f"are kept at {self.outputs_url} on host {os.uname().nodename}. Send them with "
                f"`{RETRY_COMMAND.format(run_id=self.flow_run_id)}` once the store is back.")
        return text + (f" {skipped_summary(self.not_kept)}." if self.skipped else "")

    @property
    def not_kept(self) -> list[Skipped]:
        """What the job left in its output dir that is not its own bytes, so neither kept nor sent."""
        return [Skipped(item["path"], item["why"]) for item in self.skipped]


def keep(output_dir: Path, spool: Path, flow_run_id: str, destination: str | None, storage: str | None = None,
         job_name: str | None = None, flow_state: str | None = None, reason: str = "",
         max_entries: int | None = None, max_bytes: int | None = None) -> Kept:
    """Move a run's own output files into the spool with a manifest; returns what was kept.

    A run kept twice (its outputs failed again) gathers every file in the one entry. Links and special
    files are left where they are (the workspace goes with them) and named in the manifest, as are the
    outputs past the run's bounds (``max_entries``, ``max_bytes``: :func:`e31_prefect.data.staging.own_files`).
    """
    entry = spool / flow_run_id
    outputs = entry / "outputs"
    spool.mkdir(mode=0o700, parents=True, exist_ok=True)  # every run's outputs: closed to jobs
    outputs.mkdir(parents=True, exist_ok=True)
    files, skipped = own_files(output_dir, max_entries, max_bytes)
    for path in files:
        target = outputs / path.relative_to(output_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        _move(path, target)
    earlier = read(spool, flow_run_id)
    found = [{"path": p.relative_to(outputs).as_posix(), "size": p.stat().st_size}
             for p in sorted(outputs.rglob("*")) if p.is_file() and not p.is_symlink()]
    not_kept = {item["path"]: item for item in (earlier.skipped if earlier else [])}
    not_kept.update({item.path: {"path": item.path, "why": item.why} for item in skipped})
    kept = Kept(flow_run_id=flow_run_id, destination=destination, storage=storage, job_name=job_name,
                flow_state=flow_state, reason=reason, files=found, skipped=sorted(not_kept.values(),
                                                                                  key=lambda i: i["path"]),
                entry=str(entry), kept_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    _write_manifest(kept)
    return kept


def _move(path: Path, target: Path) -> None:
    """A rename on one filesystem; across two (a run's output disk), a copy of the file itself, read through
    a descriptor that is still the regular file the walk found (never through a link put there since)."""
    try:
        os.rename(path, target)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    with store.open_own(path, was="listed", then="kept") as source:
        store.put_local(source, os.path.realpath(target.parent) + "/" + target.name)
    path.unlink()


def _write_manifest(kept: Kept) -> None:
    entry = Path(kept.entry)
    record = {k: v for k, v in asdict(kept).items() if k != "entry"}
    temporary = entry / (MANIFEST + ".tmp")
    temporary.write_text(json.dumps(record, indent=2))
    os.replace(temporary, entry / MANIFEST)  # a manifest is whole or absent


def read(spool: Path, flow_run_id: str) -> Kept | None:
    """What the spool keeps for a run; None when it keeps nothing."""
    entry = spool / flow_run_id
    manifest = entry / MANIFEST
    if not manifest.exists():
        if (entry / "outputs").exists():
            # Kept by an older e31 or by hand: the files are there, the destination is not known.
            return Kept(flow_run_id=flow_run_id, destination=None, entry=str(entry))
        return None
    record = json.loads(manifest.read_text())
    return Kept(**{k: v for k, v in record.items() if k in Kept.__dataclass_fields__}, entry=str(entry))


@contextlib.contextmanager
def _only_one_retry(spool: Path, flow_run_id: str) -> Iterator[None]:
    # Two retries of one run at once: the second waits, then finds the entry gone and sends nothing.
    spool.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(spool / f".{flow_run_id}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Sent:
    """What a retry did: the files and bytes sent, and where."""

    files: int
    bytes: int
    destination: str
    seconds: float
    skipped: tuple[Skipped, ...] = ()  # found in the spool but not sent: links and special files


def send_kept(spool: Path, flow_run_id: str, options: dict[str, Any] | None, destination: str | None = None,
              log: logging.Logger | logging.LoggerAdapter | None = None) -> tuple[Kept, Sent] | None:
    """Send a run's kept outputs (to ``destination`` when given, else the manifest's); None if nothing is kept.

    The entry is removed only after every file is verified in the store; on failure it stays as it was.
    """
    with _only_one_retry(spool, flow_run_id):
        kept = read(spool, flow_run_id)
        if kept is None:
            return None
        target = destination or kept.destination
        if not target:
            raise SpoolError(f"the outputs of {flow_run_id} kept at {kept.outputs_url} have no destination on "
                             "record; give one with --to URL")
        if destination and _is_local(destination):
            # A folder the caller names is theirs to name: its links are followed here, once; nothing
            # beneath it is written through a link.
            destination = target = f"file://{os.path.realpath(destination.removeprefix('file://'))}/"
        try:
            sent = upload_outputs(kept.outputs, target, options, log=log)
        except UploadError as exc:
            raise SpoolError(f"{exc}; the outputs stay kept at {kept.outputs_url}. Try again once the store is "
                             "back.") from None
        shutil.rmtree(kept.entry)
    return kept, Sent(sent.files, sent.bytes, target, sent.seconds, sent.skipped)


def _is_local(url: str) -> bool:
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    return scheme == "file"


async def record_kept(client: Any, flow_run_id: UUID, kept: Kept) -> None:
    """An artifact on the run saying where its outputs are kept and how to send them."""
    from prefect.client.schemas.actions import ArtifactCreate

    from e31_prefect.surface.reporting import artifact_key

    command = RETRY_COMMAND.format(run_id=kept.flow_run_id)
    lines = [
        f"**Outputs not sent**: {kept.reason}",
        "",
        f"{len(kept.files)} file(s), {kept.bytes / 1e6:.2f} MB are kept on host `{os.uname().nodename}` at "
        f"`{kept.outputs}`.",
        f"They go to `{kept.destination}` with:",
        "",
        f"    {command}",
    ]
    if kept.skipped:
        lines += ["", "**Not kept, never sent** (only regular files are: links and special files are not followed):",
                  "", *(f"- `{item.path}`: {item.why}" for item in kept.not_kept)]
    await client.create_artifact(ArtifactCreate(
        key=artifact_key("e31-spool", kept.job_name or "job"), type="markdown",
        description=f"Outputs kept on {os.uname().nodename}: {command}",
        data="\n".join(lines), flow_run_id=flow_run_id))


async def record_sent(client: Any, flow_run_id: UUID, kept: Kept, sent: Sent) -> str | None:
    """Tell the run its outputs went out: an artifact, and Completed again where only the outputs had failed.

    A run whose flow completed and was failed ``OutputNotSent`` by e31 alone is set Completed, since
    its work is done and its outputs are now where the job said: that is the state a user and an
    automation expect. A run that failed for another reason keeps its state. Returns the new state's name.
    """
    from prefect.client.schemas.actions import ArtifactCreate
    from prefect.states import Completed

    from e31_prefect.surface.reporting import OUTPUT_NOT_SENT, artifact_key

    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    name = kept.job_name or "job"
    await client.create_artifact(ArtifactCreate(
        key=artifact_key("e31-outputs", name), type="markdown",
        description=f"Outputs of {name}: {sent.destination} (sent {now} by e31 outputs retry)",
        data=f"[{sent.destination}]({sent.destination})\n\nSent {now} by `e31 outputs retry`: {sent.files} "
        f"file(s), {sent.bytes / 1e6:.2f} MB, kept since {kept.kept_at or '?'}.",
        flow_run_id=flow_run_id))
    run = await client.read_flow_run(flow_run_id)
    if run.state is not None and run.state.name == OUTPUT_NOT_SENT and kept.flow_state == "Completed":
        message = f"Outputs sent {now} by e31 outputs retry to {sent.destination} ({sent.files} file(s))."
        completed = await _completed_reading_sent_result(client, flow_run_id, kept, sent.destination, message)
        await client.set_flow_run_state(flow_run_id, completed or Completed(message=message), force=True)
        return "Completed"
    return run.state.name if run.state else None


async def _completed_reading_sent_result(client: Any, flow_run_id: UUID, kept: Kept, destination: str,
                                         message: str) -> Any:
    """The flow's own Completed state again, its result read from the copy just sent; None if it left none."""
    from prefect.results import ResultRecordMetadata

    from e31_prefect.data import results
    from e31_prefect.data.blocks import load_storage, result_block_id

    states = await client.read_flow_run_states(flow_run_id)
    flow_completed = next((state for state in reversed(states) if state.is_completed()
                           and isinstance(state.data, ResultRecordMetadata)), None)
    if flow_completed is None:
        return None
    key = PurePosixPath(flow_completed.data.storage_key or "").name
    if f"{results.RESULTS_FOLDER}/{key}" not in {file["path"] for file in kept.files}:
        return None
    url = results.result_url(destination, key)
    block_id = None if url.startswith("file://") else await result_block_id(
        await load_storage(kept.storage) if kept.storage else None, client)
    state = results.state_reading_from(flow_completed, url, block_id)
    state.message = message
    return state


async def retry(run_id: str, spool: Path, destination: str | None = None) -> int:
    """``e31 outputs retry RUN_ID``: send, verify, forget the spool entry, record it on the run; exit status."""
    from prefect import get_client

    try:
        flow_run_id = UUID(run_id)
    except ValueError:
        print(f"outputs retry: {run_id!r} is not a flow run id; give the id the run's state message names",
              flush=True)
        return 2
    import anyio

    try:
        options = await _storage_options(read(spool, str(flow_run_id)))
    except Exception as exc:  # the storage block is missing or unreadable: its own message says which
        print(f"outputs retry {flow_run_id}: {exc}", flush=True)
        return 1

    try:
        result = await anyio.to_thread.run_sync(send_kept, spool, str(flow_run_id), options, destination, logger)
    except SpoolError as exc:
        print(f"outputs retry {flow_run_id}: {exc}", flush=True)
        return 1
    if result is None:
        print(f"Nothing kept for {flow_run_id} in {spool}: its outputs were sent already (or never kept "
              "on this host).")
        return 0
    kept, sent = result
    print(f"Sent {sent.files} file(s), {sent.bytes / 1e6:.2f} MB of {flow_run_id} to {sent.destination} "
          f"(verified) in {sent.seconds:.2f} s; removed {kept.entry}.")
    not_sent = [*kept.not_kept, *sent.skipped]
    if not_sent:
        print(f"Not sent: {skipped_summary(not_sent, limit=len(not_sent))}.")
    try:
        async with get_client() as client:
            state = await record_sent(client, flow_run_id, kept, sent)
    except Exception as exc:  # the outputs are safe in the store whatever the API says
        print(f"(could not record it on the flow run: {type(exc).__name__}: {exc})")
        return 0
    if state:
        print(f"Flow run {flow_run_id}: {state}")
    return 0


async def _storage_options(kept: Kept | None) -> dict[str, Any] | None:
    """fsspec options of the manifest's storage block, where e31's blocks exist; None otherwise."""
    if kept is None or not kept.storage:
        return None
    try:
        from e31_prefect.data.blocks import storage_options
    except ImportError:
        return None
    return await storage_options(kept.storage)
