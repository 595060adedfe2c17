"""The namespaces a process job runs in, where the worker runs as root: a network and a view of its own.

- **Network**: only its own loopback. It reaches no port of the host (not the Prefect API, not
  another job's), only its gateway's Unix socket, by path.
- **Files**: the host's, as its own user sees them, except that folders its user could not pass
  through on the way to what it needs (Python, Prefect, e31, its code, its workspace) are covered
  with an empty folder holding only those paths. A root-only home such as ``/root``, which holds
  an interpreter installed there, shows the job that interpreter and nothing else of it.
- **Temp**: every world-writable folder of the host (``/tmp``, ``/var/tmp``, ``/dev/shm``,
  ``/run/lock`` ...) is a private, size-bounded tmpfs of its own (what it needs there shown again), so
  nothing it writes there outlives it or reaches a later job given the same uid; ``/dev/mqueue`` is
  its own too.
- **IPC**: SysV shared memory, semaphores and message queues, and POSIX message queues, of its own.
- **Hidden**: the host's e31 lock folders (devices, job uids) are an empty read-only folder, so it
  cannot hold the lock of a device it never rented.
- **Processes**: a PID namespace of its own, with its own ``/proc``: it lists only its own processes
  (never another job's command line, the worker or its supervisors), and when the namespace's first
  process (:mod:`e31_prefect.host.job_init`) is killed, the kernel kills every process in it.

Only the standard library: the supervisor enters these in the job's processes, before they drop to
the job's user and run the job. The namespace's init enters them (:func:`enter`, :func:`own_proc`); the
job's process, a second child of the supervisor in the same PID namespace, joins the init's
(:func:`namespaces_of`, :func:`join`), so the supervisor watches, signals and reaps the job's own process.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import socket
import stat
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x08000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
PROC = Path("/proc")
# The namespaces a job's process joins beside its PID namespace's init; the mount namespace last (it moves the root).
JOINED = (("net", CLONE_NEWNET), ("ipc", CLONE_NEWIPC), ("mnt", CLONE_NEWNS))
MQUEUE = Path("/dev/mqueue")  # POSIX message queues as files: the mounting process's IPC namespace's
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def others_may_pass(path: Path) -> bool:
    """Whether a user who is neither owner nor in the group may pass through this folder."""
    try:
        return bool(os.stat(path).st_mode & stat.S_IXOTH)
    except OSError:
        return False


@dataclass
class View:
    """Folders to cover with an empty one, private temp folders, the paths to show again inside them, and
    folders to hide with an empty read-only one."""

    covers: list[Path] = field(default_factory=list)
    shows: list[Path] = field(default_factory=list)
    temps: list[Path] = field(default_factory=list)  # each a private tmpfs, writable by everyone (1777)
    hides: list[Path] = field(default_factory=list)
    temp_bytes: int = 2 * 2**30  # the size bound of each private temp folder


def plan_view(needed: Iterable[Path], passable: Callable[[Path], bool] = others_may_pass,
              temps: Iterable[Path] = (), hides: Iterable[Path] = (), temp_bytes: int = 2 * 2**30) -> View:
    """For each needed path (resolved), the topmost folder above it others cannot pass, covered, and the
    path shown again; a path already shown by a wider one is not shown twice.

    Each of ``temps`` (world-writable folders) becomes a private one; a needed path in one is shown again
    there, and a world-writable folder that is or lies inside a needed path (a job file kept in ``/tmp``
    itself) stays as it is: the job asked for it, and :mod:`e31_prefect.host.leftovers` clears what its uid
    left there before the uid is reused. Each of ``hides`` is hidden whatever else shows it.
    """
    paths = sorted({Path(os.path.realpath(p)) for p in needed}, key=lambda p: (len(p.parts), str(p)))
    view = View(temp_bytes=temp_bytes)
    for temp in sorted({Path(os.path.realpath(t)) for t in temps}, key=lambda p: (len(p.parts), str(p))):
        if temp == Path("/") or any(temp == path or path in temp.parents for path in paths):
            continue
        if not any(wider in temp.parents for wider in view.temps):
            view.temps.append(temp)
    for path in paths:
        wider = next((shown for shown in view.shows if path == shown or shown in path.parents), None)
        if wider == path:
            continue
        if wider is not None:
            # Shown by a wider path, as the host has it: only a closed folder between the two hides it (a job
            # folder holding the worker's E31_HOME, whose runs' workspaces lie in it).
            blocked = next((folder for folder in reversed(path.parents) if wider in folder.parents
                            and not passable(folder)), None)
            if blocked is not None:
                # A cover above the wider shown path covers nothing the shown path brings back.
                if not any(c == blocked or (c in blocked.parents and wider in c.parents) for c in view.covers):
                    view.covers.append(blocked)
                view.shows.append(path)
            continue
        temp = next((temp for temp in view.temps if temp in path.parents), None)
        blocked = next((folder for folder in reversed(path.parents) if folder != Path("/")
                        and not passable(folder)), None)
        if temp is None and blocked is None:
            continue
        # A folder inside a private temp folder, or inside one covered already, needs no cover of its own.
        if blocked is not None and not (temp is not None and temp in blocked.parents) \
                and not any(c == blocked or c in blocked.parents for c in view.covers):
            view.covers.append(blocked)
        view.shows.append(path)
    view.hides = sorted({Path(os.path.realpath(h)) for h in hides}, key=lambda p: (len(p.parts), str(p)))
    return view


def enter(view: View | None, private_network: bool) -> None:
    """In the job's process, as root: its own network, and its own view of the files and its own IPC."""
    libc = ctypes.CDLL(None, use_errno=True)
    if private_network:
        _unshare(libc, CLONE_NEWNET)
        _loopback_up()
    if view is None:
        return
    _unshare(libc, CLONE_NEWNS | CLONE_NEWIPC)
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the host's view
    # Each shown path is held open before its folder is covered, then mounted back from the handle.
    held = {path: os.open(path, os.O_PATH | os.O_CLOEXEC) for path in view.shows}
    # Shallow first: a private /var/tmp inside a covered /var is mounted on the cover, not under it, and a
    # folder covered inside a shown one (E31_HOME in a job's folder) is covered on the shown one.
    # Inodes bounded too (one per page of the size bound): empty files take kernel memory, not space.
    inodes = max(1024, view.temp_bytes // 4096)
    mounts = sorted([(folder, "mode=755,size=1m") for folder in view.covers]
                    + [(temp, f"mode=1777,size={view.temp_bytes},nr_inodes={inodes}") for temp in view.temps]
                    + [(path, None) for path in view.shows],
                    key=lambda mount: (len(mount[0].parts), mount[1] is None))
    for folder, options in mounts:
        if options is None:
            _show(libc, folder, held[folder])
        elif os.path.isdir(folder):  # one inside a cover is gone from the view: nothing to make private there
            _mount(libc, "tmpfs", str(folder), "tmpfs", MS_NOSUID | MS_NODEV, options)
    if os.path.isdir(MQUEUE):  # the queues of its own IPC namespace, not the host's
        _mount(libc, "mqueue", str(MQUEUE), "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for folder in view.hides:  # last, so no shown path brings one back
        if os.path.isdir(folder):
            _mount(libc, "tmpfs", str(folder), "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                   "mode=555,size=4k")


def _show(libc: ctypes.CDLL, path: Path, handle: int) -> None:
    """Mount back a shown path from its handle, held open before anything was covered."""
    if os.path.isdir(f"/proc/self/fd/{handle}"):
        os.makedirs(path, exist_ok=True)
    else:
        os.makedirs(path.parent, exist_ok=True)
        Path(path).touch()
    _mount(libc, f"/proc/self/fd/{handle}", str(path), None, MS_BIND | MS_REC)
    os.close(handle)


@contextlib.contextmanager
def own_pids() -> Iterator[None]:
    """In the supervisor, as root: the processes it forks inside are in a new PID namespace (the first
    one forked is its init, PID 1); its own later children are in its own again.

    unshare(2) of a PID namespace moves only the caller's later children, so the supervisor's own
    process, pidfds and exit statuses stay as they were: it sees the job's processes by their host pids.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open(PROC / "self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _unshare(libc, CLONE_NEWPID)
        try:
            yield
        finally:
            if libc.setns(own, CLONE_NEWPID) != 0:  # else its later forks (a uid's sweep) would land there
                error = ctypes.get_errno()
                raise OSError(error, f"setns back to the supervisor's own PID namespace: {os.strerror(error)}")
    finally:
        os.close(own)


def own_proc() -> None:
    """In the first process of the job's PID namespace, as root, in the job's mount namespace: a ``/proc``
    of that namespace (procfs shows the PID namespace of the process that mounts it), the host's gone."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2(str(PROC).encode(), MNT_DETACH)  # the host's /proc and what is mounted in it; none is fine
    _mount(libc, "proc", str(PROC), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def namespaces_of(pid: int) -> list[tuple[int, int]]:
    """Handles on a process's network, IPC and mount namespaces (close-on-exec), for :func:`join`."""
    handles: list[tuple[int, int]] = []
    try:
        for name, flag in JOINED:
            handles.append((os.open(PROC / str(pid) / "ns" / name, os.O_RDONLY | os.O_CLOEXEC), flag))
    except OSError:
        for handle, _ in handles:
            os.close(handle)
        raise
    return handles


def join(namespaces: list[tuple[int, int]], cwd: str | None) -> None:
    """In a job's process, as root: into the namespaces of :func:`namespaces_of`, then its working folder as
    the job's view shows it (joining a mount namespace moves the root and working folder to its root)."""
    here = cwd or os.getcwd()
    for handle, flag in namespaces:
        setns(handle, flag)
    os.chdir(here)


def setns(handle: int, flag: int) -> None:
    """Move the calling process into the namespace ``handle`` is open on (``flag``: its kind; a PID
    namespace takes only the caller's later children)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(handle, flag) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"setns({flag:#x}) failed: {os.strerror(error)}")


def _unshare(libc: ctypes.CDLL, flags: int) -> None:
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), f"unshare({flags:#x}) failed: a job's own namespaces need root")


def _mount(libc: ctypes.CDLL, source: str | None, target: str, kind: str | None, flags: int,
           data: str | None = None) -> None:
    def encode(text: str | None) -> bytes | None:
        return text.encode() if text is not None else None

    if libc.mount(encode(source), encode(target), encode(kind), flags, encode(data)) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mount {source} on {target} failed: {os.strerror(error)}")


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(probe, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(probe, SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b""))
