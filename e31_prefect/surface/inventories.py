"""Each live worker's GPUs and holds, published as a Prefect variable so ``e31 queue`` can plan the pool.

    prefect worker start --pool gpu --type e31   # publishes its inventory on every heartbeat
    e31 queue --pool gpu                          # reads those of the pool's ONLINE workers

A worker writes one variable of its own, ``e31_inventory_<hash of pool and worker name>``, on each
heartbeat: its devices, each free, held until a time (and by which run), or drained (and why), with the
worker's version and the time it wrote them (``e31 hosts``). One variable per worker means no two
workers write the same one. Which workers are alive is Prefect's own word (a worker is ONLINE
while its heartbeats arrive), so a dead worker's last inventory is never read.
:func:`describe` and :func:`parse` are pure; :func:`publish` and :func:`read` are the API edges.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from prefect.client.schemas.actions import VariableCreate, VariableUpdate
from prefect.exceptions import ObjectNotFound

from e31_prefect.host.inventory import Device
from e31_prefect.planning.scheduling import Busy

if TYPE_CHECKING:
    from prefect.client.orchestration import PrefectClient

HELD = "held"  # held with no known end
DRAINED = "drained"  # no new run rents it (e31_prefect.surface.drains)


@dataclass(frozen=True)
class HostInventory:
    """One worker's devices as it last published them: free now, busy until a time, or drained (neither)."""

    worker: str
    host: str
    free: list[Device]
    busy: list[Busy]
    drained: dict[int, str] = field(default_factory=dict)  # index: why
    holders: dict[int, str] = field(default_factory=dict)  # index: the flow run holding it
    version: str = ""
    at: str = ""  # when the worker published it
    models: dict[int, str] = field(default_factory=dict)  # every device's model, drained ones too


def variable_name(pool: str, worker: str) -> str:
    """The Prefect variable a worker of ``pool`` publishes its inventory in (names allow only [a-z0-9_-])."""
    return "e31_inventory_" + hashlib.sha256(f"{pool}\0{worker}".encode()).hexdigest()[:24]


def describe(pool: str, worker: str, host: str, devices: Sequence[Device],
             holds_until: Mapping[Device, datetime | None], drained: Mapping[Device, str] | None = None,
             holders: Mapping[Device, Any] | None = None, version: str = "", at: datetime | None = None,
             ) -> dict[str, Any]:
    """The published form: each device as ``[index, model, state, run]``, state ``free``, ``held``, the ISO
    time its hold ends, or ``drained`` (why, under ``drained``); compact, as a variable holds at most 5,000
    characters."""
    rows = []
    drained, holders = drained or {}, holders or {}
    for device in devices:
        if device in holds_until:
            until = holds_until[device]
            state = HELD if until is None else until.isoformat()
        else:
            state = DRAINED if device in drained else "free"
        rows.append([device.index, device.name, state, str(holders[device]) if device in holders else ""])
    value: dict[str, Any] = {"pool": pool, "worker": worker, "host": host, "devices": rows}
    if drained:
        value["drained"] = {str(d.index): reason[:200] for d, reason in drained.items()}
    if version:
        value["version"] = version
    if at is not None:
        value["at"] = at.isoformat()
    return value


def parse(value: Mapping[str, Any]) -> HostInventory:
    """A published inventory back as devices free now and devices busy until a time."""
    free, busy, holders, models = [], [], {}, {}
    for row in value.get("devices", []):
        index, name, state = row[:3]
        device = Device(int(index), str(name))
        models[device.index] = device.name
        if len(row) > 3 and row[3]:
            holders[device.index] = str(row[3])
        if state == "free":
            free.append(device)
        elif state != DRAINED:  # a drained device is neither: no run will rent it
            busy.append(Busy(device, None if state == HELD else datetime.fromisoformat(state)))
    drained = {int(index): str(why) for index, why in (value.get("drained") or {}).items()}
    return HostInventory(worker=str(value.get("worker", "")), host=str(value.get("host", "")), free=free, busy=busy,
                         drained=drained, holders=holders, version=str(value.get("version", "")),
                         at=str(value.get("at", "")), models=models)


async def publish(client: PrefectClient, pool: str, worker: str, value: dict[str, Any]) -> None:
    """Write this worker's inventory (create its variable the first time)."""
    name = variable_name(pool, worker)
    try:
        await client.update_variable(VariableUpdate(name=name, value=value))
    except Exception as exc:
        if not isinstance(exc, ObjectNotFound) and getattr(getattr(exc, "response", None), "status_code", 0) != 404:
            raise
        await client.create_variable(VariableCreate(name=name, value=value, tags=["e31-inventory"]))


async def read(client: PrefectClient, pool: str, online_only: bool = True) -> list[HostInventory]:
    """The inventories of ``pool``'s ONLINE workers (every worker's with ``online_only`` False; a worker that
    publishes none is left out)."""
    found = []
    for worker in await client.read_workers_for_work_pool(pool):
        if online_only and str(getattr(worker.status, "value", worker.status)).upper() != "ONLINE":
            continue
        variable = await client.read_variable_by_name(variable_name(pool, worker.name))
        if variable is not None and isinstance(variable.value, dict):
            found.append(parse(variable.value))
    return found
