"""Exclusive file locks that the kernel releases when their last holder dies.

A lock is an open file holding an ``flock``: it passes to a child process as an
open file (a run's supervisor keeps its devices' locks after the worker that
took them is gone), and no crash can leave one held. Only the standard library.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def try_lock(path: Path, mode: int = 0o600) -> int | None:
    """An open file holding the exclusive lock of ``path`` (made if missing); None when another holder has it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
