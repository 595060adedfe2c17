"""Talking to an object store through fsspec/s3fs: list, get and put objects, and say what its errors mean.

Used by staging (``stage_inputs``) and output sending (``upload_outputs``).
An S3 object is fetched with one GET (ranged concurrent parts when large),
pinned to the ETag its listing gave, and written and hashed as it arrives. A
small output is sent with one PUT that carries its MD5, so the store itself
refuses bytes damaged on the way.

A job's output is read only as what its walk found: a regular file with one
name, opened without following a link. A local (``file://``) destination is
written one folder at a time from ``/``, never through a symbolic link, so a
link someone left in it cannot carry the bytes elsewhere on the host.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import hashlib
import mimetypes
import os
import queue
import shutil
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import fsspec
from fsspec.asyn import sync
from fsspec.core import url_to_fs

from e31_prefect.data.cache import ETAG_NOT_MD5, etag_md5, file_digest, plain_etag

CHUNK_BYTES = 1 << 20
# Objects this large come in ranged parts fetched at once: one GET stream is slower than the
# store's bandwidth. Smaller ones are fetched whole: many of them at once already fill the pipe.
RANGED_MIN_BYTES = 64 << 20
PART_BYTES = 16 << 20
PARTS_AT_ONCE = 8
SINGLE_PUT_MAX_BYTES = 16 << 20
POOL_CONNECTIONS = 64


@dataclass(frozen=True)
class Listed:
    """One object of a listing: where it is, its size and ETag (None where the store has none)."""

    path: str
    size: int
    etag: str | None


def filesystem(url: str, options: dict[str, Any] | None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for a URL, with the options given for its scheme, and the path in it."""
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    kwargs = dict((options or {}).get(scheme, {}))
    if scheme == "s3":
        # Enough pooled connections for the transfers staging runs at once (botocore's default is 10).
        config = dict(kwargs.get("config_kwargs") or {})
        config.setdefault("max_pool_connections", POOL_CONNECTIONS)
        kwargs["config_kwargs"] = config
    return url_to_fs(url, **kwargs)


