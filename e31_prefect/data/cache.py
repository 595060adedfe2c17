"""The host's content cache: an object staged once is linked, not downloaded, the next time.

    E31_CACHE_BYTES=200g prefect worker start --pool gpu --type e31

Entries are keyed on what the store says about an object's content (its ETag
and size), so a nightly job re-reading an unchanged data set downloads nothing.
An entry is hard-linked into a run's workspace (copied when the cache and the
workspace are on different filesystems). The cache keeps to a size bound by
evicting the least recently used entries, never one that a running job holds
(it is linked into a workspace) or that is being linked or filled right now.

Two jobs, in threads or in separate worker processes on the host, that need the
same object at once download it once: a file lock per key prefix (``fcntl.flock``,
which also separates threads of one process) lets one fill the entry while the
other waits, then links it. Only verified bytes enter the cache: the filler
checks the size and, where the ETag is a plain MD5, the MD5 before the entry
appears (by an atomic rename), so a bad download never becomes an entry.

No job changes what a later job stages. Entries are read-only, but a job
running as the worker's user can make its linked copy writable again and
write through it. So what was verified is recorded beside the entry (its
size, modification time and change time: the change time moves with every
write or ``chmod`` and no user can set it back) and checked on every hit;
an entry that changed is evicted, said in the log, and fetched again. The
cache's own link, unlink and use of an entry move its change time too, so
each records the new one under the entry's lock; a workspace is removed
through :meth:`ContentCache.release` for the same reason.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

LOCK_PREFIX = 3  # hex digits of the key that name its lock
RECORD_BYTES = 128  # a verification record's length: each is rewritten whole, in place
_MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")
_MULTIPART_ETAG = re.compile(r"^[0-9a-f]{32}-\d+$")

logger = logging.getLogger("e31.cache")


def plain_etag(etag: str | None) -> str | None:
    """The ETag without quotes and in lower case; None when the store gave none."""
    if not etag:
        return None
    return etag.strip().strip('"').lower() or None


def etag_md5(etag: str | None) -> str | None:
    """The object's MD5 when its ETag is one (a single-part upload); None for multipart or opaque ETags."""
    value = plain_etag(etag)
    return value if value and _MD5_ETAG.match(value) else None


def cache_key(etag: str, size: int, url: str) -> str:
    """The cache key of an object: its ETag and size.

    S3's ETags are MD5-based (plain, or ``md5-parts`` for multipart uploads), so the same ETag and
    size mean the same bytes wherever the object lives, and two buckets holding one data set share
    entries. A store whose ETags are not MD5-based (opaque version tags) gets the URL in the key too,
    so two of its objects can never be taken for each other.
    """
    value = plain_etag(etag) or ""
    content_addressed = bool(_MD5_ETAG.match(value) or _MULTIPART_ETAG.match(value))
    identity = f"{value}:{size}" if content_addressed else f"{value}:{size}:{url}"
    return hashlib.sha256(identity.encode()).hexdigest()[:40]


@dataclass(frozen=True)
class Entry:
    """What eviction needs to know about one cache entry."""

    key: str
    size: int
    last_used: float
    in_use: bool


def plan_eviction(entries: list[Entry], bound: int) -> list[str]:
    """Keys to evict, least recently used first, until the entries fit ``bound`` bytes.

    Entries in use (linked into a running job's workspace, or being linked or filled) are never
    chosen: removing them would free nothing, or pull bytes from under a job. The cache may so
    stay above its bound until those jobs end.
    """
    total = sum(e.size for e in entries)
    victims = []
    for entry in sorted(entries, key=lambda e: (e.last_used, e.key)):
        if total <= bound:
            break
        if entry.in_use:
            continue
        victims.append(entry.key)
        total -= entry.size
    return victims


