"""The hosts' heartbeats in Prefect as the pool's workers read and write them, and the pool's runs a host holds.

    prefect worker start --pool gpu --type e31   # writes its host's heartbeat, reads every host's

A host's heartbeat is one Prefect variable (:mod:`e31_prefect.host.heartbeat`, where its runs' supervisors
write it too); every host's are read in one call, by their tag.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from prefect.client.schemas.actions import VariableCreate, VariableUpdate
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
    WorkPoolFilter,
    WorkPoolFilterName,
)
from prefect.exceptions import ObjectNotFound

from e31_prefect.host.heartbeat import HOST_TAG, beat_value, host_variable
from e31_prefect.model import attempts
from e31_prefect.model.attempts import Beat
from e31_prefect.surface.lost_attempts import ACTIVE

PAGE = 200


async def write_beat(client: Any, host: str, at: datetime, lost_seconds: float) -> None:
    """Write the host's heartbeat (make its variable the first time)."""
    name, value = host_variable(host), beat_value(host, at, lost_seconds)
    try:
        await client.update_variable(VariableUpdate(name=name, value=value))
    except Exception as exc:
        if not isinstance(exc, ObjectNotFound) and getattr(getattr(exc, "response", None), "status_code", 0) != 404:
            raise
        await client.create_variable(VariableCreate(name=name, value=value, tags=[HOST_TAG]))


async def read_beats(client: Any) -> dict[str, Beat]:
    """Every host's last heartbeat, in one read."""
    response = await client.request("POST", "/variables/filter", json={
        "variables": {"tags": {"all_": [HOST_TAG]}}, "limit": PAGE})
    found = [attempts.parse_beat(item.get("value") or {}) for item in response.json() if isinstance(item, dict)]
    return attempts.latest_beats(beat for beat in found if beat is not None)


async def read_active_runs(client: Any, pool: str) -> list[Any]:
    """The pool's runs that a worker holds now: Pending, Running, Cancelling."""
    runs, offset = [], 0
    while True:
        page = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=list(ACTIVE)))),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])), limit=PAGE, offset=offset)
        runs += page
        offset += len(page)
        if len(page) < PAGE:
            return runs


