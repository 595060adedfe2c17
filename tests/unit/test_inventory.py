"""Unit tests for e31_prefect.host.inventory: declared inventories, NVML discovery, renting devices.

``E31_GPUS`` declares devices (``0:H100,1:H100``, ``4xH100``, ``2xA100,2xH100``); without it the
worker asks NVML, which finds none where there is no NVIDIA driver. Renting is all-or-nothing,
per flow run, and safe between threads.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import types
from pathlib import Path
from uuid import UUID, uuid4

import pytest

from e31_prefect.host import inventory
from e31_prefect.host.inventory import (
    Device,
    Inventory,
    InventoryError,
    discover,
    discover_nvml,
    gpu_minors,
    matches,
    parse_declared,
    pick_devices,
    visible_devices_env,
)

H100_NAME = "NVIDIA H100 80GB HBM3"


# -- parse_declared ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0:H100,1:H100", [Device(0, "H100"), Device(1, "H100")]),
        ("4xH100", [Device(i, "H100") for i in range(4)]),
        (
            "2xA100,2xH100",
            [Device(0, "A100"), Device(1, "A100"), Device(2, "H100"), Device(3, "H100")],
        ),
        (" 1 : H100 , 0:A100 ", [Device(0, "A100"), Device(1, "H100")]),
        ("2 X L4", [Device(0, "L4"), Device(1, "L4")]),
        ("3:H100,2xA100", [Device(3, "H100"), Device(4, "A100"), Device(5, "A100")]),
        (f"0:{H100_NAME}", [Device(0, H100_NAME)]),
        ("0:", [Device(0, "GPU")]),
        ("0xH100", []),
        ("", []),
        ("  ", []),
        (",,", []),
    ],
)
def test_parse_declared(text, expected):
    assert parse_declared(text) == expected


@pytest.mark.parametrize("token", ["H100", "x:H100", "-1:H100", "xH100", "H100x2", "four x H100"])
def test_parse_declared_refuses_a_bad_token_naming_E31_GPUS(token):
    with pytest.raises(InventoryError) as caught:
        parse_declared(f"0:H100,{token}")
    assert str(caught.value) == (
        f"E31_GPUS: {token!r} is not a device; write INDEX:TYPE (0:H100) or COUNTxTYPE (4xH100)"
    )
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("text", ["0:H100,0:A100", "1:H100,1:H100", "2xA100,1:H100"])
def test_parse_declared_refuses_a_duplicate_index(text):
    with pytest.raises(InventoryError) as caught:
        parse_declared(text)
    assert str(caught.value) == f"E31_GPUS: {text!r} declares a device index twice"


# -- discover ---------------------------------------------------------------------------------


def test_discover_prefers_the_declared_inventory(monkeypatch: pytest.MonkeyPatch):
    def no_nvml():
        raise AssertionError("NVML must not be asked when an inventory is declared")

    monkeypatch.setattr(inventory, "discover_nvml", no_nvml)
    assert discover("2xH100") == [Device(0, "H100"), Device(1, "H100")]


@pytest.mark.parametrize("declared", [None, "", "   "])
def test_discover_falls_back_to_nvml(monkeypatch: pytest.MonkeyPatch, declared):
    found = [Device(0, H100_NAME, "GPU-1234")]
    monkeypatch.setattr(inventory, "discover_nvml", lambda: found)
    assert discover(declared) is found


def test_discover_passes_a_bad_declaration_on_as_an_error():
    with pytest.raises(InventoryError, match="E31_GPUS"):
        discover("lots of GPUs")


def has_nvidia_driver() -> bool:
    return Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia").exists()


@pytest.mark.skipif(has_nvidia_driver(), reason="this machine has an NVIDIA driver")
def test_nvml_finds_nothing_on_a_machine_without_a_gpu():
    assert discover_nvml() == []
    assert discover(None) == []


def test_nvml_without_the_library_finds_nothing(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    assert discover_nvml() == []


def fake_pynvml(names: list[str | bytes], *, fail_init: bool = False,
                minors: list[int | None] | None = None) -> types.ModuleType:
    module = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    calls: list[str] = []

    def init():
        calls.append("init")
        if fail_init:
            raise NVMLError("driver not loaded")

    module.NVMLError = NVMLError
    module.nvmlInit = init
    module.nvmlShutdown = lambda: calls.append("shutdown")
    module.nvmlDeviceGetCount = lambda: len(names)
    module.nvmlDeviceGetHandleByIndex = lambda i: i
    module.nvmlDeviceGetName = lambda handle: names[handle]
    module.nvmlDeviceGetUUID = lambda handle: f"GPU-{handle:04d}".encode()

    def minor(handle):
        found = (minors or list(range(len(names))))[handle]
        if found is None:
            raise NVMLError("not supported")
        return found

    module.nvmlDeviceGetMinorNumber = minor
    module.calls = calls
    return module


def test_nvml_that_does_not_initialise_finds_nothing(monkeypatch: pytest.MonkeyPatch):
    fake = fake_pynvml([H100_NAME], fail_init=True)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert discover_nvml() == []
    assert fake.calls == ["init"]


def test_nvml_devices_are_read_and_nvml_is_shut_down(monkeypatch: pytest.MonkeyPatch):
    fake = fake_pynvml([H100_NAME.encode(), "NVIDIA A100-SXM4-40GB"])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert discover_nvml() == [
        Device(0, H100_NAME, "GPU-0000"),
        Device(1, "NVIDIA A100-SXM4-40GB", "GPU-0001"),
    ]
    assert fake.calls == ["init", "shutdown"]


def test_a_gpus_node_is_its_minor_number_as_nvml_tells_it_and_a_declared_ones_is_its_index(monkeypatch):
    """NVML counts GPUs by PCI bus; the driver numbers their nodes (/dev/nvidia<minor>) as it found them."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([H100_NAME] * 3, minors=[2, 0, None]))
    found = discover_nvml()
    assert [(d.index, d.minor) for d in found] == [(0, 2), (1, 0), (2, None)]
    assert gpu_minors(found) == [2, 0, 2], "a minor NVML cannot tell is the index"
    assert gpu_minors(parse_declared("0:A100,1:H100,3:H100")) == [0, 1, 3]
    assert Device(0, H100_NAME, "GPU-0000", minor=2) == Device(0, H100_NAME, "GPU-0000"), "one device, one key"


