"""What a job's uid could leave on the host, found and removed before that uid runs another job.

A process job's uid is reused (:mod:`e31_prefect.host.job_users`). Where it could write on the host
(a world-writable folder: ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock`` ...) its supervisor gives
it a private folder instead (:mod:`e31_prefect.host.sandbox`), and its own IPC namespace. As a safety net
(a folder made world-writable while the run ran, a job of an older e31), the supervisor removes what
the uid owns there, and its SysV IPC objects, when its run ends (in the folders its start found) and
again when it claims the uid (searched afresh: a supervisor killed outright never swept). Both look
:data:`SEARCH_DEPTH` folders deep, on local filesystems: a world-writable folder deeper down, or on a
network filesystem, is the operator's to close.

A process still running as the uid (its supervisor was killed outright, so nothing killed its work)
is killed first: an unsupervised job never shares a uid with the next one.

What the uid owns legitimately, its output dir and its home, is in its run's workspace: the output
step and the workspace's removal take care of those.

Only the standard library: the supervisor uses it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import signal
import stat
import time
from collections.abc import Iterable
from pathlib import Path

# How deep below / the search looks (it stays in milliseconds: about 3,000 folders on a Debian host;
# one level more reads every Python package of the host, seconds).
SEARCH_DEPTH = 4
# Filesystems that hold no files a job could leave (or, for mqueue, that the job gets its own of).
PSEUDO = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "debugfs", "tracefs",
                    "securityfs", "pstore", "bpf", "configfs", "fusectl", "hugetlbfs", "autofs",
                    "binfmt_misc", "efivarfs", "nsfs"})
# Network filesystems are not searched: a server that does not answer would hang the run's start.
REMOTE = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "9p", "afs",
                    "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone"})
SYSVIPC = Path("/proc/sysvipc")
KILL_ALL_ROUNDS = 3  # kill(-1) as the uid: its processes forking meanwhile are caught by the next round
IPC_RMID = 0


def unsearched_mounts(mountinfo: str) -> set[Path]:
    """Mount points of pseudo and network filesystems, from the text of ``/proc/self/mountinfo``."""
    found = set()
    for line in mountinfo.splitlines():
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) > 4 and rest.split()[:1] and rest.split()[0] in PSEUDO | REMOTE:
            found.add(Path(parts[4].replace("\\040", " ")))
    return found


def world_writable(root: Path = Path("/"), depth: int = SEARCH_DEPTH) -> list[Path]:
    """World-writable folders a user of no group could reach, down to ``depth`` folders below ``root``
    (none inside another: what is inside one goes with it)."""
    try:
        skip = unsearched_mounts(Path("/proc/self/mountinfo").read_text())
    except OSError:
        skip = set()
    # Paths as strings until the end: each run's supervisor searches a few thousand folders, and a Path
    # for each doubled the search's time.
    unsearched = {str(path) for path in skip}
    found: list[str] = []
    stack = [(str(root), 0)]
    while stack:
        folder, level = stack.pop()
        if level >= depth:
            continue
        with contextlib.suppress(OSError), os.scandir(folder) as entries:
            for entry in entries:
                try:  # the folder's own listing says which are folders: only those cost a stat
                    if not entry.is_dir(follow_symlinks=False):
                        continue
                    mode = entry.stat(follow_symlinks=False).st_mode
                except OSError:
                    continue
                if not mode & stat.S_IXOTH or entry.path in unsearched:
                    continue
                if mode & stat.S_IWOTH:
                    found.append(entry.path)
                else:
                    stack.append((entry.path, level + 1))
    return sorted(map(Path, found))


def sweep_files(uid: int, folders: Iterable[Path]) -> list[str]:
    """Remove what ``uid`` owns in these world-writable folders and in any world-writable folder inside
    them (links are removed, never followed). Returns what could not be removed, with why."""
    failed: list[str] = []
    stack = [Path(folder) for folder in folders]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
                if info.st_uid == uid:
                    if stat.S_ISDIR(info.st_mode):
                        shutil.rmtree(entry.path)  # by open folders: a link inside is removed, not followed
                    else:
                        os.unlink(entry.path)
                elif stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_IWOTH:
                    stack.append(Path(entry.path))  # another's world-writable folder: the uid may write in it
            except FileNotFoundError:
                continue
            except (OSError, RecursionError) as exc:
                failed.append(f"{entry.path}: {exc}")
    return failed


def owned_ipc(table: str, uid: int) -> list[int]:
    """The ids of a ``/proc/sysvipc/{shm,sem,msg}`` table's objects that ``uid`` owns or made."""
    lines = table.splitlines()
    if not lines:
        return []
    header = lines[0].split()
    ident = next((name for name in header if name in ("shmid", "semid", "msqid")), None)
    if ident is None:
        return []
    found = []
    for line in lines[1:]:
        row = dict(zip(header, line.split(), strict=False))  # a table may add columns
        if str(uid) in (row.get("uid"), row.get("cuid")) and row.get(ident, "").isdigit():
            found.append(int(row[ident]))
    return found


