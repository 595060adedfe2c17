"""A run's return value as a Prefect result, kept with its outputs: ``state.result()`` reads it back.

The job process never holds storage credentials, so it cannot write its
result to S3 itself. Instead it persists the result locally, in a folder of
its output dir (:data:`RESULTS_FOLDER`); the worker sends that folder with the
other outputs, then points the run's Completed state at the copy at the
destination: for ``s3://`` through the job's E31 Storage block (so a caller
reads it with the block's credentials), for ``file://`` as a plain path on
the worker's host.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path, PurePath, PurePosixPath
from typing import TYPE_CHECKING, Any
from uuid import UUID

from prefect.client.schemas.objects import State
from prefect.results import ResultRecord, ResultRecordMetadata
from prefect.states import Completed

if TYPE_CHECKING:
    from prefect.client.orchestration import PrefectClient

    from e31_prefect.data.blocks import E31Storage

RESULTS_FOLDER = ".prefect-results"

# The flow's return value is persisted by default; tasks keep Prefect's default (not persisted),
# so a task-heavy flow does not fill its outputs with intermediate values.
_PERSIST = {"PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true", "PREFECT_TASKS_DEFAULT_PERSIST_RESULT": "false"}


def result_environment(output_dir: PurePath | str) -> dict[str, str]:
    """Prefect settings that make a job's flow persist its return value under its output dir."""
    return {**_PERSIST, "PREFECT_RESULTS_LOCAL_STORAGE_PATH": f"{output_dir}/{RESULTS_FOLDER}"}


def local_result_key(state: State | None, output_dir: Path) -> str | None:
    """The file name of the result the run persisted in its results folder, if it did.

    The state's path is the one the job saw (a container sees its own mount point), so the
    file is looked up by name in the host's output dir.
    """
    data = getattr(state, "data", None)
    if state is None or not state.is_completed() or not isinstance(data, ResultRecordMetadata):
        return None
    if data.storage_block_id is not None or not data.storage_key:
        return None
    path = PurePosixPath(data.storage_key)
    if path.parent.name != RESULTS_FOLDER or not (output_dir / RESULTS_FOLDER / path.name).is_file():
        return None
    return path.name


def result_url(destination: str, key: str) -> str:
    """Where a result sent with the outputs to ``destination`` lives."""
    return f"{destination.rstrip('/')}/{RESULTS_FOLDER}/{key}"


def state_reading_from(state: State[Any], url: str, storage_block_id: UUID | None) -> State[Any]:
    """The run's Completed state again, its result now read from ``url``.

    ``s3://`` results are read through the storage block ``storage_block_id``; ``file://`` ones
    as a path on this host.
    """
    assert isinstance(state.data, ResultRecordMetadata)
    if url.startswith("file://"):
        update = {"storage_key": url.removeprefix("file://"), "storage_block_id": None}
    else:
        update = {"storage_key": url, "storage_block_id": storage_block_id}
    record = ResultRecord(result=None, metadata=state.data.model_copy(update=update))
    record.mark_persisted()  # already written: Prefect sends its metadata only
    return Completed(name=state.name, message=state.message, data=record)


async def point_result_at_outputs(client: PrefectClient, flow_run_id: UUID, state: State | None, output_dir: Path,
                                  destination: str, storage: E31Storage | None,
                                  log: logging.Logger | logging.LoggerAdapter) -> str | None:
    """After the outputs were sent: the Completed run's result (its ``state``, as read once they were) is read
    from its copy at the destination.

    Returns the result's URL, or None where the run left no result in its results folder.
    """
    from e31_prefect.data.blocks import result_block_id

    key = local_result_key(state, output_dir)
    if key is None or state is None:
        return None
    url = result_url(destination, key)
    try:
        block_id = None if url.startswith("file://") else await result_block_id(storage, client)
        await client.set_flow_run_state(flow_run_id, state_reading_from(state, url, block_id), force=True)
    except Exception as exc:
        # The outputs are sent and the run is Completed; only reading its value from elsewhere fails.
        log.warning("The run's result was sent to %s but its state could not point at it: %s", url, exc)
        return None
    log.info("The run's result is kept at %s", url)
    return url


async def wait_released(client: PrefectClient, flow_run_id: UUID, poll_seconds: float = 0.5) -> Any:
    """The flow run once its e31 worker has released it (its meter tags are set)."""
    while True:
        flow_run = await client.read_flow_run(flow_run_id)
        if any(tag.startswith("e31:billed-s=") for tag in flow_run.tags) and flow_run.state is not None:
            return flow_run
        await asyncio.sleep(poll_seconds)


async def released_result(client: PrefectClient, flow_run_id: UUID, poll_seconds: float = 0.5) -> Any:
    """A run's return value, once its e31 worker has released it.

    Only then does its Completed state point at the copy sent with the outputs; before, it points
    at the job's own workspace. A run that did not complete raises as ``state.result()`` does.
    """
    flow_run = await wait_released(client, flow_run_id, poll_seconds)
    return await flow_run.state.aresult()
