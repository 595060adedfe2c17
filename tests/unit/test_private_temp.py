"""A process job's private temp folders and hidden lock folders (the plan), and what its uid leaves (the sweep)."""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from e31_prefect.host import job_users
from e31_prefect.host.leftovers import (
    kill_processes,
    lives_as,
    owned_ipc,
    sweep_files,
    unsearched_mounts,
    world_writable,
)
from e31_prefect.host.sandbox import View, plan_view
from e31_prefect.host.settings import E31Settings


def passable_but(*closed: Path):
    return lambda folder: folder not in closed


def test_the_hosts_temp_folders_become_private_and_what_the_job_needs_there_is_shown_again(tmp_path):
    host = tmp_path / "host"
    temp, shm, closed = host / "tmp", host / "dev" / "shm", host / "tmp" / "e31-home"
    workspace, code = closed / "workspaces" / "run", temp / "project"
    view = plan_view([workspace, code, host / "usr"], passable_but(closed), temps=[temp, shm],
                     temp_bytes=2**20)
    # The closed folder inside the private /tmp needs no cover: the private /tmp hides it already.
    assert view == View(covers=[], shows=[code, workspace], temps=[temp, shm], temp_bytes=2**20)


def test_a_temp_folder_is_private_once_and_one_inside_what_the_job_needs_stays_its_own(tmp_path):
    temp, project = tmp_path / "tmp", tmp_path / "srv" / "project"
    view = plan_view([project], passable_but(), temps=[temp, temp / "deeper", project / "scratch"])
    assert view.temps == [temp]
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")  # /var/lock -> /run/lock
    assert plan_view([], passable_but(), temps=[tmp_path / "link", tmp_path / "real"]).temps == [tmp_path / "real"]
    assert plan_view([], passable_but(), temps=[Path("/")]).temps == [], "the root itself is never replaced"


def test_a_closed_folder_outside_every_temp_folder_is_covered_as_before(tmp_path):
    root_home, temp = tmp_path / "root", tmp_path / "tmp"
    python = root_home / ".pyenv" / "3.11"
    view = plan_view([python, temp / "code"], passable_but(root_home), temps=[temp])
    assert view.covers == [root_home]
    assert sorted(view.shows) == sorted([python, temp / "code"])


def test_a_job_folder_holding_the_workers_home_shows_the_job_its_own_workspace_and_nothing_else_of_it(tmp_path):
    """A job file kept in the folder that holds E31_HOME (0700): the job is shown its folder, and its own
    workspace and ledger folder inside E31_HOME, never the rest of it (other runs, the spool)."""
    closed_above, project = tmp_path / "root-home", tmp_path / "root-home" / "project"
    home = project / "e31"
    workspace, ledger = home / "workspaces" / "run", home / "ledger" / "run"
    view = plan_view([project, workspace, ledger], passable_but(closed_above, home))
    assert view.covers == [closed_above, home]
    assert view.shows == [project, ledger, workspace]


def test_the_lock_folders_are_hidden_whatever_shows_them(tmp_path):
    project = tmp_path / "project"
    locks = project / "locks"  # an operator put the device locks inside a folder the job is shown
    view = plan_view([project], passable_but(tmp_path), hides=[locks, Path("/run/e31/job-users"), locks])
    assert view.shows == [project]
    assert sorted(view.hides) == sorted([locks, Path("/run/e31/job-users")])


MOUNTINFO = """\
22 1 252:1 / / rw,relatime - ext4 /dev/vda rw
23 22 0:21 / /proc rw,nosuid - proc proc rw
24 22 0:22 / /sys rw - sysfs sysfs rw
25 22 0:5 / /dev rw - devtmpfs devtmpfs rw,mode=755
26 25 0:23 / /dev/shm rw - tmpfs tmpfs rw
27 25 0:24 / /dev/mqueue rw - mqueue mqueue rw
28 22 0:25 / /mnt/with\\040space rw - cgroup2 cgroup2 rw
29 22 0:26 / /home rw - nfs4 server:/home rw
"""


def test_pseudo_and_network_filesystems_are_not_searched_for_folders_a_job_could_write():
    assert unsearched_mounts(MOUNTINFO) == {Path("/proc"), Path("/sys"), Path("/dev/mqueue"), Path("/mnt/with space"),
                                            Path("/home")}
    assert unsearched_mounts("garbage\n\n") == set()


def test_world_writable_folders_are_found_where_others_can_reach_them(tmp_path):
    for folder, mode in [("open", 0o755), ("open/temp", 0o1777), ("open/temp/inner", 0o1777),
                         ("closed", 0o700), ("closed/temp", 0o1777), ("open/a/b/c/deep", 0o1777)]:
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder).chmod(mode)
    (tmp_path / "open" / "linked").symlink_to(tmp_path / "closed" / "temp")
    # One inside another goes with it; a closed folder hides its own; a link is not a folder; depth bounds.
    assert world_writable(tmp_path, depth=4) == [tmp_path / "open" / "temp"]
    assert world_writable(tmp_path, depth=5) == [tmp_path / "open" / "a" / "b" / "c" / "deep",
                                                 tmp_path / "open" / "temp"]