def sweep_ipc(uid: int, tables: Path = SYSVIPC) -> list[str]:
    """Remove the SysV shared memory segments, semaphore sets and message queues ``uid`` owns or made
    (in the caller's IPC namespace). Returns what could not be removed, with why."""
    libc = ctypes.CDLL(None, use_errno=True)
    remove = {"shm": lambda i: libc.shmctl(i, IPC_RMID, None), "sem": lambda i: libc.semctl(i, 0, IPC_RMID),
              "msg": lambda i: libc.msgctl(i, IPC_RMID, None)}
    failed = []
    for kind, removing in remove.items():
        try:
            table = (tables / kind).read_text()
        except OSError:
            continue
        for ident in owned_ipc(table, uid):
            if removing(ident) != 0 and ctypes.get_errno() not in (errno.EINVAL, errno.EIDRM):  # gone already
                failed.append(f"SysV {kind} {ident}: {os.strerror(ctypes.get_errno())}")
    return failed


def lives_as(status: str, uid: int) -> bool:
    """Whether a ``/proc/<pid>/status`` text is of a live process (a zombie is only its exit status, for
    its parent) with ``uid`` as any of its uids."""
    # Read for every process of the host at each sweep: two lines looked up, not all of them parsed.
    state = status.partition("\nState:")[2].split(None, 1)[:1]
    uids = status.partition("\nUid:")[2].partition("\n")[0].split()
    return state not in (["Z"], ["X"]) and str(uid) in uids


# keyctl(2): its system call number (no C library wraps it), and what is asked of it.
KEYCTL = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_CLEAR = 1, 7
KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = -4, -5


def keyctl(*args: int | None) -> int:
    """One keyctl(2) call (-1 where this machine's call number is not known)."""
    if KEYCTL is None:
        return -1
    return ctypes.CDLL(None, use_errno=True).syscall(KEYCTL, *(ctypes.c_long(a or 0) for a in args))


def become(uid: int) -> None:
    """In a job's process, as root: the job's uid and group, no supplementary groups, a session keyring of
    its own (see :func:`own_session_keyring`)."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    own_session_keyring()


def own_session_keyring() -> None:
    """In the job's process, as its uid: a session keyring of its own, not its supervisor's (the kernel's
    keyrings are no files: a key added to a shared session keyring would reach every job beside it)."""
    keyctl(KEYCTL_JOIN_SESSION_KEYRING, None)


def as_uid(uid: int) -> None:
    """Kill every process of ``uid`` and clear its keyrings, from a child that becomes ``uid``.

    ``kill(-1)`` by a process of the uid signals all its other processes at once, under the kernel's task
    list lock, so a process that forks without end cannot slip between a scan of ``/proc`` and its kill;
    and a uid's user keyrings outlive its processes, to reach the next job given that uid.
    """
    child = os.fork()
    if child == 0:  # pragma: no cover - the child ends in os._exit
        code = 0
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            # kill(-1) succeeds wherever the host has any other process (one it may not signal counts too), so
            # its answer never says the uid's are gone: a few rounds, then the caller's scan of /proc says it.
            for _ in range(KILL_ALL_ROUNDS):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(-1, signal.SIGKILL)
            keyctl(KEYCTL_CLEAR, KEY_SPEC_USER_KEYRING)
            keyctl(KEYCTL_CLEAR, KEY_SPEC_USER_SESSION_KEYRING)
        except BaseException:
            code = 1
        os._exit(code)
    os.waitpid(child, 0)


def read_small(path: str) -> bytes:
    """The start of a small file of /proc in one read (empty where it is gone: its process ended)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        return os.read(fd, 4096)
    except OSError:
        return b""
    finally:
        os.close(fd)


def kill_processes(uid: int, proc: Path = Path("/proc"), rounds: int = 100) -> list[str]:
    """Kill every process running as ``uid`` (one whose supervisor was killed outright may live on), until
    none is left or ``rounds`` passes found one each time. Returns the pids left, if any."""
    if os.geteuid() == 0:
        as_uid(uid)
    left: list[int] = []
    for _ in range(rounds):
        left = []
        for entry in os.listdir(proc):
            if not entry.isdigit():
                continue
            status = read_small(os.path.join(proc, entry, "status")).decode(errors="replace")
            if lives_as(status, uid):
                left.append(int(entry))
        if not left:
            return []
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    return [f"process {pid} of uid {uid} would not die" for pid in left]


def sweep(uid: int, folders: Iterable[Path]) -> list[str]:
    """Everything ``uid`` left on the host: its processes, what it owns in the host's world-writable
    folders, its SysV IPC objects. Returns what stayed, with why."""
    return kill_processes(uid) + sweep_files(uid, folders) + sweep_ipc(uid)