# -- matches and pick_devices -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu_type", "expected"),
    [(None, True), ("H100", True), ("h100", True), ("nvidia h100", True), ("80GB", True),
     ("A100", False), ("H100 PCIe", False)],
)
def test_matches_is_a_case_insensitive_substring(gpu_type, expected):
    assert matches(Device(0, H100_NAME), gpu_type) is expected


def test_pick_devices_takes_the_lowest_indexed_of_the_right_type_all_one_model():
    free = [Device(3, "H100"), Device(0, "A100"), Device(1, "H100"), Device(2, "H100")]
    assert pick_devices(free, 2, "h100") == [Device(1, "H100"), Device(2, "H100")]
    assert pick_devices(free, 2, None) == [Device(1, "H100"), Device(2, "H100")]
    assert pick_devices(free, 1, None) == [Device(0, "A100")]
    assert pick_devices([Device(0, "A100"), Device(1, "H100")], 2, None) is None
    assert pick_devices(free, 0, "T4") == []
    assert pick_devices(free, 4, "H100") is None
    assert pick_devices(free, 1, "T4") is None


# -- Inventory: renting -----------------------------------------------------------------------

FOUR = [Device(i, "H100") for i in range(4)]


def test_free_lists_every_device_sorted_at_first():
    pool = Inventory(reversed(FOUR))
    assert pool.devices == FOUR
    assert pool.free() == FOUR


def test_hold_and_give_back():
    pool, run = Inventory(FOUR), uuid4()
    assert pool.hold(run, [FOUR[2], FOUR[0]]) is True
    assert pool.held_by(run) == [FOUR[0], FOUR[2]]
    assert pool.free() == [FOUR[1], FOUR[3]]
    assert pool.give_back(run) == [FOUR[0], FOUR[2]]
    assert pool.free() == FOUR
    assert pool.held_by(run) == []


def test_hold_is_all_or_nothing():
    pool, first, second = Inventory(FOUR), uuid4(), uuid4()
    assert pool.hold(first, [FOUR[1]])
    assert pool.hold(second, [FOUR[0], FOUR[1], FOUR[2]]) is False
    assert pool.held_by(second) == []
    assert pool.free() == [FOUR[0], FOUR[2], FOUR[3]]


