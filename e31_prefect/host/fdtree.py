"""Folder trees a job made, removed by directory descriptor, however deep they go.

    prefect worker start --pool gpu --type e31   (a run's workspace goes when its life ends)

A job can nest folders far past ``PATH_MAX`` (4096 bytes): a path to the deepest of them cannot
be opened, and Python 3.11's ``shutil.rmtree`` and ``os.walk`` recurse once per level, past the
interpreter's recursion limit. Here each folder is opened relative to the one above it
(``dir_fd``, never following a link), from an explicit stack, so depth costs one descriptor per
level held open and no path is ever longer than one name.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
PATH_MAX = 4096
# An S3 key is at most 1024 bytes; a longer output path could be sent nowhere, and the walk to it would
# cost time on folders nested thousands deep (here, not in output_bounds: the supervisor needs it too).
MAX_OUTPUT_PATH = 1024

# Called with a regular file's path (where it is short enough to name) and its status, before it is removed.
OnFile = Callable[[str, os.stat_result], None]


def remove_tree(root: Path, on_file: OnFile | None = None) -> None:
    """Remove ``root`` and everything in it, never following a link; errors on single entries are ignored.

    Each folder is given its owner's write and search bits first, so a tree the job made read-only
    (or its staged data) is removed too. ``on_file`` sees each regular file whose path is shorter than
    ``PATH_MAX`` before it goes (the cache releases its links this way); deeper ones go unnamed.
    """
    try:
        top = os.open(root, _FOLDER)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # a file or a link where the folder was: remove that
            with contextlib.suppress(OSError):
                os.unlink(root)
        return
    with contextlib.suppress(OSError):
        os.fchmod(top, stat.S_IMODE(os.fstat(top).st_mode) | stat.S_IRWXU)
    # Each level: its descriptor, its name in the level above, its path (None once too long to name),
    # and its entries still to remove.
    stack: list[tuple[int, str, str | None, list[str]]] = [(top, "", str(root), _names(top))]
    while stack:
        fd, own_name, path, names = stack[-1]
        if not names:
            os.close(fd)
            stack.pop()
            if stack:
                with contextlib.suppress(OSError):
                    os.rmdir(own_name, dir_fd=stack[-1][0])
            continue
        name = names.pop()
        try:
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue
        child = f"{path}/{name}" if path is not None and len(path) + len(name) + 1 < PATH_MAX else None
        if stat.S_ISDIR(info.st_mode):
            try:
                inner = os.open(name, _FOLDER, dir_fd=fd)
            except OSError:
                continue
            with contextlib.suppress(OSError):
                os.fchmod(inner, stat.S_IMODE(info.st_mode) | stat.S_IRWXU)
            stack.append((inner, name, child, _names(inner)))
            continue
        if on_file is not None and child is not None and stat.S_ISREG(info.st_mode):
            with contextlib.suppress(OSError):
                on_file(child, info)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=fd)
    with contextlib.suppress(OSError):
        os.rmdir(root)


def count(root: Path, max_entries: int, max_path: int) -> tuple[int, int]:
    """The entries (files and folders) under ``root`` and the bytes of its regular files, never following a link.

    Bounded, so a job cannot make the count costly: the walk stops once it has seen more than
    ``max_entries``, and enters no folder whose path below ``root`` is longer than ``max_path``.
    """
    entries = size = 0
    pending = [str(root)]
    base = len(str(root)) + 1
    while pending and entries <= max_entries:
        folder = pending.pop()
        try:
            with os.scandir(folder) as listing:
                for entry in listing:
                    entries += 1
                    if entries > max_entries:
                        break
                    info = entry.stat(follow_symlinks=False)
                    if stat.S_ISDIR(info.st_mode) and len(entry.path) - base <= max_path:
                        pending.append(entry.path)
                    elif stat.S_ISREG(info.st_mode):
                        size += info.st_size
        except OSError:  # a folder gone or unreadable: what it held is not counted
            continue
    return entries, size


def _names(fd: int) -> list[str]:
    """The entries of the open folder ``fd``, or none where it cannot be read."""
    try:
        with os.scandir(fd) as entries:
            return [entry.name for entry in entries]
    except OSError:
        return []
