"""How much a run may write and send: its disk, its number of outputs, its time to send them (pure).

    prefect work-pool update gpu --base-job-template template.json   (default_disk, max_output_files,
                                                                      output_send_seconds)

A job's outputs are sent after its devices are back in the pool, on worker time nobody is billed
for ("teams pay for rent and run only"). So what a job writes is bounded while it runs, and what
is sent is bounded too: ``request.disk`` (else the pool's ``default_disk``) bytes in its output
dir, the pool's ``max_output_files`` files and folders, ``MAX_OUTPUT_PATH`` bytes of path, and
the pool's ``output_send_seconds`` to send them (past that, what is left stays in the spool).
A run past a bound ends ``DiskLimit`` or ``TooManyOutputs``, naming the bound and its fix, and the
outputs up to the bound are sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from e31_prefect.host.fdtree import MAX_OUTPUT_PATH
from e31_prefect.model import endings
from e31_prefect.model.endings import Ending

DEFAULT_DISK = "10g"
DEFAULT_MAX_OUTPUT_FILES = 100_000
DEFAULT_SEND_SECONDS = 3600
FILE_ROOM_BYTES = 4096  # an output disk holds at most one file or folder per 4 KiB of it (its inode tables)


@dataclass(frozen=True)
class OutputBounds:
    """One run's bounds on its outputs, as the worker applies them."""

    disk: str  # as written (request.disk, or the pool's default_disk)
    disk_bytes: int
    max_files: int  # files and folders in the output dir
    send_seconds: float
    disk_from_pool: bool = False  # the job gave no request.disk: the pool's default_disk applies


@dataclass(frozen=True)
class Usage:
    """What the output dir holds once the work ended, as far as the bounds care."""

    entries: int  # files and folders counted (up to max_files + 1)
    disk_full: bool  # the output disk has no room left (or the bytes counted passed disk_bytes)
    inodes_full: bool = False  # the output disk has no inode left (no room for one more file)


def shorten(path: str, keep: int = 60) -> str:
    """A path too long to print whole: its start, and how long it is."""
    if len(path) <= keep:
        return path
    return f"{path[:keep]}... ({len(path)} characters)"


def too_deep(relative: str) -> str:
    """Why a path nested too deep was not sent."""
    return (f"nested {relative.count('/') + 1} folders deep, past the {MAX_OUTPUT_PATH} bytes of path an output "
            "may have: not sent; keep outputs in shallower folders")


def past_entries(max_files: int) -> str:
    """Why the outputs past the bound on their number were not sent."""
    return (f"the output dir holds more than {max_files} files and folders (the pool's max_output_files): "
            "the rest were not sent")


def past_bytes(max_bytes: int) -> str:
    """Why a file past the bound on bytes was not sent."""
    return f"past the {max_bytes} bytes of outputs the run may send (request.disk): not sent"


def overrun(bounds: OutputBounds, usage: Usage) -> Ending | None:
    """The ending a run gets for passing a bound on its outputs; None within them."""
    if usage.entries > bounds.max_files:
        return endings.TOO_MANY_OUTPUTS.saying(
            f"Too many outputs: the job wrote more than {bounds.max_files} files and folders in its output dir "
            f"(the pool's max_output_files = {bounds.max_files}). The first {bounds.max_files} were kept and sent; "
            "the rest were not. Write fewer, larger files (an archive), or raise the pool's max_output_files.")
    where = "the pool's default_disk" if bounds.disk_from_pool else "request.disk"
    if usage.inodes_full and not usage.disk_full:  # a small disk holds fewer files than the pool allows
        return endings.DISK_LIMIT.saying(
            f"Disk limit: the job filled its disk's room for files and folders ({where} = {bounds.disk} holds "
            f"one per {FILE_ROOM_BYTES // 1024} KiB); its files past it failed. The outputs written up to the "
            "limit were kept and sent. Raise request.disk in the job file (or the pool's default_disk), or write "
            "fewer, larger files.")
    if usage.disk_full:
        return endings.DISK_LIMIT.saying(
            f"Disk limit: the job filled its {bounds.disk} of disk ({where} = {bounds.disk}); its writes past it "
            "failed (or it was stopped there). The outputs written up to the limit were kept and sent. Raise "
            "request.disk in the job file (or the pool's default_disk) to write more.")
    return None


def stops_ending(ending: Ending | None) -> bool:
    """Whether a bound passed replaces the ending judged from the work: the work's own end (it completed,
    failed, or died of the full disk) does; a time limit, a cancellation or the memory limit stays."""
    if ending is None:
        return True
    kept = (endings.TIMED_OUT, endings.CANCELLED, endings.OUT_OF_MEMORY, endings.NOT_STARTED)
    return not any(ending.is_(other) for other in kept)


def bounds_for(disk: str | None, default_disk: str | None, max_output_files: object,
               output_send_seconds: object) -> OutputBounds:
    """A run's bounds from its ``request.disk`` and its pool's settings; ValueError naming a bad pool setting,
    its value and the fix (a job's own ``request.disk`` was checked with the job)."""
    from e31_prefect.model.job_values import parse_disk

    chosen = disk or default_disk or DEFAULT_DISK
    try:
        disk_bytes = parse_disk(chosen)
    except ValueError as exc:
        raise ValueError(f"default_disk = {chosen!r} {exc}; set the pool's default_disk to a size such as "
                         "20g") from None
    files = _positive_int("max_output_files", max_output_files, DEFAULT_MAX_OUTPUT_FILES)
    seconds = _positive_int("output_send_seconds", output_send_seconds, DEFAULT_SEND_SECONDS)
    return OutputBounds(chosen, disk_bytes, files, float(seconds), disk_from_pool=not disk)


def _positive_int(name: str, value: object, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} = {value!r} is not a whole number of 1 or more; set the pool's {name} to one, "
                         f"e.g. {default}")
    return value