@pytest.mark.skipif(os.geteuid() != 0, reason="files of another uid need root")
def test_the_sweep_removes_what_the_uid_left_and_nothing_else(tmp_path):
    temp, uid = tmp_path / "tmp", 61966
    (temp / "others").mkdir(parents=True)
    temp.chmod(0o1777)
    (temp / "others").chmod(0o1777)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("not the job's")

    def made_by_uid(path: Path, folder: bool = False) -> None:
        path.mkdir() if folder else path.write_text("the-secret")
        os.chown(path, uid, uid, follow_symlinks=False)

    made_by_uid(temp / "secret")
    made_by_uid(temp / "others" / "secret")  # in another's world-writable folder, inside
    made_by_uid(temp / "tree", folder=True)
    (temp / "tree" / "to-outside").symlink_to(outside)  # a link inside the uid's folder: removed, not followed
    (temp / "link").symlink_to(outside / "precious")
    os.chown(temp / "link", uid, uid, follow_symlinks=False)
    (temp / "root-file").write_text("root's")

    assert sweep_files(uid, [temp]) == []
    assert sorted(p.name for p in temp.iterdir()) == ["others", "root-file"]
    assert list((temp / "others").iterdir()) == []
    assert (outside / "precious").read_text() == "not the job's"


SHM = """\
       key      shmid perms                  size  cpid  lpid nattch   uid   gid  cuid  cgid      atime
  233797181          4  1600                  4096   100   100      0 61977 61977     0     0          0
          0          5  1600                  4096   100   100      0     0     0 61977 61977          0
          0          6  1600                  4096   100   100      0     0     0     0     0          0
"""


def test_the_uids_sysv_objects_are_those_it_owns_or_made():
    assert owned_ipc(SHM, 61977) == [4, 5]
    msg = "       key      msqid perms      cbytes       qnum lspid lrpid   uid   gid  cuid  cgid\n" \
          "  1 7 600 0 0 0 0 61977 61977 61977 61977\n"
    assert owned_ipc(msg, 61977) == [7]
    assert owned_ipc("", 61977) == [] and owned_ipc("no ids here\n1 2 3\n", 61977) == []


@pytest.mark.parametrize(("variable", "value", "named"), [
    ("E31_JOB_UIDS", "500-600", "E31_JOB_UIDS='500-600'"),
    ("E31_JOB_UIDS", "62000-61000", "first <= last"),
    ("E31_JOB_UIDS", "61000", "String should match pattern"),
    ("E31_JOB_UIDS", "61000-99999999999", "last < 2147483648"),
    ("E31_JOB_UIDS", "65000-65534", r"accounts of this host: nobody \(65534\)"),  # its sweep would kill theirs
    ("E31_JOB_TEMP_BYTES", "lots", "E31_JOB_TEMP_BYTES='lots' is not a size"),
    ("E31_JOB_TEMP_BYTES", "0", "E31_JOB_TEMP_BYTES='0': a job's temp folders need a bound of 1m or more"),
])
def test_a_bad_temp_size_or_uid_range_is_refused_with_the_fix(monkeypatch, variable, value, named):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError, match=named):
        E31Settings()


def test_the_temp_size_and_uid_range_read_as_an_operator_writes_them(monkeypatch):
    monkeypatch.setenv("E31_JOB_TEMP_BYTES", "512m")
    monkeypatch.setenv("E31_JOB_UIDS", "61900-61909")
    settings = E31Settings()
    assert settings.job_temp_bytes == 512 * 2**20
    assert settings.job_uid_range == range(61900, 61910)


def test_a_process_is_the_uids_whichever_of_its_uids_it_is():
    status = "Name:\tpython\nState:\tS (sleeping)\nUid:\t61977\t61977\t61977\t61977\nGid:\t0\t0\t0\t0\n"
    assert lives_as(status, 61977)
    assert lives_as(status.replace("\t61977\t61977\t61977\n", "\t0\t0\t0\n"), 61977), "its real uid"
    assert not lives_as(status, 61978)
    assert not lives_as("Name:\tpython\nGid:\t61977\n", 61977)
    assert not lives_as(status.replace("S (sleeping)", "Z (zombie)"), 61977), "a zombie holds nothing"


@pytest.mark.skipif(os.geteuid() != 0, reason="a process of another uid needs root")
def test_a_process_left_running_as_the_uid_is_killed_before_the_uid_is_reused():
    import subprocess

    held = job_users.claim(uids=range(61965, 61966))  # a uid no running job has, as a supervisor claims one
    assert held is not None
    daemon = subprocess.Popen(["sleep", "600"], user=held.uid, group=held.uid, extra_groups=[],
                              start_new_session=True)
    try:
        assert kill_processes(held.uid) == []
        assert daemon.wait(timeout=30) == -9
    finally:
        daemon.kill()
        os.close(held.lock)


