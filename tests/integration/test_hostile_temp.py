"""A process job leaves what it can on the host; a later job given the same uid finds none of it.

Job uids are reused: a hostile job writes 0600 files to every world-writable folder it finds
(``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``, one the operator made), makes SysV shared memory
and a message queue, and starts a ``setsid`` daemon that keeps writing. The next job of that uid
(another team's) looks for all of it. It also tries to hold the lock file of a GPU it never rented.

These need a worker running as root (a job's own uid and namespaces); a container has its own
``/tmp`` and IPC already, so they run the process runtime.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.conftest import cli
from tests.integration.test_jobs_end_to_end import write_job
from tests.integration.test_worker_faults import until

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(os.geteuid() != 0, reason="a job's own uid needs a worker running as root")]

KEY = 0x0E31_7E3D  # the SysV key both jobs use
UID = 61977  # the only uid the tests' jobs may take (E31_JOB_UIDS), so the second job gets the first one's
HOST_TEMP = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")

LEAVE = """
import ctypes, json, os, subprocess, sys, time
from pathlib import Path
from prefect import flow

DAEMON = '''
import os, time
while True:
    fd = os.open("/tmp/e31-daemon", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.write(fd, b"the-secret")
    os.close(fd)
    time.sleep(0.1)
'''

@flow
def leave(folders: list[str], key: int) -> None:
    seen = {"uid": os.geteuid(), "wrote": [], "refused": {}}
    for folder in folders:
        path = os.path.join(folder, "e31-secret")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.write(fd, b"the-secret")
            os.close(fd)
            seen["wrote"].append(path)
        except OSError as error:
            seen["refused"][path] = str(error)
    try:
        Path("/dev/shm/e31-big").write_bytes(b"x" * 8 * 2**20)
        seen["big"] = "written"
    except OSError as error:
        seen["big"] = error.strerror
    os.unlink("/dev/shm/e31-big") if os.path.exists("/dev/shm/e31-big") else None
    libc = ctypes.CDLL(None, use_errno=True)
    seen["shm"] = libc.shmget(key, 4096, 0o1600)  # IPC_CREAT | 0600
    seen["msg"] = libc.msgget(key, 0o1600)
    subprocess.Popen([sys.executable, "-c", DAEMON], start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = time.monotonic()  # its interpreter may take seconds to start on a busy host
    while not os.path.exists("/tmp/e31-daemon") and time.monotonic() - started < 60:
        time.sleep(0.05)
    seen["daemon_wrote"] = os.path.exists("/tmp/e31-daemon")
    Path(os.environ["E31_OUTPUT_DIR"], "seen.json").write_text(json.dumps(seen))
"""

LOOK = """
import ctypes, json, os
from pathlib import Path
from prefect import flow

@flow
def look(folders: list[str], key: int) -> None:
    seen = {"uid": os.geteuid(), "found": {}}
    for folder in folders:
        for name in ("e31-secret", "e31-daemon"):
            try:
                seen["found"][os.path.join(folder, name)] = Path(folder, name).read_text()
            except OSError:
                pass
    libc = ctypes.CDLL(None, use_errno=True)
    seen["shm"] = libc.shmget(key, 0, 0)
    seen["msg"] = libc.msgget(key, 0)
    Path(os.environ["E31_OUTPUT_DIR"], "seen.json").write_text(json.dumps(seen))
"""

SEE = """
import fcntl, json, os
from pathlib import Path
from prefect import flow

@flow
def see(lock: str) -> None:
    # A process of the host holds this lock while it lives: a job sees no process of the host in its own /proc,
    # but a lock is the kernel's, whatever the namespace.
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        seen = {"planted_alive": False}
    except BlockingIOError:
        seen = {"planted_alive": True}
    Path(os.environ["E31_OUTPUT_DIR"], "seen.json").write_text(json.dumps(seen))
"""

GRAB = """
import fcntl, json, os
from pathlib import Path
from prefect import flow

@flow
def grab(device_locks: str, user_locks: str) -> None:
    seen = {"devices": {}, "user_locks": None}
    for index in (0, 1):
        path = os.path.join(device_locks, f"gpu-{index}.lock")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seen["devices"][path] = "held"
        except OSError as error:
            seen["devices"][path] = error.strerror
    try:
        seen["user_locks"] = os.listdir(user_locks)
    except OSError as error:
        seen["user_locks"] = error.strerror
    Path(os.environ["E31_OUTPUT_DIR"], "seen.json").write_text(json.dumps(seen))
"""


@pytest.fixture
def spare_folder() -> Path:
    """A world-writable folder an operator made on the host (none of the usual temp folders)."""
    folder = Path(f"/var/lib/e31-tests-{uuid.uuid4().hex[:8]}")
    folder.mkdir()
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def nothing_of_the_uid_left() -> None:
    """Whatever a test's jobs left on the host, gone after it (where the fix is missing, so much is)."""
    yield
    for folder in HOST_TEMP:
        for name in ("e31-secret", "e31-daemon"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))
    libc = ctypes.CDLL(None, use_errno=True)
    for ident in owned_ipc("shm"):
        libc.shmctl(ident, 0, None)
    for ident in owned_ipc("msg"):
        libc.msgctl(ident, 0, None)


