"""The worker's own files under ``E31_HOME``, closed to every job, wherever ``E31_HOME`` lives.

    E31_HOME=/srv/e31 prefect worker start --pool gpu --type e31

The content cache holds every team's staged objects, ``outputs`` and the spool hold
every run's outputs, the ledger and the accounting file every run's record. A job
running as a uid of its own must reach none of it, even where ``E31_HOME`` sits
under folders anyone may pass (``/srv``, ``/tmp``). So each folder e31 keeps
there is made ``0700`` (a file ``0600``).
The worker checks them as it starts: one found open is closed, and the log says
which and how it was; one it cannot close (another user's) stops the worker
with what to do. A job still reaches its own workspace and ledger folder: its
view of the files shows it those, through folders its user cannot pass
(:mod:`e31_prefect.host.sandbox`), and Docker mounts a container's as root.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

# What e31 keeps in E31_HOME: folders, then files. Anything else there is the operator's.
FOLDERS = ("workspaces", "cache", "ledger", "spool", "outputs")
FILES = ("accounting.jsonl", "prefect-server.log", "prefect-server.pid")
OTHERS = stat.S_IRWXO
GROUP = stat.S_IRWXG


class HomeOpen(RuntimeError):
    """A folder or file of E31_HOME that jobs could read, and this worker cannot close."""


@dataclass(frozen=True)
class Found:
    """One of e31's folders or files as found on disk (links followed: an operator may link ``cache`` to
    another disk)."""

    path: Path
    mode: int  # st_mode
    uid: int
    gid: int


def closed_mode(found: Found) -> int:
    """Its permission bits with nothing for its group or others (0 bits changed: it is closed already)."""
    return stat.S_IMODE(found.mode) & ~(GROUP | OTHERS)


def plan_closing(found: Found, worker_uid: int) -> tuple[int | None, str | None]:
    """What to do with one of e31's own: ``(mode to set, None)`` when it is open and this worker may close it,
    ``(None, refusal)`` when it is open and belongs to another user, ``(None, None)`` when it is closed."""
    mode = closed_mode(found)
    if mode == stat.S_IMODE(found.mode):
        return None, None
    if worker_uid not in (0, found.uid):
        return None, (f"E31_HOME: {found.path} is {stat.S_IMODE(found.mode):04o} and belongs to uid {found.uid}, "
                      f"not to this worker's uid {worker_uid}, so any job on this host could read what it holds "
                      f"and this worker cannot close it: run `chmod o-rwx {found.path}` as its owner, or set "
                      "E31_HOME to a folder of the worker's own")
    return mode, None


def close_home(home: Path) -> list[str]:
    """Make e31's folders in ``home`` (closed) and close any found open; returns a line per one closed.

    Raises :class:`HomeOpen` for one this worker cannot close.
    """
    home = home.expanduser()
    home.mkdir(parents=True, exist_ok=True)
    said = []
    worker_uid = os.geteuid()
    for name in (*FOLDERS, *FILES):
        path = home / name
        if name in FOLDERS:
            path.mkdir(mode=0o700, exist_ok=True)
        try:
            info = os.stat(path)
        except FileNotFoundError:
            continue
        found = Found(path, info.st_mode, info.st_uid, info.st_gid)
        mode, refusal = plan_closing(found, worker_uid)
        if refusal is not None:
            raise HomeOpen(refusal)
        if mode is not None:
            os.chmod(path, mode)
            said.append(f"{path} was open to other users ({stat.S_IMODE(found.mode):04o}): closed it "
                        f"({mode:04o}), so no job reads what it holds")
    return said