# Holds the pipe's write end (given as its argument) through every hop: the pipe reads as ended once none runs.
HOPPING = "import os\nwhile True:\n    if os.fork():\n        os._exit(0)\n"


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
                    reason="a process of another uid needs root, and an interpreter it may run")
def test_a_process_of_the_uid_that_forks_and_exits_without_end_is_killed_too():
    """A process that forks and exits in a loop has a new pid each moment: a scan of /proc, then a kill by pid,
    always misses it. The kill as the uid itself reaches it wherever it is."""
    held = job_users.claim(uids=range(61966, 61967))
    assert held is not None
    read, write = os.pipe()
    # The host's own interpreter (a job's uid may not read the test's virtualenv), isolated: it reads nothing else.
    started = subprocess.Popen(["/usr/bin/python3", "-I", "-S", "-c", HOPPING], user=held.uid, group=held.uid,
                               extra_groups=[], start_new_session=True, pass_fds=(write,))
    os.close(write)
    try:
        started.wait(timeout=30)  # its first hop: what runs now is a grandchild, and the next, and the next
        assert select.select([read], [], [], 0)[0] == [], "the hopping process runs, holding the pipe"
        kill_processes(held.uid)
        assert select.select([read], [], [], 10)[0] == [read] and os.read(read, 1) == b"", \
            "a process of the uid still holds the pipe"
    finally:
        subprocess.run(["pkill", "-KILL", "-U", str(held.uid)], check=False)  # whatever the code under test left
        os.close(read)
        os.close(held.lock)


@pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root")
def test_a_jobs_posix_message_queues_are_its_own():
    """In a child, as a supervisor's job would: a host with /dev/mqueue (made in a namespace of the test's
    own where this host has none), the job's view entered, a queue made as the job's uid."""
    import ctypes
    import uuid

    from e31_prefect.host import sandbox

    queue = f"e31-queue-{uuid.uuid4().hex[:8]}"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        said = "?"
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            sandbox._unshare(libc, sandbox.CLONE_NEWNS)  # the test's "host": a /dev/mqueue of the host's IPC
            sandbox._mount(libc, None, "/", None, sandbox.MS_REC | sandbox.MS_PRIVATE)
            sandbox._mount(libc, "tmpfs", "/dev", "tmpfs", 0, "mode=755")
            os.mkdir("/dev/mqueue")
            sandbox._mount(libc, "mqueue", "/dev/mqueue", "mqueue", 0)
            os.chmod("/dev/mqueue", 0o1777)
            host = os.open("/dev/mqueue", os.O_RDONLY | os.O_DIRECTORY)
            child = os.fork()
            if child == 0:
                sandbox.enter(sandbox.plan_view([]), private_network=False)
                os.setgid(61964)
                os.setuid(61964)
                os.close(os.open(f"/dev/mqueue/{queue}", os.O_CREAT | os.O_RDWR, 0o600))
                os._exit(0 if os.listdir("/dev/mqueue") == [queue] else 1)
            made = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
            said = f"{made} {queue in os.listdir(host)}"
            with contextlib.suppress(FileNotFoundError):  # the host's queues outlive the test's namespace
                os.unlink(queue, dir_fd=host)
        except Exception as exc:
            said = f"{type(exc).__name__}: {exc}"
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 4096).decode() == "True False", "the job made its queue in its own /dev/mqueue only"


@pytest.mark.skipif(os.geteuid() != 0 or os.uname().machine != "x86_64", reason="a job's uid needs root (x86-64 calls)")
def test_a_uid_forking_without_end_is_killed_whole_and_its_keyrings_cleared():
    import ctypes
    import subprocess
    import time

    uid = 61993

    def become() -> None:
        os.setgid(uid)
        os.setuid(uid)

    def as_uid(call: tuple) -> int:
        """One system call in a child become ``uid``: its answer."""
        reading, writing = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - ends in os._exit
            become()
            os.write(writing, str(ctypes.CDLL(None).syscall(*call)).encode())
            os._exit(0)
        os.waitpid(child, 0)
        os.close(writing)
        answer = int(os.read(reading, 64))
        os.close(reading)
        return answer

    # A loop of children: each scan of /proc finds new pids; kill(-1) as the uid takes them all at once.
    loop = subprocess.Popen(["sh", "-c", "while true; do sleep 100 & done"], preexec_fn=become)
    add_key = (248, b"user", b"left-for-the-next-job", b"secret", 6, ctypes.c_long(-4))  # add_key to @u
    assert as_uid(add_key) > 0
    time.sleep(0.3)
    try:
        assert kill_processes(uid) == []
    finally:
        loop.wait(timeout=10)
    time.sleep(0.2)
    assert [p for p in os.listdir("/proc") if p.isdigit() and lives_as(_status(p), uid)] == []
    read_keyring = (250, 11, ctypes.c_long(-4), None, 0)  # KEYCTL_READ of @u: the bytes of its key ids
    assert as_uid(read_keyring) == 0, "the uid's user keyring is empty for the next job"


def _status(pid: str) -> str:
    with contextlib.suppress(OSError):
        return Path("/proc", pid, "status").read_text()
    return ""