def is_s3(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is s3fs (so objects have ETags and the S3 calls below apply)."""
    return "s3" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def listing(fs: fsspec.AbstractFileSystem, root: str, prefix: bool) -> tuple[Iterator[Listed], bool]:
    """Every object under ``root`` (a prefix or folder), or ``root`` itself; and whether it was one object.

    The ETag and size come from the listing itself, so no object is asked about one by one. An S3 prefix's
    objects come in the store's order as each page of its listing arrives (:func:`listed_as_they_come`); a
    missing one raises FileNotFoundError as it is read.
    """
    if not prefix:
        info = fs.info(root)
        if info.get("type") != "directory":
            return iter([Listed(root, int(info.get("size") or 0), plain_etag(info.get("ETag")))]), True
    if is_s3(fs):
        return listed_as_they_come(fs, root), False
    found = fs.find(root, detail=True)
    if not found and not fs.exists(root):
        raise FileNotFoundError(root)
    objects = [Listed(path, int(info.get("size") or 0), plain_etag(info.get("ETag")))
               for path, info in found.items() if info.get("type") != "directory"]
    return iter(sorted(objects, key=lambda o: o.path)), False


def listed_as_they_come(fs: Any, root: str) -> Iterator[Listed]:
    """The objects under the S3 prefix ``root``, each as soon as the page naming it arrived: the store lists the
    next page while the caller works on this one (a cached re-stage links one page's files meanwhile). The keys
    of folder placeholders (ending in ``/``) are no objects to stage and are left out. FileNotFoundError where
    nothing is under ``root`` and it is no folder either."""
    bucket, key, _ = fs.split_path(root)
    arrived: queue.SimpleQueue[Any] = queue.SimpleQueue()
    done = object()

    async def list_pages() -> None:
        try:
            async for info in fs._iterdir(bucket, delimiter="", prefix=f"{key.rstrip('/')}/" if key else ""):
                arrived.put(info)
        except BaseException as exc:  # noqa: BLE001 -- raised in the reader's thread, below
            arrived.put(exc)
        finally:
            arrived.put(done)

    listing_task = asyncio.run_coroutine_threadsafe(list_pages(), fs.loop)
    found = 0
    try:
        while (info := arrived.get()) is not done:
            if isinstance(info, BaseException):
                raise info
            if not info["name"].endswith("/"):
                found += 1
                yield Listed(info["name"], int(info.get("size") or 0), plain_etag(info.get("ETag")))
    finally:
        listing_task.cancel()  # a reader that stopped early (a failure) asks for no more pages
    if not found and not fs.exists(root):
        raise FileNotFoundError(root)


def etag_is_md5(response: dict[str, Any]) -> bool:
    """Whether an S3 response's ETag can be an MD5 of the bytes: not with SSE-KMS or SSE-C encryption."""
    return not (str(response.get("ServerSideEncryption", "")).startswith("aws:kms")
                or response.get("SSECustomerAlgorithm"))


def get_object(fs: Any, obj: Listed, dest: Path, on_bytes: Callable[[int], None]) -> str | None:
    """Download one S3 object to ``dest``; returns its MD5 when it was computed on the way (small objects),
    or :data:`~e31_prefect.data.cache.ETAG_NOT_MD5` when the store says its ETag is no MD5.

    The GET carries the listed ETag (If-Match), so an object replaced since it was listed fails
    instead of mixing two versions.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    bucket, key, version = fs.split_path(obj.path)
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, **fs.req_kw}
    if version:
        kwargs["VersionId"] = version
    if obj.etag:
        kwargs["IfMatch"] = f'"{obj.etag}"'
    if obj.size >= RANGED_MIN_BYTES:
        return sync(fs.loop, _get_ranged, fs, kwargs, obj.size, dest, on_bytes)
    return sync(fs.loop, _get_whole, fs, kwargs, dest, bool(etag_md5(obj.etag)), on_bytes)


async def _get_whole(fs: Any, kwargs: dict[str, Any], dest: Path, hash_it: bool,
                     on_bytes: Callable[[int], None]) -> str | None:
    response = await fs._call_s3("get_object", **kwargs)
    body = response["Body"]
    if not etag_is_md5(response):
        hash_it = False
    digest = hashlib.md5() if hash_it else None
    try:
        with dest.open("wb") as out:
            while chunk := await body.read(CHUNK_BYTES):
                out.write(chunk)
                if digest:
                    digest.update(chunk)
                on_bytes(len(chunk))
    finally:
        body.close()
    return digest.hexdigest() if digest else (None if etag_is_md5(response) else ETAG_NOT_MD5)


async def _get_ranged(fs: Any, kwargs: dict[str, Any], size: int, dest: Path,
                      on_bytes: Callable[[int], None]) -> str | None:
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    gate = asyncio.Semaphore(PARTS_AT_ONCE)
    plain = True

    async def part(start: int, end: int) -> None:
        nonlocal plain
        async with gate:
            response = await fs._call_s3("get_object", Range=f"bytes={start}-{end}", **kwargs)
            plain = plain and etag_is_md5(response)
            body, at = response["Body"], start
            try:
                while chunk := await body.read(CHUNK_BYTES):
                    os.pwrite(fd, chunk, at)
                    at += len(chunk)
                    on_bytes(len(chunk))
            finally:
                body.close()
            if at != end + 1:
                raise OSError(f"bytes {start}-{end}: the part ended after {at - start} bytes")

    try:
        os.ftruncate(fd, size)
        await asyncio.gather(*(part(start, min(start + PART_BYTES, size) - 1)
                               for start in range(0, size, PART_BYTES)))
    finally:
        os.close(fd)
    return None if plain else ETAG_NOT_MD5


class NotOwnFile(OSError):
    """An output changed into something that is not the job's own bytes (a link, a special file) after it
    was listed; it is not sent."""


class LinkInDestination(OSError):
    """A folder or file on the way to a local destination is a symbolic link; nothing is written through it."""


@contextmanager
def open_own(local: Path, *, one_name: bool = True, was: str = "listed", then: str = "sent") -> Iterator[int]:
    """A read descriptor of ``local``, only if it is still a regular file (with one name, unless
    ``one_name`` is False).

    Opened without following a final link and checked on the open descriptor, so what is read is
    what the walk decided (it was ``was``), even if the path changed since; else :class:`NotOwnFile`
    saying it is not ``then``. Outputs refuse a second name (a hard link to a file the job does not own).
    """
    try:
        fd = os.open(local, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotOwnFile(f"{local}: became a symbolic link after it was {was}; not {then}") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or (one_name and info.st_nlink > 1):
            kind = "a regular file with one name" if one_name else "a regular file"
            raise NotOwnFile(f"{local}: is no longer {kind}; not {then}")
        yield fd
    finally:
        os.close(fd)


def put_file(fs: Any, local: Path, remote: str) -> None:
    """Send one file and check it arrived whole: its size, and its MD5 where the store gives one.

    Small files to S3 go in one PUT with a Content-MD5 header, so the store checks the bytes
    itself; larger ones are sent by s3fs (multipart) and then compared with the store's listing.
    A local destination is written by :func:`put_local`.
    """
    with open_own(local) as fd:
        size = os.fstat(fd).st_size
        if not is_s3(fs):
            if is_local(fs):
                stored = put_local(fd, remote)
            else:
                fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
                with os.fdopen(os.dup(fd), "rb") as source, fs.open(remote, "wb") as out:
                    shutil.copyfileobj(source, out, CHUNK_BYTES)
                fs.invalidate_cache(remote)
                stored = int(fs.info(remote).get("size") or 0)
            if stored != size:
                raise OSError(f"{remote}: has {stored} bytes after sending, the file has {size}")
            return
        if size <= SINGLE_PUT_MAX_BYTES:
            with os.fdopen(os.dup(fd), "rb") as source:
                data = source.read()
            digest = hashlib.md5(data)
            bucket, key, _ = fs.split_path(remote)
            # The store refuses a body whose MD5 is not the Content-MD5 sent with it: nothing more to compare.
            sync(fs.loop, fs._call_s3, "put_object", Bucket=bucket, Key=key, Body=data,
                 ContentMD5=base64.b64encode(digest.digest()).decode(), **fs.req_kw)
            return
        # s3fs opens a path: the descriptor's own path (Linux) is the very file checked above.
        by_fd = f"/proc/self/fd/{fd}"
        source = by_fd if os.path.exists(by_fd) else str(local)
        content_type = mimetypes.guess_type(local.name)[0]
        fs.put_file(source, remote, **({"ContentType": content_type} if content_type else {}))
        fs.invalidate_cache(remote)
        bucket, key, _ = fs.split_path(remote)
        head = sync(fs.loop, fs._call_s3, "head_object", Bucket=bucket, Key=key, **fs.req_kw)
        stored, md5 = int(head.get("ContentLength") or 0), etag_md5(head.get("ETag")) if etag_is_md5(head) else None
        if stored != size:
            raise OSError(f"{remote}: has {stored} bytes after sending, the file has {size}")
        if md5 and md5 != file_digest(Path(source)):
            raise OSError(f"{remote}: the store's ETag {md5} is not the file's MD5; sent bytes were damaged")


def get_local(path: str, dest: Path) -> int:
    """Copy the local file ``path`` to ``dest``, only if it is a regular file (not a link, fifo or device).

    Opened without following a final link and checked on the open descriptor, so a path changed
    after it was planned cannot turn the copy into a read of something else. Returns the bytes copied.
    """
    with open_own(Path(path), one_name=False, was="planned", then="staged") as fd:
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            _copy(fd, out)
            return os.fstat(out).st_size
        finally:
            os.close(out)


def is_local(fs: Any) -> bool:
    """Whether ``fs`` is fsspec's local filesystem (``file://``)."""
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


# A folder opened only to walk through it (O_PATH: a folder one may enter but not list still opens).
_FOLDER = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY


def put_local(source_fd: int, remote: str) -> int:
    """Copy the open file ``source_fd`` to the absolute local path ``remote``, never through a link; returns
    the bytes the copy holds.

    Each folder from ``/`` down is created if missing and opened relative to the one above with
    ``O_NOFOLLOW``, and the file itself too: a symbolic link anywhere on the way (put there before or
    during the send) fails with :class:`LinkInDestination` instead of carrying the bytes elsewhere.
    Give the destination as its real path (``realpath``), as e31 records it.
    """
    parts = PurePosixPath(os.path.normpath(remote)).parts
    if len(parts) < 2 or parts[0] != "/":
        raise OSError(f"{remote}: a local destination must be an absolute path")
    folder = os.open("/", _FOLDER)
    try:
        for depth, name in enumerate(parts[1:-1], start=1):
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o777, dir_fd=folder)
            try:
                inner = os.open(name, _FOLDER | os.O_NOFOLLOW, dir_fd=folder)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise LinkInDestination(_link_refusal(remote, "/".join(parts[: depth + 1])[1:])) from None
                raise
            os.close(folder)
            folder = inner
        try:
            out = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666, dir_fd=folder)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise LinkInDestination(_link_refusal(remote, remote)) from None
            raise
        try:
            _copy(source_fd, out)
            return os.fstat(out).st_size
        finally:
            os.close(out)
    finally:
        os.close(folder)