def owned_ipc(kind: str) -> list[int]:
    """Ids of the host's SysV IPC objects of this kind that the tests' job uid owns."""
    lines = Path("/proc/sysvipc", kind).read_text().splitlines()
    header = lines[0].split()
    return [int(row[1]) for row in (line.split() for line in lines[1:])
            if str(UID) in (row[header.index("uid")], row[header.index("cuid")])]


def owned_on_host(folders: list[str]) -> list[str]:
    """What the tests' job uid owns in these host folders (not in the job's view: in the tests' own)."""
    return [entry.path for folder in folders for entry in os.scandir(folder)
            if entry.stat(follow_symlinks=False).st_uid == UID]


def held_by_another(lock: Path) -> bool:
    """Whether another process holds a flock on this file."""
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def processes_of_uid() -> list[int]:
    """Live processes running as the tests' job uid."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}").st_uid == UID:
                    found.append(int(entry))
    return found


def run(tmp_path: Path, name: str, flow: str, entry: str, parameters: dict, pool: str, gpus: int = 0,
        env: dict[str, str] | None = None) -> dict:
    """Run a job of this flow to its end on a worker whose jobs take uid :data:`UID`; what it saw."""
    job = write_job(tmp_path / name, f"""
        name: {name}
        work: {{flow: "flow.py:{entry}", parameters: {json.dumps(parameters)}}}
        request: {{gpus: {gpus}, max_duration: 5m}}
        output: {{to: ./out/, expect: [seen.json]}}
        """, flow=flow)
    result = cli("e31", "run", str(job), "--pool", pool, gpus="2xH100" if gpus else None,
                 env={"E31_JOB_UIDS": f"{UID}-{UID}", **(env or {})})
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads((tmp_path / name / "out" / "seen.json").read_text())


def test_a_later_job_of_the_same_uid_finds_nothing_the_earlier_one_left(prefect_server, tmp_path, pool,
                                                                        spare_folder, nothing_of_the_uid_left):
    folders = [*HOST_TEMP, str(spare_folder)]
    parameters = {"folders": folders, "key": KEY}
    left = run(tmp_path, "leave", LEAVE, "leave", parameters, pool, env={"E31_JOB_TEMP_BYTES": "4m"})

    assert left["uid"] == UID
    assert sorted(left["wrote"]) == sorted(os.path.join(f, "e31-secret") for f in folders), left["refused"]
    assert left["shm"] >= 0 and left["msg"] >= 0, "the job has SysV IPC (its own)"
    assert left["daemon_wrote"]
    # On the host, after the run: none of it, and no process of the uid still writing.
    assert owned_on_host(folders) == []
    assert owned_ipc("shm") == [] and owned_ipc("msg") == []
    # A killed process leaves /proc only once it is reaped: for a moment on a busy host (the daemon writes every
    # 0.1 s for ever, so one that lived on would still be here at the end of the wait).
    until(lambda: not processes_of_uid(), 30, "the job's processes being gone")
    assert left["big"] == "No space left on device", "a job's temp folders are bounded (E31_JOB_TEMP_BYTES)"

    looked = run(tmp_path, "look", LOOK, "look", parameters, pool)
    assert looked["uid"] == UID, "the second job runs as the first one's uid"
    assert looked["found"] == {}
    assert looked["shm"] == -1 and looked["msg"] == -1, "the first job's SysV objects are gone"


def test_a_job_cannot_hold_the_lock_of_a_device_it_never_rented(prefect_server, tmp_path, pool):
    # In a folder any user passes through, as /run/lock/e31 is (the tests' session folder is root's only).
    parent = Path(f"/var/lib/e31-tests-{uuid.uuid4().hex[:8]}")
    parent.mkdir(mode=0o755)
    device_locks = parent / "device-locks"
    try:
        seen = run(tmp_path, "grab", GRAB, "grab",
                   {"device_locks": str(device_locks), "user_locks": "/run/e31/job-users"},
                   pool, gpus=1, env={"E31_DEVICE_LOCKS": str(device_locks)})
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    assert "held" not in seen["devices"].values(), seen
    assert seen["user_locks"] in ([], "No such file or directory"), "the host's job uid locks are not the job's"


def test_what_a_killed_supervisor_left_of_its_uid_is_gone_before_the_uid_is_handed_out(
        prefect_server, tmp_path, pool, nothing_of_the_uid_left):
    # As a run whose supervisor was killed outright leaves its uid: a process still running as it (holding a
    # lock while it lives, in a folder the job sees), and a 0600 file of it in the host's /tmp.
    folder = Path(f"/var/lib/e31-tests-{uuid.uuid4().hex[:8]}")
    folder.mkdir(mode=0o755)
    lock = folder / "planted.lock"
    lock.touch(mode=0o644)
    planted = subprocess.Popen(["flock", str(lock), "sleep", "600"], user=UID, group=UID, extra_groups=[],
                               start_new_session=True)
    while held_by_another(lock) is False:
        assert planted.poll() is None, "flock never took the lock"
        time.sleep(0.05)
    secret = Path("/tmp/e31-secret")
    secret.write_text("the-secret")
    secret.chmod(0o600)
    os.chown(secret, UID, UID)
    try:
        seen = run(tmp_path, "after-kill", SEE, "see", {"lock": str(lock)}, pool)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(planted.pid, signal.SIGKILL)
        planted.wait()
        shutil.rmtree(folder, ignore_errors=True)
    assert not seen["planted_alive"], "the uid's process was killed before the job got the uid"
    assert owned_on_host(list(HOST_TEMP)) == []
