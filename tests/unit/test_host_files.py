"""The worker's files on the host closed to jobs: E31_HOME's folders, the device lock folder, and a device lock
held by no e31 process named in the log."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

import pytest

from e31_prefect.host.home_files import Found, HomeOpen, close_home, closed_mode, plan_closing
from e31_prefect.host.inventory import Device, DeviceLocksError, Inventory, plan_lock_folder
from e31_prefect.host.lock_holders import Holder, StrangerWatch, Throttle, describe, flock_pids, holders, is_e31

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="a job's own uid needs a root worker")
DIR = stat.S_IFDIR


@pytest.fixture
def open_folder() -> Iterator[Path]:
    """A folder any user may pass, and every folder above it too (pytest's own are 0700): where an operator
    might put E31_HOME or the device locks."""
    folder = Path(tempfile.mkdtemp(prefix="e31-open-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def as_job_uid(*argv: str) -> subprocess.CompletedProcess[str]:
    """A command run as a job's own uid (61999, no groups), as a process job runs."""
    def drop() -> None:
        os.setgroups([])
        os.setgid(61999)
        os.setuid(61999)

    return subprocess.run(argv, capture_output=True, text=True, preexec_fn=drop, cwd="/")


# -- E31_HOME ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "closed"), [
    (0o755, 0o700), (0o644, 0o600), (0o700, 0o700), (0o750, 0o700), (0o2775, 0o2700), (0o400, 0o400)])
def test_closed_mode_leaves_its_owner_alone(mode, closed):
    assert closed_mode(Found(Path("/h/cache"), DIR | mode, 0, 0)) == closed


def test_an_open_folder_of_another_user_is_refused_naming_it_and_the_fix():
    mode, refusal = plan_closing(Found(Path("/h/cache"), DIR | 0o755, 1001, 1001), worker_uid=1002)
    assert mode is None
    assert "/h/cache" in refusal and "0755" in refusal and "uid 1001" in refusal and "chmod o-rwx" in refusal
    assert plan_closing(Found(Path("/h/cache"), DIR | 0o700, 1001, 1001), worker_uid=1002) == (None, None)
    assert plan_closing(Found(Path("/h/cache"), DIR | 0o755, 1001, 1001), worker_uid=0) == (0o700, None)


def test_close_home_makes_its_folders_closed_and_closes_those_found_open(tmp_path):
    home = tmp_path / "e31"
    (home / "cache" / "objects").mkdir(parents=True)
    (home / "cache").chmod(0o755)
    (home / "accounting.jsonl").write_text("{}\n")
    (home / "accounting.jsonl").chmod(0o644)
    said = close_home(home)
    assert sorted(said) == sorted([
        f"{home / 'cache'} was open to other users (0755): closed it (0700), so no job reads what it holds",
        f"{home / 'accounting.jsonl'} was open to other users (0644): closed it (0600), so no job reads what "
        "it holds"])
    for name in ("workspaces", "cache", "ledger", "spool", "outputs"):
        assert stat.S_IMODE((home / name).stat().st_mode) == 0o700, name
    assert close_home(home) == [], "closed folders are left as they are, and nothing is said"


@ROOT_ONLY
def test_a_job_uid_reads_nothing_of_a_closed_home(open_folder):
    home = open_folder / "e31"
    close_home(home)
    (home / "cache" / "objects").mkdir()
    (home / "cache" / "objects" / "key").write_text("another team's object")
    (home / "cache" / "objects" / "key").chmod(0o444)
    seen = as_job_uid("cat", str(home / "cache" / "objects" / "key"))
    assert seen.returncode != 0 and "Permission denied" in seen.stderr


def test_close_home_refuses_an_open_folder_it_cannot_close(tmp_path, monkeypatch):
    home = tmp_path / "e31"
    (home / "spool").mkdir(parents=True)
    (home / "spool").chmod(0o755)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(home).st_uid + 1)
    with pytest.raises(HomeOpen, match="spool is 0755"):
        close_home(home)


# -- the device lock folder -------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "uid", "gid", "worker", "expected"), [
    (0o2770, 0, 0, 0, (None, None)),
    (0o2770, 5, 50, 7, (None, None)),  # another user's, closed: this worker uses it through the group
    (0o1777, 0, 0, 0, (0o2770, None)),  # e31 before: open to every uid, closed by root
    (0o1777, 7, 7, 7, (0o2770, None)),
    (0o2770, 7, 61005, 7, (0o2770, None)),  # a job's group: open to that job
])
def test_plan_lock_folder(mode, uid, gid, worker, expected):
    assert plan_lock_folder(DIR | mode, uid, gid, worker) == expected


def test_an_open_lock_folder_of_another_user_is_refused_with_the_fix():
    mode, refusal = plan_lock_folder(DIR | 0o1777, 0, 0, 1001)
    assert mode is None
    assert refusal.startswith("E31_DEVICE_LOCKS:") and "1777" in refusal and "chmod 2770" in refusal


