"""``e31 queue``'s plan: every waiting run's planned start and finish over the pool's hosts, and the
inventories workers publish for it."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

import pytest

from e31_prefect.cli.forecast import planned_line, rows
from e31_prefect.host.inventory import Device
from e31_prefect.planning.scheduling import Busy, WaitingRun, decide, plan
from e31_prefect.surface import inventories
from e31_prefect.surface.inventories import HostInventory

NOW = datetime(2026, 12, 3, 22, 0, tzinfo=timezone.utc)
HOUR = timedelta(hours=1)


def run(id: str, gpus: int = 1, *, hours: float = 1, latest: float | None = None, scheduled: float = 0) -> WaitingRun:
    return WaitingRun(id=id, gpus=gpus, gpu_type=None, scheduled=NOW + HOUR * scheduled,
                      latest_start=None if latest is None else NOW + HOUR * latest, duration=HOUR * hours)


def h100s(n: int, first: int = 0) -> list[Device]:
    return [Device(first + i, "H100") for i in range(n)]


def test_one_gpu_runs_are_planned_back_to_back_and_a_late_one_is_told_it_misses():
    planned = {p.run.id: p for p in plan([run("a", latest=0.5), run("b", latest=0.75), run("c", latest=8)],
                                         [(h100s(1), [])], NOW)}
    assert (planned["a"].start, planned["a"].finish) == (NOW, NOW + HOUR)
    assert planned["b"].start == NOW + HOUR and planned["b"].meets_deadline is False
    assert planned["c"].start == NOW + 2 * HOUR and planned["c"].meets_deadline is True


def test_a_run_waits_for_a_busy_device_to_come_back():
    busy = [Busy(Device(0, "H100"), NOW + 2 * HOUR)]
    [planned] = plan([run("a")], [([], busy)], NOW)
    assert planned.start == NOW + 2 * HOUR and planned.meets_deadline is None


def test_a_run_goes_to_the_host_where_it_starts_soonest_and_never_spans_hosts():
    first = (h100s(1), [Busy(Device(1, "H100"), NOW + 3 * HOUR)])
    second = (h100s(1), [])
    planned = {p.run.id: p for p in plan([run("two", gpus=2), run("one")], [first, second], NOW)}
    assert planned["two"].start == NOW + 3 * HOUR  # two free GPUs on two hosts are not one place
    assert planned["one"].start == NOW


def test_a_run_no_host_fits_or_past_its_latest_start_has_no_plan():
    planned = {p.run.id: p for p in plan([run("big", gpus=4), run("late", latest=-1)], [(h100s(2), [])], NOW)}
    assert planned["big"].start is None and planned["big"].meets_deadline is None
    assert planned["late"].start is None and planned["late"].meets_deadline is False
    table = {row[0]: row for row in rows(list(planned.values()), {}, NOW)}
    assert table["late"][3] == "deadline missed" and table["big"][3] == "never"


@pytest.mark.parametrize("seed", range(100))
def test_on_one_host_the_runs_planned_now_are_the_ones_a_worker_starts(seed: int):
    rng = random.Random(seed)
    runs = [run(f"r{i}", gpus=rng.randint(1, 4), hours=rng.choice([0.5, 1, 2]),
                latest=rng.choice([None, 1, 3, 10]), scheduled=-rng.random()) for i in range(rng.randint(0, 12))]
    devices = h100s(rng.randint(1, 4))
    busy = [Busy(device, NOW + HOUR * rng.randint(1, 3)) for device in h100s(rng.randint(0, 3), first=10)]
    now = {p.run.id for p in plan(runs, [(devices, busy)], NOW) if p.start == NOW}
    assert now == {r.id for r, _ in decide(runs, devices, NOW, busy, reservation_depth=10**6).start}


def test_a_published_inventory_reads_back_as_free_and_busy_devices():
    devices = h100s(3)
    value = inventories.describe("gpu", "w1", "host-a", devices, {devices[1]: NOW + HOUR, devices[2]: None})
    host = inventories.parse(value)
    assert host.free == [devices[0]]
    assert host.busy == [Busy(Device(1, "H100"), NOW + HOUR), Busy(Device(2, "H100"), None)]
    assert (host.worker, host.host) == ("w1", "host-a")


def test_each_worker_of_each_pool_has_its_own_variable_with_a_name_prefect_accepts():
    names = {inventories.variable_name(pool, worker) for pool in ("gpu", "cpu") for worker in ("E31Worker a", "b")}
    assert len(names) == 4
    assert all(name.replace("_", "").isalnum() and name.islower() for name in names)


HOST = HostInventory("w1", "gpu-host-1", h100s(1), [])


def test_submit_says_when_its_run_starts_and_how_many_runs_are_ahead_of_it():
    planned = plan([run("mine", latest=8), run("urgent", latest=0.5), run("other", latest=4)], [(HOST.free, [])], NOW)
    assert planned_line(planned, "mine", [HOST], NOW, NOW) == (
        "planned start: 2026-12-04 00:00:00Z, behind 2 run(s) on 1 live worker(s) (e31 queue shows the pool)")


def test_submit_says_a_run_for_later_starts_at_its_start_and_one_that_fits_no_worker_waits_for_one():
    assert planned_line([], "mine", [HOST], NOW + 3 * HOUR, NOW) == (
        "planned start: at its start, 2026-12-04 01:00:00Z, or when GPUs free up after it")
    planned = plan([run("mine", gpus=2)], [(HOST.free, [])], NOW)
    assert planned_line(planned, "mine", [HOST], NOW, NOW).startswith(
        "planned start: none yet; no live worker of the pool (1 live) has the GPUs it asks for")
    assert planned_line([], "mine", [], NOW, NOW).startswith("planned start: none yet; no live worker of the pool (0")
    late = plan([run("mine", latest=-1)], [(HOST.free, [])], NOW)
    assert planned_line(late, "mine", [HOST], NOW - 2 * HOUR, NOW) == (
        "planned start: never; its latest start has passed")
