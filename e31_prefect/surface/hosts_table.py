"""What hosts a pool has, like Slurm's ``sinfo``: each host's GPUs (free, rented and to which run, or drained and
why), its last heartbeat and its worker's version. ``e31 hosts`` prints it; it is the table artifact
``e31-hosts-<pool>`` in the Prefect UI too, written by ``e31 hosts`` and by the pool's workers as it changes.

    e31 hosts --pool gpu

Read from what the hosts publish in Prefect: each worker's inventory (:mod:`e31_prefect.surface.inventories`),
each host's heartbeat (:mod:`e31_prefect.host.heartbeat`) and drains (:mod:`e31_prefect.surface.drains`).
:func:`rows` and :func:`render` are pure.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any
from uuid import UUID

from prefect.client.schemas.actions import ArtifactCreate

from e31_prefect.model.attempts import Beat
from e31_prefect.surface import drains as drain_store
from e31_prefect.surface.drains import Drain
from e31_prefect.surface.inventories import HostInventory
from e31_prefect.surface.reporting import artifact_key

COLUMNS = ("HOST", "STATE", "GPU", "MODEL", "GPU STATE", "RUN", "LAST HEARTBEAT", "WORKER", "VERSION")


def key(pool: str) -> str:
    """The pool's hosts artifact key: ``e31-hosts-<pool>``."""
    return artifact_key("e31-hosts", pool)


def _ago(moment: datetime | None, now: datetime) -> str:
    if moment is None:
        return "never"
    seconds = max(0, int((now - moment).total_seconds()))
    return f"{moment.astimezone(timezone.utc):%Y-%m-%d %H:%M:%SZ} ({seconds} s ago)"


def rows(hosts: Sequence[HostInventory], workers: Mapping[str, str], beats: Mapping[str, Beat],
         drains: Mapping[str, Mapping[str, Drain]], run_names: Mapping[str, str], lost_seconds: float,
         now: datetime) -> list[dict[str, str]]:
    """A row per GPU of each host (one for a host with none), hosts by name. ``workers``: each worker's status;
    ``run_names``: the flow-run name of each run holding a device."""
    by_host: dict[str, list[HostInventory]] = {}
    for inventory in hosts:
        by_host.setdefault(inventory.host, []).append(inventory)
    table = []
    for host in sorted(by_host):
        seen = by_host[host]
        beat = beats.get(host)
        heard = beat.at if beat is not None else max(
            (datetime.fromisoformat(i.at) for i in seen if i.at), default=None)
        host_drains = drains.get(host, {})
        if drain_store.WHOLE_HOST in host_drains:
            state = "drained"
        elif heard is None or (lost_seconds > 0 and (now - heard).total_seconds() > lost_seconds):
            state = "lost"
        elif not any(workers.get(i.worker, "").upper() == "ONLINE" for i in seen):
            state = "no worker"
        else:
            state = "up"
        common = {"host": host, "state": state, "last heartbeat": _ago(heard, now),
                  "worker": ", ".join(sorted(f"{i.worker} ({workers.get(i.worker, 'unknown').lower()})" for i in seen)),
                  "version": ", ".join(sorted({i.version or "?" for i in seen}))}
        indices = sorted({index for i in seen for index in i.models})
        why = drain_store.by_index(host_drains, indices)
        for index in indices or [None]:
            row = {**common, "gpu": "-" if index is None else str(index), "model": "", "gpu state": "-", "run": ""}
            if index is not None:
                row["model"] = next(i.models[index] for i in seen if index in i.models)
                holder = next((i.holders[index] for i in seen if index in i.holders), "")
                drained = why.get(index) or next((i.drained[index] for i in seen if index in i.drained), None)
                row["gpu state"] = ("rented" if holder else "free") if drained is None else \
                    (f"rented, drained: {drained}" if holder else f"drained: {drained}")
                row["run"] = run_names.get(holder, holder)
            table.append(row)
    return table


def render(table: Sequence[Mapping[str, str]]) -> str:
    """The rows as text, aligned."""
    lines = [list(COLUMNS)] + [[row.get(column.lower(), "") for column in COLUMNS] for row in table]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
                     for line in lines)


async def read_rows(client: Any, pool: str, lost_seconds: float) -> list[dict[str, str]]:
    """The pool's hosts as they last published themselves, every worker's (a dead host's too)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from e31_prefect.surface import inventories
    from e31_prefect.surface.beats import read_beats

    workers = {w.name: str(getattr(w.status, "value", w.status)) for w in await client.read_workers_for_work_pool(pool)}
    hosts = await inventories.read(client, pool, online_only=False)
    holders = {run for inventory in hosts for run in inventory.holders.values()}
    ids = []
    for holder in holders:
        with contextlib.suppress(ValueError):
            ids.append(UUID(holder))
    names = {}
    if ids:
        for run in await client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids))):
            names[str(run.id)] = run.name
    return rows(hosts, workers, await read_beats(client), await drain_store.read_all(client), names, lost_seconds,
                datetime.now(timezone.utc))


async def write(client: Any, pool: str, table: list[dict[str, str]]) -> None:
    """Write the table as the pool's hosts artifact (a new version of its key)."""
    hosts = len({row["host"] for row in table})
    up = len({row["host"] for row in table if row["state"] == "up"})
    await client.create_artifact(ArtifactCreate(
        key=key(pool), type="table", data=json.dumps(table),
        description=f"E31 hosts of pool {pool}: {up} of {hosts} up, "
                    f"{sum(1 for row in table if row['gpu state'] == 'free')} GPU(s) free "
                    f"(at {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%SZ})"))