@dataclass(frozen=True)
class Verified:
    """What the cache verified of an entry's file when it last wrote or linked it: a later hit must find the same.

    The change time (``st_ctime_ns``) is the one a job cannot forge: any write, ``chmod`` or ``utime``
    moves it, and no call sets it back.
    """

    key: str
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, key: str, info: os.stat_result) -> Verified:
        """The record of ``key``'s file as ``info`` (its ``stat``) shows it."""
        return cls(key, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def changed_since_verified(record: Verified | None, key: str, info: os.stat_result) -> str | None:
    """How the entry ``key`` (whose ``stat`` is ``info``) differs from what was verified; None where it does not."""
    if record is None or record.key != key:
        return "no record of it being verified"
    now = Verified.of(key, info)
    differences = [f"{name} {getattr(record, name)} -> {getattr(now, name)}"
                   for name in ("size", "mtime_ns", "ctime_ns") if getattr(record, name) != getattr(now, name)]
    return ("changed since it was verified (" + ", ".join(differences) + ")") if differences else None


class CacheCorrupt(RuntimeError):
    """A download did not match what the store said about the object; it never entered the cache."""


@dataclass
class CacheCounters:
    """What one staging took from the cache and what it downloaded."""

    hits: int = 0
    hit_bytes: int = 0
    downloads: int = 0
    downloaded_bytes: int = 0
    changed: list[str] = field(default_factory=list)  # keys evicted because their bytes changed


class ContentCache:
    """A folder of verified objects keyed by (ETag, size), bounded, shared by every worker on the host."""

    def __init__(self, root: Path, bound_bytes: int):
        self.root = root
        self.bound_bytes = bound_bytes
        self.objects = root / "objects"
        self.locks = root / "locks"
        self.incoming = root / "incoming"
        self.verified = root / "verified"  # one record per entry, named by its file (device and inode)
        # Closed to jobs (:mod:`e31_prefect.host.home_files`): a job reads its own inputs through its links only.
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for folder in (self.objects, self.locks, self.incoming, self.verified):
            folder.mkdir(parents=True, exist_ok=True)
        # The paths made on every hit, joined as strings: on a re-stage linking thousands of files, pathlib's
        # joins took longer than the system calls themselves.
        self._objects, self._locks, self._verified = str(self.objects), str(self.locks), str(self.verified)
        self.counters = CacheCounters()
        self._counting = threading.Lock()

    def _lock_file(self, key: str) -> str:
        # One lock per key prefix (4,096 of them), made once per host: creating a lock file per
        # object would cost as much as the object's own file. Two objects sharing a prefix only
        # wait for each other while one of them is being filled.
        return f"{self._locks}/{key[:LOCK_PREFIX]}"

    @contextlib.contextmanager
    def _locked(self, key: str, exclusive: bool) -> Iterator[None]:
        # flock locks belong to an open file description, so two threads of one process that each
        # open the lock file exclude each other exactly as two processes do.
        fd = os.open(self._lock_file(key), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _count(self, hit: bool, size: int) -> None:
        with self._counting:
            if hit:
                self.counters.hits += 1
                self.counters.hit_bytes += size
            else:
                self.counters.downloads += 1
                self.counters.downloaded_bytes += size

    def provide(self, key: str, size: int, target: Path, fill: Callable[[Path], str | None],
                md5: str | None = None) -> bool:
        """Put the object ``key`` at ``target``: linked from the cache, or downloaded by ``fill`` first.

        ``fill(path)`` writes the object to ``path`` and returns the MD5 of what it wrote if it
        computed one on the way (else None, and the file is read again when ``md5`` is given). The
        bytes are checked against ``size`` and ``md5`` before they become an entry. Returns True on
        a cache hit.
        """
        if self.take(key, size, target):
            return True
        with self._locked(key, exclusive=True):
            # Whoever held the lock before us may have filled it: then we only link.
            if self._link(key, size, target):
                self._count(True, size)
                return True
            incoming = self.incoming / f"{key}.{os.getpid()}.{threading.get_ident()}"
            try:
                check(incoming, size, md5, fill(incoming))
                incoming.chmod(0o444)
                if size > self.bound_bytes:
                    # Larger than the whole cache: staged, never kept.
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(incoming, target)
                else:
                    os.replace(incoming, self.objects / key)
                    self._record(key)  # what was just checked, as it now lies in the cache
                    if not self._link(key, size, target):
                        raise CacheCorrupt(f"cache entry {key} vanished while it was being linked")
            finally:
                with contextlib.suppress(FileNotFoundError):
                    incoming.unlink()
            self._count(False, size)
            return False

    def take(self, key: str, size: int, target: Path) -> bool:
        """Link the entry ``key`` at ``target`` if the cache holds it unchanged; False (nothing done) if not.

        Under the entry's lock: linking moves the entry's change time, and the new one is recorded
        before anyone else may look at it.
        """
        with self._locked(key, exclusive=True):
            linked = self._link(key, size, target)
        if linked:
            self._count(True, size)
        return linked

    def _link(self, key: str, size: int, target: Path) -> bool:
        """Link the entry at ``target`` if it is what was verified (else evict it); the caller holds its lock."""
        entry = f"{self._objects}/{key}"
        try:
            found = os.stat(entry)
        except FileNotFoundError:
            return False
        why = "is not the object's size" if found.st_size != size else \
            changed_since_verified(self._read_record(found), key, found)
        if why is not None:
            # Written through a workspace link, or left by an e31 that kept no record: not the object any more.
            self._evict(key, found, why)
            return False
        try:
            _place(entry, target)
        except FileNotFoundError:  # its folder is not there yet (the entry is: we hold its lock)
            target.parent.mkdir(parents=True, exist_ok=True)
            _place(entry, target)
        # Recorded anew (its link moved the entry's change time); the record's own mtime is the last use.
        after = self._record(key)
        if after is not None and (after.size, after.mtime_ns) != (found.st_size, found.st_mtime_ns):
            # Written to between the check and the link: neither the entry nor this link is trusted.
            self._evict(key, os.stat(entry), "changed while it was being linked")
            target.unlink(missing_ok=True)
            return False
        return True

    def release(self, path: Path) -> bool:
        """Remove ``path`` if it is a workspace's link to an entry, keeping the entry's record true.

        Unlinking moves the entry's change time, so a workspace removed without this would make the
        next hit fetch the object again. An entry found changed here is evicted. False where ``path``
        is no link to an entry (the caller removes it as any other file).
        """
        try:
            info = path.lstat()
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(info.st_mode) or info.st_nlink < 2:
            return False
        record = self._read_record(info)
        if record is None:
            return False
        with self._locked(record.key, exclusive=True):
            entry = self.objects / record.key
            try:
                found = entry.stat()
            except FileNotFoundError:
                return False
            if (found.st_dev, found.st_ino) != (info.st_dev, info.st_ino):
                return False
            why = changed_since_verified(self._read_record(found), record.key, found)
            path.unlink()
            if why is None:
                self._record(record.key)
            else:
                self._evict(record.key, found, why)
        return True

    def _record_path(self, info: os.stat_result) -> str:
        return f"{self._verified}/{info.st_dev}-{info.st_ino}"

    def _read_record(self, info: os.stat_result) -> Verified | None:
        try:
            fd = os.open(self._record_path(info), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            text = os.read(fd, RECORD_BYTES)
        finally:
            os.close(fd)
        try:
            key, size, mtime_ns, ctime_ns = text.decode().split()
            return Verified(key, int(size), int(mtime_ns), int(ctime_ns))
        except (UnicodeDecodeError, ValueError):
            return None  # torn by a worker killed mid-write: the entry is fetched again

    def _record(self, key: str) -> Verified | None:
        """Record the entry ``key`` as it is now (the caller holds its lock and knows its bytes are right).

        The record is rewritten in place at a fixed length: creating a file costs far more than the
        link it accompanies on some filesystems, and each hit writes one.
        """
        try:
            info = os.stat(f"{self._objects}/{key}")
        except FileNotFoundError:
            return None
        record = Verified.of(key, info)
        text = f"{key} {record.size} {record.mtime_ns} {record.ctime_ns}".ljust(RECORD_BYTES - 1) + "\n"
        fd = os.open(self._record_path(info), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, text.encode(), 0)
        finally:
            os.close(fd)
        return record

    def _evict(self, key: str, info: os.stat_result, why: str) -> None:
        """Drop an entry whose bytes are no longer those verified; the next stage fetches it again."""
        logger.warning("Cache entry %s %s: evicted, the object is fetched again", key, why)
        with self._counting:
            self.counters.changed.append(key)
        with contextlib.suppress(FileNotFoundError):
            if (self.objects / key).stat().st_ino == info.st_ino:
                (self.objects / key).unlink()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._record_path(info))

    def entries(self) -> list[Entry]:
        """Every entry, with its size, last use and whether a workspace holds it.

        The last use is when its record was last written (each link writes it): touching the entry
        itself would move its change time.
        """
        found = []
        for path in self.objects.iterdir():
            with contextlib.suppress(FileNotFoundError):
                info = path.stat()
                try:
                    used = os.stat(self._record_path(info)).st_mtime
                except FileNotFoundError:
                    used = info.st_mtime
                found.append(Entry(path.name, info.st_size, used, info.st_nlink > 1))
        return found

    @property
    def size(self) -> int:
        """Bytes the entries take."""
        return sum(e.size for e in self.entries())

    def trim(self) -> list[str]:
        """Evict least recently used entries until the cache fits its bound; returns the keys evicted."""
        evicted = []
        for key in plan_eviction(self.entries(), self.bound_bytes):
            fd = os.open(self._lock_file(key), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # being linked or filled right now
                entry = self.objects / key
                with contextlib.suppress(FileNotFoundError):
                    info = entry.stat()
                    if info.st_nlink == 1:
                        entry.unlink()
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(self._record_path(info))
                        evicted.append(key)
            finally:
                os.close(fd)
        self._sweep_incoming()
        return evicted

    def _sweep_incoming(self, older_than_s: float = 24 * 3600) -> None:
        # Partial downloads of a worker killed mid-fill; a day old is surely abandoned.
        cutoff = time.time() - older_than_s
        for path in self.incoming.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_mtime < cutoff:
                    path.unlink()


def _place(entry: str, target: Path) -> None:
    """A hard link to ``entry`` at ``target`` (replacing a file there), or a copy where no link can be made."""
    try:
        os.link(entry, target)
    except FileExistsError:
        target.unlink()
        os.link(entry, target)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EMLINK, errno.EPERM):
            raise
        shutil.copyfile(entry, target)  # another filesystem: a copy, still no download


# What a download returns instead of an MD5 when the store said the object's ETag is not its MD5
# (SSE-KMS or SSE-C encryption: the ETag looks like one but is not), so only its size can be checked.
ETAG_NOT_MD5 = "etag-not-md5"


def check(path: Path, size: int, md5: str | None, computed_md5: str | None = None) -> None:
    """Raise :class:`CacheCorrupt` unless the file has ``size`` bytes and, when ``md5`` is given, that MD5.

    ``computed_md5`` is the digest taken while the bytes arrived; without it the file is read again.
    :data:`ETAG_NOT_MD5` there means the store said the ETag is no MD5: the size alone is checked.
    """
    got = path.stat().st_size
    if got != size:
        raise CacheCorrupt(f"got {got} bytes of {size}; the transfer was cut short")
    if md5 and computed_md5 != ETAG_NOT_MD5 and (computed_md5 or file_digest(path)) != md5:
        raise CacheCorrupt(f"the MD5 of the bytes received differs from the object's ETag {md5}; "
                           "the data was corrupted in transit")


def file_digest(path: Path, algorithm: str = "md5") -> str:
    """The hex digest of a file (``md5``, ``sha256``...), read in 8 MiB blocks."""
    digest = hashlib.new(algorithm)
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
