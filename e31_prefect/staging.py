"""Data in and outputs out, through fsspec (``file://``) and s3fs (``s3://``).

Inputs are copied into the run's workspace before any GPU is rented and
verified (size, and SHA-256 where the job gives one); outputs are sent from
host disk after the devices are back in the pool, verified, and retried. A
destination that stays down leaves the outputs on disk and says where.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from e31_prefect.job import DataInput

TRANSFER_THREADS = 8


class StagingError(RuntimeError):
    """An input could not be staged; the message names the URL and the cause."""


class UploadError(RuntimeError):
    """Outputs could not be sent; they are still on host disk."""


@dataclass(frozen=True)
class Transfer:
    """What a staging or upload moved: files, bytes and seconds."""

    files: int
    bytes: int
    seconds: float

    @property
    def megabytes_per_second(self) -> float:
        """Throughput in MB/s (10**6 bytes)."""
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        return (f"{self.files} file(s), {self.bytes / 1e6:.2f} MB in {self.seconds:.2f} s "
                f"({self.megabytes_per_second:.1f} MB/s)")


def _filesystem(url: str, options: dict[str, Any] | None) -> tuple[fsspec.AbstractFileSystem, str]:
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    return url_to_fs(url, **((options or {}).get(scheme, {})))


def _copy_all(pairs: list[tuple[Callable[[], None], str]]) -> None:
    """Run the copies concurrently; the first failure is raised once all have stopped."""
    with ThreadPoolExecutor(max_workers=TRANSFER_THREADS) as pool:
        futures = [(pool.submit(copy), label) for copy, label in pairs]
        for future, label in futures:
            try:
                future.result()
            except StagingError:
                raise
            except Exception as exc:
                raise StagingError(f"{label}: {_cause(exc)}") from exc


def _cause(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text


def stage_inputs(
    inputs: Iterable[DataInput],
    data_dir: Path,
    options: dict[str, Any] | None = None,
    log: logging.Logger | logging.LoggerAdapter | None = None,
) -> Transfer:
    """Copy every input under ``data_dir``, verify it, and make the tree read-only."""
    started = time.monotonic()
    data_dir.mkdir(parents=True, exist_ok=True)
    copies: list[tuple[Callable[[], None], str]] = []
    total = 0
    for item in inputs:
        fs, root = _filesystem(item.source, options)
        try:
            listing = _listing(fs, root)
        except FileNotFoundError:
            raise StagingError(f"data {item.source}: not found; check the URL") from None
        except Exception as exc:
            raise StagingError(f"data {item.source}: {_cause(exc)}") from exc
        single = len(listing) == 1 and listing[0][0] == root
        if item.size is not None and single and listing[0][1] != item.size:
            raise StagingError(f"data {item.source}: is {listing[0][1]} bytes, the job expects {item.size}")
        for remote, size in listing:
            relative = "" if single else os.path.relpath(remote, root)
            local = data_dir / item.target / relative if relative else data_dir / item.target
            copies.append((_copier(fs, remote, local, size, item.sha256 if single else None),
                           f"data {item.source}"))
            total += size
    _copy_all(copies)
    _make_read_only(data_dir)
    result = Transfer(len(copies), total, time.monotonic() - started)
    if log:
        log.info("Staged %s", result)
    return result


def _listing(fs: fsspec.AbstractFileSystem, root: str) -> list[tuple[str, int]]:
    """Every file under ``root`` (or ``root`` itself) with its size."""
    if fs.isdir(root):
        found = fs.find(root, detail=True)
        return sorted((path, int(info.get("size") or 0)) for path, info in found.items()
                      if info.get("type") != "directory")
    info = fs.info(root)
    return [(root, int(info.get("size") or 0))]


def _copier(fs, remote: str, local: Path, size: int, sha256: str | None) -> Callable[[], None]:
    def copy() -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(local))
        got = local.stat().st_size
        if got != size:
            raise StagingError(f"{remote}: copied {got} bytes of {size}; the transfer was cut short")
        if sha256 and _sha256(local) != sha256:
            raise StagingError(f"{remote}: SHA-256 differs from the job's sha256; the data changed or is corrupt")
    return copy


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _make_read_only(root: Path) -> None:
    # The job reads its data; write bits go so a stray write fails instead of changing the cache.
    for path in [*root.rglob("*"), root]:
        mode = path.stat().st_mode
        path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def make_writable(root: Path) -> None:
    """Give write bits back so a workspace can be removed."""
    if not root.exists():
        return
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | stat.S_IWUSR)


def missing_outputs(output_dir: Path, expect: Iterable[str]) -> list[str]:
    """Expected outputs the run did not write."""
    return [name for name in expect if not (output_dir / name).exists()]


def spool_outputs(output_dir: Path, spool: Path, flow_run_id: str) -> str:
    """Keep outputs that could not be sent under the host's spool; returns their ``file://`` URL."""
    kept = spool / flow_run_id
    kept.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(output_dir), str(kept))
    return f"file://{kept}/"


def upload_outputs(
    output_dir: Path,
    destination: str,
    options: dict[str, Any] | None = None,
    attempts: int = 3,
    backoff_seconds: float = 1.0,
    log: logging.Logger | logging.LoggerAdapter | None = None,
) -> Transfer:
    """Send every file under ``output_dir`` to ``destination``, verify sizes, retry with backoff."""
    started = time.monotonic()
    files = sorted(p for p in output_dir.rglob("*") if p.is_file())
    fs, root = _filesystem(destination, options)
    root = root.rstrip("/")
    for attempt in range(1, attempts + 1):
        try:
            _send(fs, files, output_dir, root)
            break
        except Exception as exc:
            if attempt == attempts:
                raise UploadError(f"output {destination}: {_cause(exc)} (after {attempts} attempts)") from exc
            if log:
                log.warning("Sending outputs to %s failed (%s); retrying", destination, _cause(exc))
            time.sleep(backoff_seconds * 2 ** (attempt - 1))
    result = Transfer(len(files), sum(p.stat().st_size for p in files), time.monotonic() - started)
    if log:
        log.info("Sent outputs to %s: %s", destination, result)
    return result


def _send(fs: fsspec.AbstractFileSystem, files: list[Path], base: Path, root: str) -> None:
    def put(path: Path) -> None:
        remote = f"{root}/{path.relative_to(base).as_posix()}"
        fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(path), remote)
        if int(fs.info(remote)["size"]) != path.stat().st_size:
            raise UploadError(f"{remote}: size differs after upload")

    with ThreadPoolExecutor(max_workers=TRANSFER_THREADS) as pool:
        list(pool.map(put, files))
    fs.invalidate_cache()