def test_an_open_lock_folder_is_closed_and_said(tmp_path, caplog):
    folder = tmp_path / "locks"
    folder.mkdir()
    folder.chmod(0o1777)
    (folder / "gpu-0.lock").touch(0o666)
    (folder / "gpu-0.lock").chmod(0o666)
    with caplog.at_level(logging.WARNING):
        assert Inventory([Device(0, "H100")], folder).free() == [Device(0, "H100")]
    assert stat.S_IMODE(folder.stat().st_mode) == 0o2770
    assert stat.S_IMODE((folder / "gpu-0.lock").stat().st_mode) == 0o660
    assert f"{folder} was open to other users (1777)" in caplog.text


def test_a_lock_folder_closed_to_the_worker_is_refused_naming_the_group(tmp_path, monkeypatch):
    folder = tmp_path / "locks"
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)
    with pytest.raises(DeviceLocksError, match="add that user to the folder's group"):
        Inventory([Device(0, "H100")], folder).prepare()


@ROOT_ONLY
def test_a_job_uid_cannot_open_a_device_lock(open_folder):
    folder = open_folder / "locks"
    inventory = Inventory([Device(0, "H100")], folder)
    run = uuid4()
    assert inventory.hold(run, inventory.devices)
    inventory.give_back(run)  # the lock file stays, unheld
    tried = as_job_uid("flock", "--nonblock", str(folder / "gpu-0.lock"), "echo", "locked")
    assert "locked" not in tried.stdout and "Permission denied" in tried.stderr
    assert inventory.free() == inventory.devices


# -- who holds a lock -------------------------------------------------------------------------


def test_flock_pids_reads_proc_locks_for_one_file():
    device = os.makedev(0xFE, 0)
    text = ("1: FLOCK  ADVISORY  WRITE 4069 fe:00:1482821 0 EOF\n"
            "1: -> FLOCK  ADVISORY  WRITE 4070 fe:00:1482821 0 EOF\n"  # a waiter holds nothing
            "2: POSIX  ADVISORY  WRITE 12 fe:00:1482821 0 EOF\n"
            "3: FLOCK  ADVISORY  WRITE 77 fe:01:1482821 0 EOF\n"
            "4: FLOCK  ADVISORY  WRITE 78 fe:00:99 0 EOF\n"
            "garbage\n5: FLOCK ADVISORY WRITE x y:z 0 EOF\n")
    assert flock_pids(text, device, 1482821) == [4069]


@pytest.mark.parametrize(("argv", "e31"), [
    (["/usr/bin/python3", "-m", "e31_prefect.supervisor", "/root/.e31/ledger/x"], True),
    (["/venv/bin/python", "/venv/bin/e31", "run", "job.yaml"], True),
    (["/venv/bin/python", "/venv/bin/prefect", "worker", "start", "--pool", "gpu", "--type", "e31"], True),
    (["/venv/bin/python", "-m", "e31_prefect.job_entry"], False),  # a job is no worker
    (["flock", "/run/lock/e31/gpu-0.lock", "sleep", "600"], False),
    ([], False),
])
def test_is_e31(argv, e31):
    assert is_e31(argv) is e31


def test_describe_names_the_lock_and_each_holder():
    line = describe(Path("/run/lock/e31/gpu-0.lock"), [Holder(42, 61000, ("flock", "gpu-0.lock", "sleep", "9"))])
    assert "/run/lock/e31/gpu-0.lock" in line and "pid 42 (uid 61000: flock gpu-0.lock sleep 9)" in line
    assert "a process this worker cannot see" in describe(Path("/l"), [])


def test_throttle_acts_once_per_interval_per_key():
    throttle = Throttle(600)
    assert [throttle.due("a", t) for t in (0, 1, 599)] == [True, False, False]
    assert throttle.due("b", 1) and throttle.due("a", 600)


def test_a_device_locked_by_no_e31_process_is_named_in_the_log_once(tmp_path, caplog):
    folder = tmp_path / "locks"
    inventory = Inventory([Device(0, "H100"), Device(1, "H100")], folder)
    inventory.prepare()
    lock = folder / "gpu-1.lock"
    stranger = subprocess.Popen(
        [sys.executable, "-c", f"import fcntl, os, sys; fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert stranger.stdout.readline().strip() == "locked"
        assert [h.pid for h in holders(lock)] == [stranger.pid]
        with caplog.at_level(logging.WARNING):
            assert inventory.free() == [Device(0, "H100")]
            assert inventory.free() == [Device(0, "H100")]
        named = [r.getMessage() for r in caplog.records if str(lock) in r.getMessage()]
        assert len(named) == 1, named
        assert f"pid {stranger.pid} (uid {os.geteuid()}: {sys.executable} -c" in named[0]
    finally:
        stranger.communicate("")


def test_a_device_held_by_a_supervisor_is_not_named(tmp_path, caplog):
    folder = tmp_path / "locks"
    worker = Inventory([Device(0, "H100")], folder)
    run = uuid4()
    assert worker.hold(run, worker.devices)
    # A run's supervisor, as the worker starts it: the lock file passed to `python -m e31_prefect.host.supervisor`.
    supervisor = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", "-m",
                                   "e31_prefect.supervisor", str(tmp_path)],
                                  stdin=subprocess.PIPE, pass_fds=worker.lock_files(run))
    try:
        worker.give_back(run)
        watch = StrangerWatch(logging.getLogger("test"))
        with caplog.at_level(logging.WARNING):
            watch.locked(folder / "gpu-0.lock")
        assert caplog.records == []
    finally:
        supervisor.communicate(b"")