def _copy(source: int, out: int) -> None:
    """Copy a whole file between descriptors: in the kernel where it can, else through a buffer."""
    offset = 0
    try:
        while sent := os.sendfile(out, source, offset, 64 << 20):
            offset += sent
        return
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) or offset:
            raise
    os.lseek(source, 0, os.SEEK_SET)
    while chunk := os.read(source, CHUNK_BYTES):
        view = memoryview(chunk)
        while view:
            view = view[os.write(out, view):]


def _link_refusal(remote: str, link: str) -> str:
    return (f"{remote}: {link} is a symbolic link (or not a folder); e31 writes a local destination only through "
            "real folders, so outputs cannot be carried elsewhere on the host. Remove the link, or send the "
            "outputs to another folder")


_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                "InvalidClientTokenId", "AuthorizationHeaderMalformed"}
_DENIED = {"AccessDenied", "AllAccessDisabled", "AccountProblem", "Forbidden"}


def error_code(exc: BaseException) -> str | None:
    """The store's error code (``NoSuchBucket``, ``AccessDenied`` ...) behind an s3fs exception."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code"):
            return str(response["Error"]["Code"])
        current = current.__cause__ or current.__context__
    return None


def explain(url: str, exc: BaseException, fs: Any | None = None, reading: bool = True) -> str:
    """What went wrong with ``url``, in plain words, and what to do: for a user, not a traceback."""
    code = error_code(exc) or ""
    if code in ("403", "Forbidden", "400", "BadRequest") and fs is not None:
        # A HEAD's refusal has no body to say why; a listing of the same key does.
        code = _probe(fs, url) or code
    name = type(exc).__name__
    access = "read" if reading else "write"
    if code in _CREDENTIALS or name in ("NoCredentialsError", "PartialCredentialsError"):
        return (f"{url}: the store refused the credentials ({code or name}: {_message(exc)}); check the access "
                "key and secret of the job's storage block (or the AWS_* credentials on the worker)")
    if code in _DENIED or (isinstance(exc, PermissionError) and not code):
        return (f"{url}: access denied ({code or name}): these credentials may not {access} it; grant them "
                f"access (s3:{'GetObject and s3:ListBucket' if reading else 'PutObject'}) or use a storage "
                "block whose credentials have it")
    if code == "NoSuchBucket" or (isinstance(exc, FileNotFoundError) and _bucket_missing(fs, url)):
        bucket = url.split("://", 1)[-1].split("/", 1)[0]
        return f"{url}: the bucket {bucket!r} does not exist; check the bucket name in the URL, or create it"
    if isinstance(exc, FileNotFoundError) or code in ("NoSuchKey", "404"):
        return f"{url}: not found: no object or prefix has this key; check the URL"
    if code == "PreconditionFailed":
        return f"{url}: the object changed while it was being staged; run the job again"
    if name == "CacheCorrupt" or isinstance(exc, (LinkInDestination, NotOwnFile)):
        return f"{url}: {exc}"
    if "EndpointConnectionError" in name or "ConnectionError" in name or isinstance(exc, ConnectionError):
        return f"{url}: the store does not answer ({_message(exc)}); check its endpoint URL and that it is up"
    return f"{url}: {name}: {_message(exc)}"


def _message(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__).splitlines()[0]


def _probe(fs: Any, url: str) -> str | None:
    if not is_s3(fs):
        return None
    bucket, _, key = url.split("://", 1)[-1].partition("/")
    try:
        sync(fs.loop, fs._call_s3, "list_objects_v2", Bucket=bucket, Prefix=key, MaxKeys=1)
    except Exception as exc:
        return error_code(exc)
    return None


def _bucket_missing(fs: Any | None, url: str) -> bool:
    if fs is None or not is_s3(fs):
        return False
    bucket = url.split("://", 1)[-1].split("/", 1)[0]
    try:
        fs.invalidate_cache(bucket)
        sync(fs.loop, fs._call_s3, "head_bucket", Bucket=bucket)
    except FileNotFoundError:
        return True
    except Exception:
        return False
    return False
