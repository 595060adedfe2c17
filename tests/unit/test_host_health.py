"""A host's GPUs' health, its drains and the `e31 hosts` table, as an operator reads them (pure, or a real
health command)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from e31_prefect.host import device_health
from e31_prefect.host.inventory import Device
from e31_prefect.model.attempts import Beat
from e31_prefect.surface import drains, hosts_table
from e31_prefect.surface.inventories import HostInventory

T0 = datetime(2026, 12, 3, 2, 0, tzinfo=timezone.utc)
GPUS = [Device(0, "H100", "GPU-aaa"), Device(1, "H100", "GPU-bbb")]


def test_a_health_command_fails_only_the_device_it_names_bad_with_its_last_line_as_the_reason():
    command = ("sh -c 'echo checking {uuid}; if [ \"$E31_GPU_INDEX\" = 1 ]; then echo \"Xid 79 on GPU {index}\"; "
               "exit 3; fi'")
    assert device_health.problems(GPUS, command, None) == {1: "the health command exited 3: Xid 79 on GPU 1"}
    assert device_health.problems(GPUS, "true", None) == {}
    assert device_health.problems(GPUS, None, None) == {}


def test_a_health_command_that_cannot_run_fails_every_device_saying_why():
    found = device_health.problems(GPUS, "/nonexistent/gpu-check {index}", None)
    assert sorted(found) == [0, 1] and all("could not run" in why for why in found.values()), found


def test_a_drained_host_drains_every_gpu_and_a_malformed_drain_is_left_out():
    parsed = drains.parse({"host": "h", "devices": {"*": {"reason": "rack move", "at": "2026-12-03T02:00", "by":
                                                         "operator"}, "3": "not a drain"}})
    assert list(parsed) == ["*"]
    assert drains.by_index(parsed, [0, 1]) == {0: "rack move (operator, 2026-12-03T02:00)",
                                               1: "rack move (operator, 2026-12-03T02:00)"}
    assert drains.parse(None) == {} and drains.parse({"devices": ["x"]}) == {}


def inventory(worker: str, host: str, holders: dict[int, str] | None = None, drained: dict[int, str] | None = None,
              ) -> HostInventory:
    return HostInventory(worker=worker, host=host, free=[], busy=[], drained=drained or {}, holders=holders or {},
                         version="0.1.0", at=T0.isoformat(), models={0: "H100", 1: "H100"})


def test_the_hosts_table_shows_each_gpu_free_rented_or_drained_and_a_silent_host_lost():
    now = T0 + timedelta(seconds=200)
    table = hosts_table.rows(
        [inventory("w-a", "a", holders={0: "run-id"}), inventory("w-b", "b")],
        {"w-a": "ONLINE", "w-b": "OFFLINE"},
        {"a": Beat("a", now - timedelta(seconds=3), 120), "b": Beat("b", now - timedelta(seconds=150), 120)},
        {"a": drains.parse({"devices": {"1": {"reason": "ECC errors", "at": "02:01", "by": "health"}}})},
        {"run-id": "amber-otter"}, 120, now)
    by_gpu = {(row["host"], row["gpu"]): row for row in table}
    assert by_gpu[("a", "0")]["gpu state"] == "rented" and by_gpu[("a", "0")]["run"] == "amber-otter"
    assert by_gpu[("a", "1")]["gpu state"] == "drained: ECC errors (health, 02:01)"
    assert by_gpu[("a", "0")]["state"] == "up" and "(3 s ago)" in by_gpu[("a", "0")]["last heartbeat"]
    assert by_gpu[("b", "0")]["state"] == "lost" and by_gpu[("b", "0")]["gpu state"] == "free"
    assert by_gpu[("b", "0")]["worker"] == "w-b (offline)" and by_gpu[("b", "0")]["version"] == "0.1.0"
    text = hosts_table.render(table)
    assert text.splitlines()[0].split() == ["HOST", "STATE", "GPU", "MODEL", "GPU", "STATE", "RUN", "LAST",
                                            "HEARTBEAT", "WORKER", "VERSION"]
    assert len(text.splitlines()) == 5
