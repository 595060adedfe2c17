"""A run's output disk: a size-limited filesystem of its own, mounted on its output dir while it lives.

    prefect worker start --pool gpu --type e31   (as root: each run's output dir is its own disk)

Where the worker is root, each run's output dir is a fresh ext4 in a sparse file of the workspace,
loop-mounted: ``request.disk`` bytes and an inode for each of the pool's ``max_output_files``
(and the few the filesystem keeps). The kernel enforces both in every runtime (a container sees
the same filesystem through its bind mount), so a job that writes past its disk gets ENOSPC
itself, and nothing it does fills the host. The worker then reads the disk's free space and
inodes to say which bound was reached (:mod:`e31_prefect.host.output_bounds`).

Where the worker is not root (no loop mount), the run's supervisor counts what the output dir
holds every few seconds and stops the work past a bound, whether or not its worker lives
(:func:`e31_prefect.host.fdtree.count`); the worker's watch of the run does the same.

The disk is unmounted where a run's workspace is removed (:func:`e31_prefect.data.staging.remove_workspace`,
reached by a run's own release and by the adoption of a run whose worker died): a loop mount's
device is detached with its last unmount.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

from e31_prefect.host import fdtree, output_bounds
from e31_prefect.host.output_bounds import OutputBounds, Usage

IMAGE_NAME = ".output-disk"  # in the workspace, beside the output dir: root's only (0600)
INODE_SHARE = output_bounds.FILE_ROOM_BYTES  # at most an inode per 4 KiB of disk: its tables take 1/16 of it
RESERVED_INODES = 16  # ext4's own (1-10), lost+found and the root folder, with a margin
MIN_FREE_BYTES = 64 * 1024
# ext4 keeps back min(4096 blocks, 2% of them) for its own use, which statvfs still counts as free:
# writes fail with that much seemingly left (seen: 401 KiB "free" on a full 16 MiB disk).
RESERVED_SHARE, RESERVED_BLOCKS_MAX = 25, 4096


class DiskError(RuntimeError):
    """The output disk could not be made; the run goes on bounded by the worker's watch instead."""


def can_mount() -> str | None:
    """Why this host cannot give runs a disk of their own (None: it can)."""
    if os.geteuid() != 0:
        return "the worker is not root"
    missing = [tool for tool in ("mkfs.ext4", "mount", "umount") if shutil.which(tool) is None]
    return f"{', '.join(missing)} not found" if missing else None


def mount(workspace: Path, output_dir: Path, bounds: OutputBounds) -> None:
    """Make the run's output disk and mount it on ``output_dir`` (an empty folder); :class:`DiskError` if not."""
    image = workspace / IMAGE_NAME
    try:
        fd = os.open(image, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, bounds.disk_bytes)  # sparse: the host's disk is used only as the job writes
        finally:
            os.close(fd)
    except OSError as exc:
        raise DiskError(f"the disk image {image} could not be made: {exc}") from None
    try:
        # No journal (a run's scratch survives no crash anyway) and no reserved blocks: request.disk is the job's.
        _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", "-N", str(inodes(bounds)),
              "-E", "lazy_itable_init=1,lazy_journal_init=1", str(image)])
        _run(["mount", "-o", "loop,nosuid,nodev", str(image), str(output_dir)])
    except DiskError:
        image.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):
        os.rmdir(output_dir / "lost+found")  # not the job's, and not an output


def inodes(bounds: OutputBounds) -> int:
    """The output disk's inodes: one per output the pool allows, as far as a 16th of the disk holds them
    (256 bytes each); a small disk holds fewer files, and filling them is filling the disk."""
    return min(bounds.max_files + RESERVED_INODES, bounds.disk_bytes // INODE_SHARE)


def _run(argv: list[str]) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DiskError(f"{argv[0]} failed: {exc}") from None
    if done.returncode != 0:
        raise DiskError(f"{argv[0]} failed ({done.returncode}): {done.stderr.strip()[-500:]}")


def mounts_under(root: Path) -> list[str]:
    """The mount points at or under ``root`` (this process's view), deepest first."""
    base = os.path.realpath(root)
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as table:
        for line in table:
            point = _unescape(line.split()[4])
            if point == base or point.startswith(base.rstrip("/") + "/"):
                found.append(point)
    return sorted(set(found), key=len, reverse=True)


def _unescape(field: str) -> str:
    # mountinfo writes a space, tab, newline and backslash in a path as \040, \011, \012 and \134.
    return field.encode().decode("unicode_escape") if "\\" in field else field


def unmount_under(root: Path) -> None:
    """Unmount every filesystem mounted at or under ``root`` (a run's output disk), detaching its loop device.

    A process the job left that still holds a file of it (it is being killed) gets a lazy unmount: the
    folder is free at once, the device once the last file closes.
    """
    for point in mounts_under(root):
        done = subprocess.run(["umount", point], capture_output=True, timeout=60)
        if done.returncode != 0:
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=60)


def full(available_blocks: int, blocks: int, block_size: int) -> bool:
    """Whether an ext4 disk with this many blocks available has been filled (what it keeps back counts as used)."""
    kept_back = min(RESERVED_BLOCKS_MAX, blocks // RESERVED_SHARE) * block_size
    return available_blocks * block_size < kept_back + MIN_FREE_BYTES


def measure(output_dir: Path, bounds: OutputBounds) -> Usage:
    """What the output dir holds, as far as its bounds care, read without following a link.

    Entries are counted up to one past ``max_files`` (the walk stops there) and not below the
    deepest folder an output may be in. A mounted output disk says itself whether it is full.
    """
    entries, total = fdtree.count(output_dir, bounds.max_files, output_bounds.MAX_OUTPUT_PATH)
    if os.path.ismount(output_dir):
        try:
            info = os.statvfs(output_dir)
        except OSError:
            return Usage(entries, False)
        return Usage(entries, full(info.f_bavail, info.f_blocks, info.f_frsize), info.f_favail == 0)
    return Usage(entries, total > bounds.disk_bytes)
