"""Drained hosts and GPUs: no new run lands there; a run there goes on (a failed GPU's run is requeued).

    e31 drain gpu-host-3 2 --reason "fan noise, ticket 4121"   # like scontrol update state=drain
    e31 drain gpu-host-3                                       # the whole host
    e31 undrain gpu-host-3 2

A host's drains are one Prefect variable, ``e31_drain_<hash of its name>`` (tagged ``e31-drain``): each
drained device by index (``*``: the whole host) with why, when and by whom (an operator, or the host's
health check, :mod:`e31_prefect.host.device_health`). The host's workers read it every heartbeat and rent
none of those devices; ``e31 hosts``, ``e31 queue`` and the pool's inventories show them with the reason.
:func:`parse` and :func:`by_index` are pure; the rest are the API edges.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from prefect.client.schemas.actions import VariableCreate, VariableUpdate
from prefect.exceptions import ObjectNotFound

DRAIN_TAG = "e31-drain"
WHOLE_HOST = "*"


@dataclass(frozen=True)
class Drain:
    """One drained device (or ``*``, the host): why, since when, and by whom (``operator`` or ``health``)."""

    device: str
    reason: str
    at: str
    by: str


def variable_name(host: str) -> str:
    """The Prefect variable a host's drains are kept in."""
    return "e31_drain_" + hashlib.sha256(host.encode()).hexdigest()[:24]


def parse(value: Mapping[str, Any] | None) -> dict[str, Drain]:
    """A drain variable's value as its drains by device; anything malformed is left out."""
    found: dict[str, Drain] = {}
    devices = value.get("devices") if isinstance(value, Mapping) else None
    for device, item in (devices.items() if isinstance(devices, Mapping) else ()):
        if isinstance(item, Mapping):
            found[str(device)] = Drain(str(device), str(item.get("reason", "")), str(item.get("at", "")),
                                       str(item.get("by", "")))
    return found


def by_index(drains: Mapping[str, Drain], indices: Iterable[int]) -> dict[int, str]:
    """The drained devices among ``indices`` and why (a drained host drains them all)."""
    whole = drains.get(WHOLE_HOST)
    found = {}
    for index in indices:
        drain = drains.get(str(index)) or whole
        if drain is not None:
            found[index] = f"{drain.reason} ({drain.by}, {drain.at})" if drain.reason else f"drained ({drain.by})"
    return found


async def read(client: Any, host: str) -> dict[str, Drain]:
    """The host's drains (none when it has no variable)."""
    variable = await client.read_variable_by_name(variable_name(host))
    return parse(variable.value if variable is not None and isinstance(variable.value, dict) else None)


async def read_all(client: Any) -> dict[str, dict[str, Drain]]:
    """Every host's drains, in one read."""
    response = await client.request("POST", "/variables/filter", json={"variables": {"tags": {"all_": [DRAIN_TAG]}},
                                                                       "limit": 200})
    found = {}
    for item in response.json():
        value = item.get("value") if isinstance(item, dict) else None
        if isinstance(value, dict) and value.get("host"):
            found[str(value["host"])] = parse(value)
    return found


async def change(client: Any, host: str, device: str, reason: str | None, by: str) -> dict[str, Drain]:
    """Drain ``device`` of ``host`` (``*``: the host) saying ``reason``, or undrain it (``reason`` None; ``*``
    undrains the host and every device of it); the host's drains after."""
    drains = await read(client, host)
    if reason is None:
        drains = {} if device == WHOLE_HOST else {key: d for key, d in drains.items() if key != device}
    else:
        drains[device] = Drain(device, reason, datetime.now(timezone.utc).isoformat(timespec="seconds"), by)
    value = {"host": host, "devices": {key: {"reason": d.reason, "at": d.at, "by": d.by} for key, d in drains.items()}}
    name = variable_name(host)
    try:
        await client.update_variable(VariableUpdate(name=name, value=value))
    except Exception as exc:
        if not isinstance(exc, ObjectNotFound) and getattr(getattr(exc, "response", None), "status_code", 0) != 404:
            raise
        await client.create_variable(VariableCreate(name=name, value=value, tags=[DRAIN_TAG]))
    return drains
