"""Data in and outputs out, through fsspec (``file://``) and s3fs (``s3://``).

Inputs are copied into the run's workspace before any GPU is rented: many at
once, each verified (size; the MD5 where the object's ETag is one; SHA-256
where the job gives one), S3 objects through the host's content cache
(:mod:`e31_prefect.data.cache`), with progress in the run's log. Outputs are sent
from host disk after the devices are back in the pool, many at once, verified
and retried with backoff; a destination that stays down leaves them in the
spool (:mod:`e31_prefect.surface.spool`) for ``e31 outputs retry``.

The paths stay where the job may go (:mod:`e31_prefect.data.confine`): ``file://``
inputs come only from the roots the run may read, and never through a link
out of a staged folder; only the job's own bytes leave its output dir (regular
files with one name, found without following a link), within the run's bounds
(:mod:`e31_prefect.host.output_bounds`: entries, bytes, depth, time), and what is not
sent is reported by name.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from e31_prefect.data import confine, store
from e31_prefect.data.cache import ContentCache, cache_key, check, etag_md5, file_digest
from e31_prefect.data.confine import Skipped
from e31_prefect.model.job import DataInput

# Many small objects cost a round trip each: enough threads keep the store busy while some wait.
STAGE_THREADS = 32
SEND_THREADS = 16
PROGRESS_SECONDS = 5.0
GET_ATTEMPTS = 3

Log = logging.Logger | logging.LoggerAdapter


class StagingError(RuntimeError):
    """An input could not be staged; the message names the URL and the cause."""


class UploadError(RuntimeError):
    """Outputs could not be sent; they are still on host disk."""


@dataclass(frozen=True)
class Transfer:
    """What a staging or upload moved: files, bytes and seconds (and what came from the host's cache)."""

    files: int
    bytes: int
    seconds: float
    cached_files: int = 0
    downloaded_bytes: int = 0
    skipped: tuple[Skipped, ...] = ()  # outputs not sent: links and special files

    @property
    def megabytes_per_second(self) -> float:
        """Throughput in MB/s (10**6 bytes)."""
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        text = (f"{self.files} file(s), {self.bytes / 1e6:.2f} MB in {self.seconds:.2f} s "
                f"({self.megabytes_per_second:.1f} MB/s)")
        if self.cached_files:
            text += (f"; {self.cached_files} from the host's cache, "
                     f"{self.downloaded_bytes / 1e6:.2f} MB downloaded")
        if self.skipped:
            text += f"; {len(self.skipped)} not sent (links or special files)"
        return text


class Progress:
    """Counts files and bytes as they move and logs them every few seconds (thread-safe)."""

    def __init__(self, verb: str, files: int, total: int, log: Log | None, every: float = PROGRESS_SECONDS):
        self.verb, self.files_total, self.bytes_total = verb, files, total
        self.log, self.every = log, every
        self.files = self.bytes = 0
        self.started = self._logged = time.monotonic()
        self._lock = threading.Lock()

    def add_bytes(self, count: int) -> None:
        """Bytes arrived (called per chunk)."""
        with self._lock:
            self.bytes += count
        self._maybe_log()

    def file_done(self, size: int, counted: bool = False) -> None:
        """A file is in place; ``counted``: its bytes were already added chunk by chunk."""
        with self._lock:
            self.files += 1
            if not counted:
                self.bytes += size
        self._maybe_log()

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if self.log is None or now - self._logged < self.every:
            return
        with self._lock:
            if now - self._logged < self.every:
                return
            self._logged = now
            files, done = self.files, self.bytes
        seconds = now - self.started
        self.log.info("%s %d/%d file(s), %.1f/%.1f MB, %.1f MB/s", self.verb, files, self.files_total,
                      done / 1e6, self.bytes_total / 1e6, done / 1e6 / seconds if seconds else 0.0)


@dataclass(frozen=True)
class _Item:
    fs: Any
    obj: store.Listed
    local: Path
    label: str
    sha256: str | None


def host_cache() -> ContentCache | None:
    """This host's content cache, from the settings (None when E31_CACHE_BYTES is 0)."""
    from e31_prefect.host.settings import E31Settings

    settings = E31Settings()
    return ContentCache(settings.cache, settings.cache_bytes) if settings.cache_bytes > 0 else None


def stage_inputs(
    inputs: Iterable[DataInput],
    data_dir: Path,
    options: dict[str, Any] | None = None,
    log: Log | None = None,
    cache: ContentCache | bool = True,
    roots: Sequence[Path] | None = None,
    team: str | None = None,
) -> Transfer:
    """Copy every input under ``data_dir``, verify it, and make the tree read-only.

    ``options``: fsspec options by URL scheme. ``cache``: True for the host's content cache,
    False for none, or a :class:`ContentCache`. S3 objects go through the cache; ``file://``
    inputs are copied directly (they are on this host already, and a local file has no content
    tag: size and mtime could take a file rewritten within the same second for the old one).

    ``roots``: the folders ``file://`` inputs may come from (:func:`e31_prefect.data.confine.run_roots`
    for the job's ``team``); an input elsewhere fails :class:`StagingError` before anything is
    copied. None checks no root: only for a caller that trusts every path it stages. Whatever the
    roots, a link in a staged folder is followed only to a file inside that folder.
    """
    started = time.monotonic()
    content_cache = host_cache() if cache is True else (cache or None)
    before = (content_cache.counters.hits, content_cache.counters.hit_bytes) if content_cache else (0, 0)
    downloads_before = content_cache.counters.downloads if content_cache else 0
    data_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress("Staging:", 0, 0, log)
    items: list[_Item] = []
    pending: list[_Item] = []
    # What the host's cache holds is linked as the listing names it, in this thread: a link costs a few system
    # calls, less than handing it to a thread, and the store lists the next page meanwhile. Only the rest is
    # downloaded, many at once, once every input was planned (a bad one fails before any download).
    for item in _plan(inputs, data_dir, options, roots, team):
        items.append(item)
        if not _take_cached(item, content_cache, progress):
            pending.append(item)
    total = sum(item.obj.size for item in items)
    progress.files_total, progress.bytes_total = len(items), total
    if log:
        log.info("Staging %d file(s), %.1f MB into %s (%d from the host's cache)", len(items), total / 1e6,
                 data_dir, len(items) - len(pending))
    with ThreadPoolExecutor(max_workers=STAGE_THREADS) as pool:
        results = [pool.submit(_stage_one, item, content_cache, progress) for item in pending]
        failure = None
        for future in results:
            try:
                future.result()
            except StagingError as exc:
                failure = failure or exc
    if failure:
        raise failure
    if content_cache:
        _say_changed(content_cache, items, log)
        if content_cache.counters.downloads > downloads_before:
            # Only what it added can take the cache past its bound; trimming reads every entry's status, and
            # would be most of the time of a re-stage that links thousands of files and downloads none.
            content_cache.trim()
    _make_read_only(data_dir)
    hits, hit_bytes = ((content_cache.counters.hits - before[0], content_cache.counters.hit_bytes - before[1])
                       if content_cache else (0, 0))
    result = Transfer(len(items), total, time.monotonic() - started, hits, total - hit_bytes)
    if log:
        log.info("Staged %s", result)
    return result


def _plan(inputs: Iterable[DataInput], data_dir: Path, options: dict[str, Any] | None,
          roots: Sequence[Path] | None = None, team: str | None = None) -> Iterator[_Item]:
    """Each object to stage and where it goes, as the listings name them; bad input fails here, before
    anything is downloaded."""
    for item in inputs:
        fs, root = store.filesystem(item.source, options)
        if store.is_local(fs):
            yield from _plan_local(item, fs, root, data_dir, roots, team)
            continue
        prefix = item.source.endswith("/")
        base = root.rstrip("/")
        try:
            listed, single = store.listing(fs, base if prefix else root, prefix)
            for obj in listed:
                if item.size is not None and single and obj.size != item.size:
                    raise StagingError(f"data {item.source}: is {obj.size} bytes, the job expects {item.size}; "
                                       "check the URL or the job's size")
                relative = "" if single else PurePosixPath(obj.path).relative_to(base).as_posix()
                if ".." in PurePosixPath(relative).parts:  # S3 keys may hold '..': it would climb out of data/
                    raise StagingError(f"data {item.source}: the store holds the key {obj.path.split('/', 1)[-1]!r}, "
                                       f"whose '..' would put it outside {item.target}; e31 stages no such key. "
                                       "Rename or remove it in the store")
                local = data_dir / item.target / relative if relative else data_dir / item.target
                yield _Item(fs, obj, local, f"data {item.source}", item.sha256 if single else None)
        except StagingError:
            raise
        except Exception as exc:
            raise StagingError("data " + store.explain(item.source, exc, fs)) from None


def _plan_local(item: DataInput, fs: Any, root: str, data_dir: Path, roots: Sequence[Path] | None,
                team: str | None) -> list[_Item]:
    """A ``file://`` input's files, from its real path, once it is known to lie where the run may read."""
    label = f"data {item.source}"
    if roots is not None:
        try:
            real = confine.confine_file_url(item.source, roots, "data", team)
        except confine.PathRefused as exc:
            raise StagingError(str(exc)) from None
    else:
        real = os.path.realpath(root)
    try:
        info = os.stat(real)
    except OSError as exc:
        raise StagingError(f"{label}: " + store.explain(item.source, exc, fs)) from None
    if stat.S_ISREG(info.st_mode):
        if item.size is not None and info.st_size != item.size:
            raise StagingError(f"{label}: is {info.st_size} bytes, the job expects {item.size}; "
                               "check the URL or the job's size")
        return [_Item(fs, store.Listed(real, info.st_size, None), data_dir / item.target, label, item.sha256)]
    if not stat.S_ISDIR(info.st_mode):
        raise StagingError(f"{label}: is {confine.not_sent_because(info.st_mode, 1)}, not a file or folder; "
                           "stage regular files and folders only")
    try:
        files = _folder_files(real, label)
    except OSError as exc:  # a folder in it that cannot be read
        raise StagingError(f"{label}: " + store.explain(exc.filename or item.source, exc, fs)) from None
    return [_Item(fs, store.Listed(path, size, None), data_dir / item.target / relative, label, None)
            for relative, path, size in files]


def _folder_files(folder: str, label: str) -> list[tuple[str, str, int]]:
    """Every file of a staged folder: its path in the folder, the real path its bytes are read from, its size.

    The folder is walked without following links. A link is staged as a copy of its target only when
    that is a regular file inside the folder; a link out of it, to a folder, or a special file (a fifo
    would hang the staging) fails, naming it.
    """
    found: list[tuple[str, str, int]] = []
    pending = [folder]
    while pending:
        current = pending.pop()
        with os.scandir(current) as entries:
            listed = sorted(entries, key=lambda e: e.name)
        for entry in listed:
            relative = os.path.relpath(entry.path, folder)
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                pending.append(entry.path)
            elif stat.S_ISREG(info.st_mode):
                found.append((relative, entry.path, info.st_size))
            elif stat.S_ISLNK(info.st_mode):
                target = os.path.realpath(entry.path)
                inside = confine.within(target, folder) and os.path.isfile(target)
                if not inside:
                    raise StagingError(
                        f"{label}: {relative} is a symbolic link to {os.readlink(entry.path)}, which is not a file "
                        f"inside the staged folder {folder}; e31 does not follow links out of a staged folder. "
                        "Replace the link with the file, or stage its target as an input of its own")
                found.append((relative, target, os.stat(target).st_size))
            else:
                raise StagingError(f"{label}: {relative} is {confine.not_sent_because(info.st_mode, 1)}; "
                                   "only regular files and folders are staged. Remove it from the folder")
    return sorted(found)


def _say_changed(content_cache: ContentCache, items: list[_Item], log: Log | None) -> None:
    """Tell the run's log which cached inputs had changed since they were verified (and were fetched again)."""
    if log is None or not content_cache.counters.changed:
        return
    changed = set(content_cache.counters.changed)
    urls = sorted({f"s3://{i.obj.path}" for i in items
                   if i.obj.etag and cache_key(i.obj.etag, i.obj.size, f"s3://{i.obj.path}") in changed})
    log.warning("The host's cache held %d input(s) whose bytes had changed since they were verified (written "
                "through a job's link?): evicted and fetched again: %s", len(changed), ", ".join(urls) or "?")


def _take_cached(item: _Item, content_cache: ContentCache | None, progress: Progress) -> bool:
    """Link ``item`` from the host's cache if it holds it (and the job gave no SHA-256 to check)."""
    obj = item.obj
    if content_cache is None or item.sha256 or not obj.etag or not store.is_s3(item.fs):
        return False
    if not content_cache.take(cache_key(obj.etag, obj.size, f"s3://{obj.path}"), obj.size, item.local):
        return False
    progress.file_done(obj.size)
    return True


def _stage_one(item: _Item, content_cache: ContentCache | None, progress: Progress) -> None:
    url = f"s3://{item.obj.path}" if store.is_s3(item.fs) else item.obj.path
    for attempt in range(1, GET_ATTEMPTS + 1):
        try:
            _fetch(item, content_cache, progress)
            break
        except (FileNotFoundError, PermissionError) as exc:
            raise StagingError(f"{item.label}: " + store.explain(url, exc, item.fs)) from None
        except Exception as exc:
            if attempt == GET_ATTEMPTS:
                raise StagingError(f"{item.label}: {store.explain(url, exc, item.fs)} "
                                   f"(after {GET_ATTEMPTS} attempts)") from None
            time.sleep(0.5 * attempt)
    if item.sha256 and file_digest(item.local, "sha256") != item.sha256:
        raise StagingError(f"{item.label}: SHA-256 differs from the job's sha256; the data changed or is corrupt")


def _fetch(item: _Item, content_cache: ContentCache | None, progress: Progress) -> None:
    obj = item.obj
    if not store.is_s3(item.fs):
        item.local.parent.mkdir(parents=True, exist_ok=True)
        if store.is_local(item.fs):
            store.get_local(obj.path, item.local)  # the real path planned, never through a new link
        else:
            item.fs.get_file(obj.path, str(item.local))
        check(item.local, obj.size, None)
        progress.file_done(obj.size)
        return

    def download(path: Path) -> str | None:
        return store.get_object(item.fs, obj, path, progress.add_bytes)

    if content_cache is None or not obj.etag:
        check(item.local, obj.size, etag_md5(obj.etag), download(item.local))
        progress.file_done(obj.size, counted=True)
        return
    key = cache_key(obj.etag, obj.size, f"s3://{obj.path}")
    hit = content_cache.provide(key, obj.size, item.local, download, etag_md5(obj.etag))
    progress.file_done(obj.size, counted=not hit)


def _make_read_only(root: Path) -> None:
    # The job reads its data; write bits go so a stray write fails instead of changing the cache.
    # Files already read-only (those linked from the cache) are left alone: even a chmod that
    # changes nothing moves their change time, which the cache reads as a write.
    writable = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
    for path in [*root.rglob("*"), root]:
        mode = path.lstat().st_mode
        if mode & writable and not stat.S_ISLNK(mode):
            path.chmod(mode & ~writable)


def remove_workspace(root: Path, cache: ContentCache | bool = True) -> None:
    """Remove a run's workspace, its read-only data included (hard links to the cache stay in the cache).

    Its output disk (:mod:`e31_prefect.host.disk`) is unmounted first. The tree is removed by directory
    descriptor (:func:`e31_prefect.host.fdtree.remove_tree`): a job may nest folders past ``PATH_MAX``,
    deeper than a path or Python's recursion reaches. A file linked from the host's content cache
    is removed by the cache (``cache``: True for the host's, False for none), which records its
    entry anew: otherwise the next job to stage it would take the entry's moved change time for a
    write and fetch it again.
    """
    from e31_prefect.host import disk, fdtree

    disk.unmount_under(root)
    if not os.path.lexists(root):
        return
    content_cache = host_cache() if cache is True else (cache or None)

    def release(path: str, info: os.stat_result) -> None:
        if content_cache is None or info.st_nlink < 2:
            return
        try:
            content_cache.release(Path(path))
        except OSError as exc:  # the workspace goes anyway; the entry is only fetched again next time
            logging.getLogger("e31.staging").warning("Releasing %s from the cache failed: %s", path, exc)

    fdtree.remove_tree(root, release)


def own_files(output_dir: Path, max_entries: int | None = None,
              max_bytes: int | None = None) -> tuple[list[Path], list[Skipped]]:
    """The job's own files under ``output_dir`` and what is not sent, found without following any link.

    Only regular files with one name are the job's own bytes (:func:`e31_prefect.data.confine.not_sent_because`);
    links, hard links and special files are returned as skipped, with why (a link with its target),
    so the caller can say which. A missing output dir holds nothing.

    The walk is bounded, so a job cannot buy unbilled worker time with its outputs: a folder nested
    deeper than :data:`~e31_prefect.host.output_bounds.MAX_OUTPUT_PATH` bytes of path is not entered (nor a
    file named so deep sent: no store takes such a key), the walk stops after ``max_entries`` entries
    (files and folders), and files past ``max_bytes`` in all are not sent; each is named as skipped.
    """
    from e31_prefect.host import output_bounds

    try:
        top = os.lstat(output_dir)
    except FileNotFoundError:
        return [], []
    if not stat.S_ISDIR(top.st_mode):
        why = confine.not_sent_because(top.st_mode, top.st_nlink) or "not a folder"
        return [], [Skipped(".", f"the output dir itself is {why}{_target(output_dir, top)}")]
    files: list[Path] = []
    skipped: list[Skipped] = []
    pending = [output_dir]
    entries_seen = total = 0
    while pending:
        folder = pending.pop()
        try:
            with os.scandir(folder) as listing:
                # Bounded: a folder of a million entries is not read past the bound.
                entries = list(itertools.islice(listing, None if max_entries is None
                                                else max_entries - entries_seen + 1))
        except OSError as exc:
            skipped.append(Skipped(_relative(folder, output_dir), f"a folder that could not be read: {exc.strerror}"))
            continue
        for entry in entries:
            path = Path(entry.path)
            relative = _relative(path, output_dir)
            if max_entries is not None and entries_seen >= max_entries:
                skipped.append(Skipped("...", output_bounds.past_entries(max_entries)))
                return sorted(files), sorted(skipped, key=lambda s: s.path)
            entries_seen += 1
            if len(relative.encode(errors="surrogateescape")) > output_bounds.MAX_OUTPUT_PATH:
                skipped.append(Skipped(output_bounds.shorten(relative), output_bounds.too_deep(relative)))
                continue
            info = entry.stat(follow_symlinks=False)
            why = confine.not_sent_because(info.st_mode, info.st_nlink)
            if stat.S_ISDIR(info.st_mode):
                pending.append(path)
            elif why is None and max_bytes is not None and total + info.st_size > max_bytes:
                skipped.append(Skipped(relative, output_bounds.past_bytes(max_bytes)))
            elif why is None:
                files.append(path)
                total += info.st_size
            else:
                skipped.append(Skipped(relative, why + _target(path, info)))
    return sorted(files), sorted(skipped, key=lambda s: s.path)


def _relative(path: Path, base: Path) -> str:
    return path.relative_to(base).as_posix() if path != base else "."


def _target(path: Path, info: os.stat_result) -> str:
    """`` to TARGET`` for a symbolic link (read, never followed); nothing for anything else."""
    if not stat.S_ISLNK(info.st_mode):
        return ""
    try:
        return f" to {os.readlink(path)}"
    except OSError:
        return ""


def missing_outputs(output_dir: Path, expect: Iterable[str]) -> list[str]:
    """Expected outputs the run did not write as its own: absent, or a link or special file (not sent), so named.

    Each folder on the way must be a real folder, and the output itself a folder or a regular file
    with one name: what is not sent cannot count as written.
    """
    missing = []
    for name in expect:
        path, why = output_dir, None
        for part in PurePosixPath(name).parts:
            path = path / part
            try:
                info = path.lstat()
            except (FileNotFoundError, NotADirectoryError):
                why = ""
                break
            why = confine.not_sent_because(info.st_mode, info.st_nlink)
            if why is not None:
                why += _target(path, info)
                break
        if why is not None:
            missing.append(f"{name} ({why}: not sent)" if why else name)
    return missing


def upload_outputs(
    output_dir: Path,
    destination: str,
    options: dict[str, Any] | None = None,
    attempts: int = 3,
    backoff_seconds: float = 1.0,
    log: Log | None = None,
    max_entries: int | None = None,
    max_bytes: int | None = None,
    time_limit: float | None = None,
) -> Transfer:
    """Send the job's own files under ``output_dir`` to ``destination``, many at once, verified, retried.

    Only what :func:`own_files` finds is sent: a link, hard link or special file the job left is
    not followed, and is returned in the transfer's ``skipped`` (and logged); so are the outputs
    past ``max_entries`` or ``max_bytes``. A local destination is written only through real folders
    (:func:`e31_prefect.data.store.put_local`): give its real path.

    An attempt stops at its first failure (a store that is down fails every file alike); the next
    one sends only the files not yet verified in the store. Sending takes at most ``time_limit``
    seconds (worker time nobody is billed for): past it, :class:`UploadError` says what was left.
    """
    started = time.monotonic()
    stop_at = started + time_limit if time_limit is not None else None
    files, skipped = own_files(output_dir, max_entries, max_bytes)
    if skipped and log:
        log.warning("Not sending %s", confine.skipped_summary(skipped))
    sizes = {path: path.lstat().st_size for path in files}
    total = sum(sizes.values())
    fs, root = store.filesystem(destination, options)
    root = root.rstrip("/")
    progress = Progress("Sending outputs:", len(files), total, log)
    pending = files
    for attempt in range(1, attempts + 1):
        pending, error = _send(fs, pending, output_dir, root, progress, sizes, stop_at)
        if not pending:
            break
        if stop_at is not None and time.monotonic() >= stop_at:
            raise UploadError(f"output sending stopped at its time limit of {time_limit:g} s (the pool's "
                              f"output_send_seconds): {len(pending)} of {len(files)} file(s) not sent; send fewer "
                              "bytes, or raise the pool's output_send_seconds")
        cause = store.explain(destination, error, reading=False) if error else "not sent"
        if attempt == attempts:
            raise UploadError(f"output {cause} ({len(pending)} of {len(files)} file(s) not sent "
                              f"after {attempts} attempts)")
        if log:
            log.warning("Sending outputs failed (%s); %d file(s) left, retrying", cause, len(pending))
        time.sleep(backoff_seconds * 2 ** (attempt - 1))
    result = Transfer(len(files), total, time.monotonic() - started, skipped=tuple(skipped))
    if log:
        log.info("Sent outputs to %s: %s", destination, result)
    return result


def _send(fs: Any, files: list[Path], base: Path, root: str, progress: Progress,
          sizes: dict[Path, int], stop_at: float | None = None) -> tuple[list[Path], BaseException | None]:
    """Send ``files`` (none started after ``stop_at``); returns those not sent and the first error."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def put(path: Path) -> bool:
        if stop.is_set() or (stop_at is not None and time.monotonic() >= stop_at):
            return False
        try:
            store.put_file(fs, path, f"{root}/{path.relative_to(base).as_posix()}")
        except Exception as exc:
            errors.append(exc)
            stop.set()
            return False
        progress.file_done(sizes[path])
        return True

    with ThreadPoolExecutor(max_workers=SEND_THREADS) as pool:
        sent = list(pool.map(put, files))
    fs.invalidate_cache()
    return [path for path, ok in zip(files, sent, strict=True) if not ok], errors[0] if errors else None
