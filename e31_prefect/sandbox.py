"""The namespaces a process job runs in, where the worker runs as root: a network and a view of its own.

- **Network**: only its own loopback. It reaches no port of the host (not the Prefect API, not
  another job's), only its gateway's Unix socket, by path.
- **Files**: the host's, as its own user sees them, except that folders its user could not pass
  through on the way to what it needs (Python, Prefect, e31, its code, its workspace) are covered
  with an empty folder holding only those paths. A root-only home such as ``/root``, which holds
  an interpreter installed there, shows the job that interpreter and nothing else of it.

Only the standard library: the supervisor enters these in the job's process, before it drops to
the job's user and runs the job.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import stat
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def others_may_pass(path: Path) -> bool:
    """Whether a user who is neither owner nor in the group may pass through this folder."""
    try:
        return bool(os.stat(path).st_mode & stat.S_IXOTH)
    except OSError:
        return False


@dataclass
class View:
    """Folders to cover with an empty one, and the paths to show again inside them."""

    covers: list[Path] = field(default_factory=list)
    shows: list[Path] = field(default_factory=list)


def plan_view(needed: Iterable[Path], passable: Callable[[Path], bool] = others_may_pass) -> View:
    """For each needed path (resolved), the topmost folder above it others cannot pass, covered, and the
    path shown again; a path already shown by a wider one is not shown twice."""
    view = View()
    for path in sorted({Path(os.path.realpath(p)) for p in needed}, key=lambda p: (len(p.parts), str(p))):
        if any(path == shown or shown in path.parents for shown in view.shows):
            continue
        blocked = next((folder for folder in reversed(path.parents) if folder != Path("/")
                        and not passable(folder)), None)
        if blocked is None:
            continue
        if blocked not in view.covers and not any(c in blocked.parents for c in view.covers):
            view.covers.append(blocked)
        view.shows.append(path)
    return view


def enter(view: View | None, private_network: bool) -> None:
    """In the job's process, as root: its own network and its own view of the files."""
    libc = ctypes.CDLL(None, use_errno=True)
    if private_network:
        _unshare(libc, CLONE_NEWNET)
        _loopback_up()
    if view is not None and view.covers:
        _unshare(libc, CLONE_NEWNS)
        _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the host's view
        # Each shown path is held open before its folder is covered, then mounted back from the handle.
        held = {path: os.open(path, os.O_PATH | os.O_CLOEXEC) for path in view.shows}
        for folder in view.covers:
            _mount(libc, "tmpfs", str(folder), "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
        for path, handle in held.items():
            if os.path.isdir(f"/proc/self/fd/{handle}"):
                os.makedirs(path, exist_ok=True)
            else:
                os.makedirs(path.parent, exist_ok=True)
                Path(path).touch()
            _mount(libc, f"/proc/self/fd/{handle}", str(path), None, MS_BIND | MS_REC)
            os.close(handle)


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
