"""A GPU that fails, and GPUs an operator drains: no new run lands there, and a failed GPU's run runs again.

The GPUs are declared (this machine has none); the operator's health command is the one that goes bad, as
NVML's word would on a GPU host.
"""

from __future__ import annotations

import json
from pathlib import Path
from uuid import UUID

import pytest

from e31_prefect.host.ledger import RunFolder
from tests.integration.conftest import cli
from tests.integration.test_jobs_end_to_end import read_run
from tests.integration.test_lost_hosts import completed, meters, states, submit
from tests.integration.test_worker_faults import until

pytestmark = pytest.mark.integration


def health_command(folder: Path) -> str:
    """A health command that fails a GPU once the file ``bad-<index>`` exists in ``folder``."""
    return (f"sh -c 'if [ -e {folder}/bad-{{index}} ]; then echo \"uncorrectable ECC errors on GPU {{index}}\"; "
            "exit 1; fi'")


def rented_device(home: Path, run_id: UUID) -> list[int]:
    """The GPU the run holds as it runs (as a list: GPU 0 is a device too); none before."""
    holding = RunFolder(home / "ledger" / str(run_id)).holding()
    return holding.devices[:1] if holding is not None and read_run(run_id).state.is_running() else []


def gpu_line(table: str, host: str, gpu: int) -> str:
    """The line of ``e31 hosts`` about one GPU of a host."""
    return next(line for line in table.splitlines() if line.startswith(host) and line.split()[2] == str(gpu))


def test_a_failed_gpu_is_drained_and_its_run_runs_again_on_another(prefect_server, tmp_path, pool, hosts):
    health = tmp_path / "health"
    health.mkdir()
    host = hosts("host-a", E31_GPUS="2xH100", E31_GPU_HEALTH_COMMAND=health_command(health),
                 E31_GPU_HEALTH_SECONDS="0.5").start()
    run_id = submit(tmp_path, pool, "ecc", seconds=3, first_seconds=600)
    [failing] = until(lambda: rented_device(host.home, run_id), 180, "the run starting")
    (health / f"bad-{failing}").write_text("")
    requeued = until(lambda: next((s for s in states(run_id) if s.name == "DeviceFailed"), None), 60,
                     "the failed GPU's run going back to the queue")
    assert f"GPU {failing} of host {host.name} failed" in requeued.message, requeued.message
    assert "uncorrectable ECC errors" in requeued.message
    until(lambda: completed(run_id), 180, "the run completing on the other GPU")
    ran = json.loads((tmp_path / "ecc" / "out" / "ran.json").read_text())
    assert ran["devices"] == str(1 - failing), "the requeued run was given the failed GPU again"
    tables = meters(run_id)
    assert sorted(tables) == ["e31-meter-ecc", "e31-meter-ecc-attempt-2"], tables
    run = read_run(run_id)
    assert run.state.is_completed() and "e31:attempts=2" in run.tags
    shown = cli("e31", "hosts", "--pool", pool)
    assert shown.returncode == 0, shown.stderr
    line = gpu_line(shown.stdout, host.name, failing)
    assert "drained: the health command exited 1: uncorrectable ECC errors" in line, shown.stdout
    # Repaired: the operator undrains it, and it rents again.
    (health / f"bad-{failing}").unlink()
    assert cli("e31", "undrain", host.name, str(failing)).returncode == 0
    until(lambda: "drained:" not in gpu_line(cli("e31", "hosts", "--pool", pool).stdout, host.name, failing), 60,
          "the GPU taking runs again")


def test_a_drained_gpu_takes_no_new_run_and_its_running_one_finishes(prefect_server, tmp_path, pool, hosts):
    host = hosts("host-a", E31_GPUS="2xH100", E31_GPU_HEALTH_SECONDS="0.5").start()
    first = submit(tmp_path, pool, "before", seconds=6)
    [device] = until(lambda: rented_device(host.home, first), 180, "the first run starting")
    drained = cli("e31", "drain", host.name, str(device), "--reason", "fan replacement, ticket 4121")
    assert drained.returncode == 0, drained.stderr
    until(lambda: "fan replacement" in cli("e31", "hosts", "--pool", pool).stdout, 60, "the drain being taken in")
    second = submit(tmp_path, pool, "after", seconds=1)
    until(lambda: completed(first, attempts=1) and completed(second, attempts=1), 180, "both runs completing")
    assert json.loads((tmp_path / "before" / "out" / "ran.json").read_text())["devices"] == str(device), \
        "the running work did not finish where it ran"
    assert json.loads((tmp_path / "after" / "out" / "ran.json").read_text())["devices"] == str(1 - device)
    queue = cli("e31", "queue", "--pool", pool)
    assert f"{host.name} GPU {device}: fan replacement, ticket 4121" in queue.stdout, queue.stdout