def test_hold_refuses_a_device_not_on_this_host():
    pool, run = Inventory(FOUR), uuid4()
    assert pool.hold(run, [FOUR[0], Device(9, "H100")]) is False
    assert pool.held_by(run) == []
    assert pool.free() == FOUR


def test_holding_again_what_a_run_already_holds_is_fine():
    pool, run = Inventory(FOUR), uuid4()
    assert pool.hold(run, [FOUR[0]])
    assert pool.hold(run, [FOUR[0], FOUR[1]])
    assert pool.held_by(run) == [FOUR[0], FOUR[1]]


def test_holding_nothing_succeeds_and_holds_nothing():
    pool, run = Inventory(FOUR), uuid4()
    assert pool.hold(run, []) is True
    assert pool.free() == FOUR


def test_give_back_is_idempotent():
    pool, run, other = Inventory(FOUR), uuid4(), uuid4()
    pool.hold(run, FOUR[:2])
    pool.hold(other, FOUR[2:3])
    assert pool.give_back(run) == FOUR[:2]
    assert pool.give_back(run) == []
    assert pool.give_back(uuid4()) == []
    assert pool.held_by(other) == [FOUR[2]]
    assert pool.free() == [FOUR[0], FOUR[1], FOUR[3]]


def test_two_runs_never_hold_the_same_device():
    pool, first, second = Inventory(FOUR), uuid4(), uuid4()
    assert pool.hold(first, FOUR[:2])
    assert pool.hold(second, FOUR[1:3]) is False
    assert pool.hold(second, FOUR[2:])
    assert not set(pool.held_by(first)) & set(pool.held_by(second))
    pool.give_back(first)
    assert pool.hold(second, FOUR[:1])
    assert pool.free() == [FOUR[1]]


def test_a_run_planned_while_its_work_loads_holds_nothing_on_the_host(tmp_path):
    worker, other = Inventory(FOUR, tmp_path), Inventory(FOUR, tmp_path)  # two workers on one host
    loading = uuid4()
    worker.plan(loading, FOUR[:2], seconds=60)
    assert worker.planned() == {FOUR[0]: loading, FOUR[1]: loading}, "this worker's polls plan around them"
    assert worker.free() == FOUR and worker.held_by(loading) == []
    assert other.hold(uuid4(), FOUR[:1]), "another worker's run rents a planned device at once"


def test_a_ready_run_rents_its_planned_devices_else_what_is_free_else_nothing():
    pool, run, second, elsewhere = Inventory(FOUR), uuid4(), uuid4(), uuid4()
    pool.plan(run, FOUR[2:3], seconds=60)
    pool.plan(second, FOUR[0:1], seconds=60)
    assert pool.choose(run, 1, None) == [FOUR[2]]
    assert pool.hold(elsewhere, [FOUR[2]])  # rented to another run while this one loaded
    assert pool.choose(run, 1, None) == [FOUR[1]], "what is free, before a device another loading run plans on"
    assert pool.hold(run, [FOUR[1]]) and pool.planned() == {FOUR[0]: second}, "holding ends its plan"
    pool.hold(uuid4(), [FOUR[3]])
    assert pool.choose(uuid4(), 1, None) == [FOUR[0]], "a loading run's planned device, where nothing else is free"
    assert pool.choose(uuid4(), 2, None) is None


def test_a_plan_past_its_time_delays_no_other_run_and_goes_with_the_run():
    pool, slow, gone = Inventory(FOUR), uuid4(), uuid4()
    pool.plan(slow, FOUR[:1], seconds=0)
    assert pool.planned() == {}, "a run loading for longer than a run should is planned around no more"
    pool.plan(gone, FOUR[1:2], seconds=60)
    pool.give_back(gone)
    assert pool.planned() == {}


