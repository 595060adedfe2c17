"""Pool capacity and team quotas as Prefect global concurrency limits, held with leases.

    e31 quota set vision 8         # team vision holds at most 8 GPUs at once, across every worker
    e31 quota set --pool gpu 32    # pool gpu rents at most 32 GPUs at once

A rented run holds ``gpus`` slots of its pool's limit and of its team's limit
(where they exist) under one lease, renewed while it runs and released when
its devices go back. A worker that dies stops renewing: the server frees the
slots when the lease expires, so nothing stays held for longer than a lease.
"""

from __future__ import annotations

import contextlib
from uuid import UUID

from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

# Prefect's shortest lease; a dead worker's slots come back within it.
LEASE_SECONDS = 60


def team_by_queue(queue_teams: dict[str, str], queue: str | None, claimed: str | None) -> str | None:
    """The team a run is metered to: its work queue's, where the pool's operator maps queues to teams,
    else the one its job names. Raises ValueError for a job that claims another team than its queue's."""
    team = queue_teams.get(queue or "")
    if team is None:
        return claimed
    if claimed is not None and claimed != team:
        raise ValueError(f"team = {claimed!r}: the run came through work queue {queue!r}, which is team {team!r}'s; "
                         f"remove team, or submit it to a queue of team {claimed!r}")
    return team


class QuotaFull(RuntimeError):
    """The pool's or the team's GPUs are all held now; the run waits for some to come back."""


class OverQuota(RuntimeError):
    """The run asks for more GPUs than its pool or team may ever hold."""


def pool_limit(pool: str) -> str:
    """The global concurrency limit that caps a pool's rented GPUs."""
    return f"e31-pool-{pool}"


def team_limit(team: str) -> str:
    """The global concurrency limit that caps a team's rented GPUs."""
    return f"e31-team-{team}"


def limit_names(pool: str, team: str | None) -> list[str]:
    """The limits a run of this pool and team holds slots of (absent limits are no limit)."""
    return [pool_limit(pool)] + ([team_limit(team)] if team else [])


async def acquire(client: PrefectClient, names: list[str], gpus: int, flow_run_id: UUID) -> UUID | None:
    """Hold ``gpus`` slots of every named limit under one lease; None when nothing needs holding."""
    if gpus == 0:
        return None
    try:
        response = await client.increment_concurrency_slots_with_lease(
            names=names, slots=gpus, mode="concurrency", lease_duration=LEASE_SECONDS,
            holder=ConcurrencyLeaseHolder(type="flow_run", id=flow_run_id))
    except PrefectHTTPStatusError as exc:
        status = exc.response.status_code
        if status == 423:
            raise QuotaFull(f"no {gpus} GPU slot(s) free in {', '.join(names)} now") from None
        if status == 422:
            raise OverQuota(f"{gpus} GPU(s) is more than {' or '.join(names)} allows at all") from None
        raise
    return UUID(response.json()["lease_id"])


async def renew(client: PrefectClient, lease_id: UUID) -> bool:
    """Keep holding the slots for another lease period; False when the lease is gone (it expired)."""
    try:
        await client.renew_concurrency_lease(lease_id, lease_duration=LEASE_SECONDS)
    except PrefectHTTPStatusError as exc:
        if exc.response.status_code in (404, 410):  # 410: the server let it expire
            return False
        raise
    return True


async def release(client: PrefectClient, lease_id: UUID) -> None:
    """Give the slots back now (a lease already expired is fine)."""
    with contextlib.suppress(ObjectNotFound, PrefectHTTPStatusError):
        await client.release_concurrency_slots_with_lease(lease_id)


async def set_quota(client: PrefectClient, name: str, gpus: int) -> None:
    """Create or change a limit to ``gpus`` slots."""
    await client.upsert_global_concurrency_limit_by_name(name, gpus)


async def held(client: PrefectClient, name: str) -> int:
    """Slots of a limit held now (0 if the limit does not exist)."""
    try:
        return (await client.read_global_concurrency_limit_by_name(name)).active_slots
    except ObjectNotFound:
        return 0
