"""Data in and outputs out, through fsspec (``file://``) and s3fs (``s3://``).

Inputs are copied into the run's workspace before any GPU is rented: many at
once, each verified (size; the MD5 where the object's ETag is one; SHA-256
where the job gives one), S3 objects through the host's content cache
(:mod:`e31_prefect.cache`), with progress in the run's log. Outputs are sent
from host disk after the devices are back in the pool, many at once, verified
and retried with backoff; a destination that stays down leaves them in the
spool (:mod:`e31_prefect.spool`) for ``e31 outputs retry``.
"""

from __future__ import annotations

import logging
import shutil
import stat
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from e31_prefect import store
from e31_prefect.cache import ContentCache, cache_key, check, etag_md5, file_digest
from e31_prefect.job import DataInput

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
    from e31_prefect.settings import E31Settings

    settings = E31Settings()
    return ContentCache(settings.cache, settings.cache_bytes) if settings.cache_bytes > 0 else None


def stage_inputs(
    inputs: Iterable[DataInput],
    data_dir: Path,
    options: dict[str, Any] | None = None,
    log: Log | None = None,
    cache: ContentCache | bool = True,
) -> Transfer:
    """Copy every input under ``data_dir``, verify it, and make the tree read-only.

    ``options``: fsspec options by URL scheme. ``cache``: True for the host's content cache,
    False for none, or a :class:`ContentCache`. S3 objects go through the cache; ``file://``
    inputs are copied directly (they are on this host already, and a local file has no content
    tag: size and mtime could take a file rewritten within the same second for the old one).
    """
    started = time.monotonic()
    content_cache = host_cache() if cache is True else (cache or None)
    before = (content_cache.counters.hits, content_cache.counters.hit_bytes) if content_cache else (0, 0)
    data_dir.mkdir(parents=True, exist_ok=True)
    items = _plan(inputs, data_dir, options)
    total = sum(item.obj.size for item in items)
    progress = Progress("Staging:", len(items), total, log)
    if log:
        log.info("Staging %d file(s), %.1f MB into %s", len(items), total / 1e6, data_dir)
    # What the host's cache holds is linked here first, in this thread: a link costs a few system
    # calls, less than handing it to a thread. Only the rest is downloaded, many at once.
    pending = [item for item in items if not _take_cached(item, content_cache, progress)]
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
        content_cache.trim()
    _make_read_only(data_dir)
    hits, hit_bytes = ((content_cache.counters.hits - before[0], content_cache.counters.hit_bytes - before[1])
                       if content_cache else (0, 0))
    result = Transfer(len(items), total, time.monotonic() - started, hits, total - hit_bytes)
    if log:
        log.info("Staged %s", result)
    return result


def _plan(inputs: Iterable[DataInput], data_dir: Path, options: dict[str, Any] | None) -> list[_Item]:
    """Each object to stage and where it goes; bad input fails here, before anything is copied."""
    items = []
    for item in inputs:
        fs, root = store.filesystem(item.source, options)
        prefix = item.source.endswith("/")
        try:
            listed, single = store.listing(fs, root.rstrip("/") if prefix else root, prefix)
        except Exception as exc:
            raise StagingError("data " + store.explain(item.source, exc, fs)) from None
        if item.size is not None and single and listed[0].size != item.size:
            raise StagingError(f"data {item.source}: is {listed[0].size} bytes, the job expects {item.size}; "
                               "check the URL or the job's size")
        base = root.rstrip("/")
        for obj in listed:
            relative = "" if single else PurePosixPath(obj.path).relative_to(base).as_posix()
            local = data_dir / item.target / relative if relative else data_dir / item.target
            items.append(_Item(fs, obj, local, f"data {item.source}", item.sha256 if single else None))
    return items


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
    for path in [*root.rglob("*"), root]:
        mode = path.stat().st_mode
        path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def remove_workspace(root: Path) -> None:
    """Remove a run's workspace, its read-only data included (hard links to the cache stay in the cache)."""
    if root.exists():
        make_writable(root)
        shutil.rmtree(root, ignore_errors=True)


def make_writable(root: Path) -> None:
    """Give folders their write bits back so a workspace can be removed.

    Only folders: removing a file needs its folder writable, not the file, and a staged file may
    be a hard link to a cache entry, which stays read-only.
    """
    if not root.exists():
        return
    for path in [root, *root.rglob("*")]:
        if path.is_dir() and not path.is_symlink():
            path.chmod(path.stat().st_mode | stat.S_IWUSR)


def missing_outputs(output_dir: Path, expect: Iterable[str]) -> list[str]:
    """Expected outputs the run did not write."""
    return [name for name in expect if not (output_dir / name).exists()]


def upload_outputs(
    output_dir: Path,
    destination: str,
    options: dict[str, Any] | None = None,
    attempts: int = 3,
    backoff_seconds: float = 1.0,
    log: Log | None = None,
) -> Transfer:
    """Send every file under ``output_dir`` to ``destination``, many at once, verified, retried with backoff.

    An attempt stops at its first failure (a store that is down fails every file alike); the next
    one sends only the files not yet verified in the store.
    """
    started = time.monotonic()
    files = sorted(p for p in output_dir.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    fs, root = store.filesystem(destination, options)
    root = root.rstrip("/")
    progress = Progress("Sending outputs:", len(files), total, log)
    pending = files
    for attempt in range(1, attempts + 1):
        pending, error = _send(fs, pending, output_dir, root, progress)
        if not pending:
            break
        cause = store.explain(destination, error, reading=False) if error else "not sent"
        if attempt == attempts:
            raise UploadError(f"output {cause} ({len(pending)} of {len(files)} file(s) not sent "
                              f"after {attempts} attempts)")
        if log:
            log.warning("Sending outputs failed (%s); %d file(s) left, retrying", cause, len(pending))
        time.sleep(backoff_seconds * 2 ** (attempt - 1))
    result = Transfer(len(files), total, time.monotonic() - started)
    if log:
        log.info("Sent outputs to %s: %s", destination, result)
    return result


def _send(fs: Any, files: list[Path], base: Path, root: str,
          progress: Progress) -> tuple[list[Path], BaseException | None]:
    """Send ``files``; returns those not sent and the first error."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def put(path: Path) -> bool:
        if stop.is_set():
            return False
        try:
            store.put_file(fs, path, f"{root}/{path.relative_to(base).as_posix()}")
        except Exception as exc:
            errors.append(exc)
            stop.set()
            return False
        progress.file_done(path.stat().st_size)
        return True

    with ThreadPoolExecutor(max_workers=SEND_THREADS) as pool:
        sent = list(pool.map(put, files))
    fs.invalidate_cache()
    return [path for path, ok in zip(files, sent, strict=True) if not ok], errors[0] if errors else None
