"""Each live worker's GPUs and holds, published as a Prefect variable so ``e31 queue`` can plan the pool.

    prefect worker start --pool gpu --type e31   # publishes its inventory on every heartbeat
    e31 queue --pool gpu                          # reads those of the pool's ONLINE workers

A worker writes one variable of its own, ``e31_inventory_<hash of pool and worker name>``, on each
heartbeat: its devices, each free or held until a time. One variable per worker means no two
workers write the same one. Which workers are alive is Prefect's own word (a worker is ONLINE
while its heartbeats arrive), so a dead worker's last inventory is never read.
:func:`describe` and :func:`parse` are pure; :func:`publish` and :func:`read` are the API edges.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from prefect.client.schemas.actions import VariableCreate, VariableUpdate
from prefect.exceptions import ObjectNotFound

from e31_prefect.host.inventory import Device
from e31_prefect.planning.scheduling import Busy

if TYPE_CHECKING:
    from prefect.client.orchestration import PrefectClient

HELD = "held"  # held with no known end


@dataclass(frozen=True)
class HostInventory:
    """One worker's devices as it last published them: free now, or busy until a time."""

    worker: str
    host: str
    free: list[Device]
    busy: list[Busy]


def variable_name(pool: str, worker: str) -> str:
    """The Prefect variable a worker of ``pool`` publishes its inventory in (names allow only [a-z0-9_-])."""
    return "e31_inventory_" + hashlib.sha256(f"{pool}\0{worker}".encode()).hexdigest()[:24]


def describe(pool: str, worker: str, host: str, devices: Sequence[Device],
             holds_until: Mapping[Device, datetime | None]) -> dict[str, Any]:
    """The published form: each device as ``[index, model, state]``, state ``free``, ``held`` or the ISO
    time its hold ends; compact, as a variable holds at most 5,000 characters."""
    rows = []
    for device in devices:
        if device not in holds_until:
            state = "free"
        else:
            until = holds_until[device]
            state = HELD if until is None else until.isoformat()
        rows.append([device.index, device.name, state])
    return {"pool": pool, "worker": worker, "host": host, "devices": rows}


def parse(value: Mapping[str, Any]) -> HostInventory:
    """A published inventory back as devices free now and devices busy until a time."""
    free, busy = [], []
    for index, name, state in value.get("devices", []):
        device = Device(int(index), str(name))
        if state == "free":
            free.append(device)
        else:
            busy.append(Busy(device, None if state == HELD else datetime.fromisoformat(state)))
    return HostInventory(worker=str(value.get("worker", "")), host=str(value.get("host", "")), free=free, busy=busy)


async def publish(client: PrefectClient, pool: str, worker: str, value: dict[str, Any]) -> None:
    """Write this worker's inventory (create its variable the first time)."""
    name = variable_name(pool, worker)
    try:
        await client.update_variable(VariableUpdate(name=name, value=value))
    except Exception as exc:
        if not isinstance(exc, ObjectNotFound) and getattr(getattr(exc, "response", None), "status_code", 0) != 404:
            raise
        await client.create_variable(VariableCreate(name=name, value=value, tags=["e31-inventory"]))


async def read(client: PrefectClient, pool: str) -> list[HostInventory]:
    """The inventories of ``pool``'s ONLINE workers (a worker that publishes none is left out)."""
    found = []
    for worker in await client.read_workers_for_work_pool(pool):
        if str(getattr(worker.status, "value", worker.status)).upper() != "ONLINE":
            continue
        variable = await client.read_variable_by_name(variable_name(pool, worker.name))
        if variable is not None and isinstance(variable.value, dict):
            found.append(parse(variable.value))
    return found