def test_threads_racing_for_the_same_devices_never_share_one():
    pool = Inventory([Device(i, "H100") for i in range(8)])
    runs = [uuid4() for _ in range(32)]
    won: dict[UUID, list[Device]] = {}
    start = threading.Barrier(len(runs))

    def claim(run_id: UUID, seed: int) -> None:
        wanted = random.Random(seed).sample(pool.devices, 3)
        start.wait()
        if pool.hold(run_id, wanted):
            won[run_id] = wanted

    threads = [threading.Thread(target=claim, args=(r, i)) for i, r in enumerate(runs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert won, "at least the first run to get the lock holds its devices"
    taken = [d for devices in won.values() for d in devices]
    assert len(taken) == len(set(taken))
    for run_id in runs:
        assert pool.held_by(run_id) == sorted(won.get(run_id, []))


def test_threads_holding_and_giving_back_never_overlap():
    pool = Inventory([Device(i, "H100") for i in range(4)])
    occupied: dict[Device, UUID] = {}
    guard = threading.Lock()
    failures: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            run_id = uuid4()
            wanted = rng.sample(pool.devices, rng.randint(1, 2))
            if not pool.hold(run_id, wanted):
                continue
            with guard:
                for device in wanted:
                    if device in occupied:
                        failures.append(f"{device} held by {occupied[device]} and {run_id}")
                    occupied[device] = run_id
            with guard:
                for device in wanted:
                    occupied.pop(device, None)
            if sorted(pool.give_back(run_id)) != sorted(wanted):
                failures.append(f"{run_id} gave back something else than {wanted}")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert pool.free() == pool.devices


# -- one renter per device per host ----------------------------------------------------------


def test_two_workers_on_one_host_never_rent_the_same_device(tmp_path):
    """Two inventories on one lock folder are two e31 worker processes on one host (any pool, any E31_HOME)."""
    first, second = Inventory(FOUR, tmp_path), Inventory(FOUR, tmp_path)
    a, b = uuid4(), uuid4()
    assert first.hold(a, FOUR[:2])
    assert second.free() == FOUR[2:]
    assert second.hold(b, FOUR[1:3]) is False
    assert second.held_by(b) == []
    assert second.hold(b, FOUR[2:])
    assert first.free() == []
    first.give_back(a)
    assert second.free() == FOUR[:2]


def test_a_device_stays_rented_while_any_process_holds_its_lock(tmp_path):
    """The supervisor inherits the lock files; the worker letting go does not free the device."""
    worker, other = Inventory(FOUR, tmp_path), Inventory(FOUR, tmp_path)
    run = uuid4()
    assert worker.hold(run, FOUR[:1])
    files = worker.lock_files(run)
    assert len(files) == 1
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                              pass_fds=files)
    try:
        worker.give_back(run)
        assert other.free() == FOUR[1:], "the child holds GPU 0 after the worker gave it back"
    finally:
        holder.communicate(b"")
    assert other.free() == FOUR, "the kernel drops the lock when its last holder exits"


def test_a_killed_holder_frees_its_devices(tmp_path):
    code = ("from uuid import uuid4; from pathlib import Path; "
            "from e31_prefect.host.inventory import Inventory, Device;"
            f"i = Inventory([Device(0, 'H100')], Path({str(tmp_path)!r})); assert i.hold(uuid4(), i.devices);"
            "print('held', flush=True); import time; time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    other = Inventory([Device(0, "H100")], tmp_path)
    assert other.free() == []
    assert other.hold(uuid4(), other.devices) is False
    holder.kill()
    holder.wait()
    assert other.free() == other.devices


def test_the_lock_folder_is_shared_by_its_group_and_closed_to_others(tmp_path):
    folder = tmp_path / "locks"
    Inventory(FOUR, folder).free()
    assert folder.stat().st_mode & 0o7777 == 0o2770, "its group's workers share it; no job's uid opens it"
    pool = Inventory(FOUR, folder)
    pool.hold(uuid4(), FOUR[:1])
    assert os.stat(folder / "gpu-0.lock").st_mode & 0o777 == 0o660


# -- visible_devices_env ----------------------------------------------------------------------


def test_visible_devices_env_for_no_devices_hides_every_gpu():
    assert visible_devices_env([]) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "",
        "NVIDIA_VISIBLE_DEVICES": "none",
    }


def test_visible_devices_env_shows_exactly_the_rented_devices():
    assert visible_devices_env([Device(1, "H100"), Device(3, "H100")]) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "1,3",
        "NVIDIA_VISIBLE_DEVICES": "1,3",
    }
