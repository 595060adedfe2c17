"""A host's heartbeat in Prefect, and the fence lease it keeps a cut-off run's work to.

Each host has one Prefect variable, ``e31_host_<hash of its name>`` (tagged ``e31-host``), that says when
something of it last reached the API: its workers write it, and so does each run's supervisor, with the
credentials it already holds for its run's gateway. Any worker of the pool reads them all in one call and
judges a host silent for ``E31_HOST_LOST_SECONDS`` lost (:mod:`e31_prefect.model.attempts`).

A supervisor's :class:`Beating` thread writes the heartbeat and, each time the API took one, extends the run's
fence lease (``fence.json`` in its ledger folder) to that heartbeat plus the fence time; the host's workers
say when the API last took theirs in ``$E31_HOME/heartbeat.json``, which extends every lease of the host the
same way (the pool judges a host by all its heartbeats: so does its fence). The run's fence keeper
(:mod:`e31_prefect.host.fence`) stops the work once the lease runs out, whether or not the supervisor itself
still runs: a host cut off from the API, or whose e31 processes are stopped, never runs an attempt the pool
has requeued elsewhere. A lease that ran out is never extended again.

Only the standard library: it runs in the supervisor.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import sys
import threading
from collections.abc import Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from e31_prefect.host.ledger import moment, now, write_json

HOST_TAG = "e31-host"
LEASE_FILE = "fence.json"
FENCED_FILE = "fenced.json"
HOST_BEAT_FILE = "heartbeat.json"  # in E31_HOME: when the API last took a heartbeat of one of the host's workers
WRITE_TIMEOUT_SECONDS = 10.0


def host_variable(host: str) -> str:
    """The Prefect variable a host's heartbeat is kept in (names allow only [a-z0-9_-])."""
    return "e31_host_" + hashlib.sha256(host.encode()).hexdigest()[:24]


def beat_value(host: str, at: datetime, lost_seconds: float) -> dict[str, Any]:
    """A heartbeat as written: the host, when, and the lost time its supervisors fence by."""
    return {"host": host, "at": at.isoformat(), "lost_seconds": lost_seconds}


class ApiVariables:
    """Writes one Prefect variable over plain HTTP, with the worker's credentials for the API."""

    def __init__(self, upstream: str, headers: Mapping[str, str], timeout: float = WRITE_TIMEOUT_SECONDS):
        split = urlsplit(upstream)
        self.https = split.scheme == "https"
        self.host, self.port = split.hostname or "127.0.0.1", split.port or (443 if self.https else 80)
        self.base = split.path.rstrip("/")
        self.headers = {**headers, "Content-Type": "application/json"}
        self.timeout = timeout
        self._connection: http.client.HTTPConnection | None = None
        self.why: str | None = None  # why the last write did not reach the API

    def _call(self, method: str, path: str, body: dict[str, Any]) -> int:
        for attempt in (1, 2):
            if self._connection is None:
                kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
                self._connection = kind(self.host, self.port, timeout=self.timeout)
            try:
                self._connection.request(method, self.base + path, body=json.dumps(body).encode(),
                                         headers=self.headers)
                response = self._connection.getresponse()
                response.read()
                return response.status
            except (OSError, http.client.HTTPException):
                self._connection.close()
                self._connection = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def put(self, name: str, value: Any, tags: list[str]) -> bool:
        """Set the variable (made the first time); True once the API took it. Why not, in :attr:`why`."""
        try:
            status = self._call("PATCH", f"/variables/name/{quote(name)}", {"value": value})
            if status == 404:
                status = self._call("POST", "/variables/", {"name": name, "value": value, "tags": tags})
                if status == 409:  # another writer made it first
                    status = self._call("PATCH", f"/variables/name/{quote(name)}", {"value": value})
        except (OSError, http.client.HTTPException) as exc:
            self.why = f"{type(exc).__name__}: {exc}"
            return False
        self.why = None if 200 <= status < 300 else f"HTTP {status}"
        return self.why is None


def read_lease(folder: Path) -> tuple[datetime | None, datetime | None]:
    """The run's fence lease: until when its work may run, and when its supervisor last reached the API."""
    try:
        data = json.loads((folder / LEASE_FILE).read_text())
        return moment(data.get("until")), moment(data.get("reached"))
    except (OSError, ValueError, AttributeError):
        return None, None


def write_lease(folder: Path, until: datetime, reached: datetime | None) -> None:
    """Give the run's work until ``until``; ``reached``: the heartbeat the API last took."""
    write_json(folder / LEASE_FILE, {"until": until.isoformat(), "reached": reached.isoformat() if reached else None})


def write_host_reached(home: Path, at: datetime) -> None:
    """A worker's heartbeat reached the API at ``at`` (every run's fence on the host is extended by it)."""
    write_json(home / HOST_BEAT_FILE, {"reached": at.isoformat()})


def host_reached(path: Path | None) -> datetime | None:
    """When the API last took a heartbeat of the host's workers (None: never, or unknown)."""
    if path is None:
        return None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return moment(json.loads(path.read_text()).get("reached"))
    return None


def lease_end(own: datetime | None, host_file: Path | None, fence: timedelta) -> datetime | None:
    """Until when a run's work may go on: its own lease, or a fence time past its host workers' last heartbeat,
    whichever is later."""
    reached = host_reached(host_file)
    others = reached + fence if reached is not None else None
    return max(own, others) if own is not None and others is not None else own or others


def fenced_at(folder: Path) -> datetime | None:
    """When the run's fence keeper stopped its work (None: it did not)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return moment(json.loads((folder / FENCED_FILE).read_text()).get("at"))
    return None


class Beating(threading.Thread):
    """A supervisor's heartbeats: the host's variable every ``every`` seconds, and the run's fence lease
    extended to each one the API took plus ``fence`` seconds, for as long as the lease never ran out."""

    def __init__(self, folder: Path, api: ApiVariables, host: str, lost_seconds: float, every: float, fence: float,
                 host_file: Path | None = None):
        super().__init__(daemon=True, name="e31-heartbeat")
        self.folder = folder
        self.host_file = host_file  # the host's workers' last heartbeat (E31_HOME/heartbeat.json)
        self._out = False  # the lease ran out once: it stays out
        self.api = api
        self.host = host
        self.lost_seconds = lost_seconds
        self.every = every
        self.fence = timedelta(seconds=fence)
        self.started_at = now()
        self.until = self.started_at + self.fence
        self.reached: datetime | None = None
        self.stop = threading.Event()
        write_lease(folder, self.until, None)

    def expired(self, at: datetime | None = None) -> bool:
        """Whether the lease ran out (its own, and the host's workers'): the work must stop, and stays stopped."""
        if not self._out:
            end = lease_end(self.until, self.host_file, self.fence)
            self._out = end is not None and (at or now()) >= end
        return self._out

    def workers_heard(self, at: datetime) -> datetime | None:
        """When a heartbeat of the host's workers reached the API, where that was within the last two beats
        before ``at`` (the worker beats every beat, plus the time its watch takes); else None."""
        heard = host_reached(self.host_file)
        return heard if heard is not None and timedelta(0) <= at - heard < timedelta(seconds=2 * self.every) else None

    def run(self) -> None:
        said: str | None = None
        while not self.stop.is_set():
            at = now()
            if self.expired(at):
                return  # never extended again: the keeper and the supervisor stop the work
            if (heard := self.workers_heard(at)) is not None:
                # While the host's worker beats, a beat of the supervisor's own would say nothing more (one API
                # call a run saved, and one a beat for each running job): the lease runs from the worker's, and
                # records it as the last heartbeat this run knew of (what a lost attempt is billed to).
                self.reached, self.until = heard, max(self.until, heard + self.fence)
                with contextlib.suppress(OSError):
                    write_lease(self.folder, self.until, self.reached)
                self.stop.wait(self.every)
                continue
            if self.api.put(host_variable(self.host), beat_value(self.host, at, self.lost_seconds), [HOST_TAG]) \
                    and not self.expired(at):
                self.reached, self.until = at, at + self.fence
                with contextlib.suppress(OSError):
                    write_lease(self.folder, self.until, self.reached)
            if self.api.why != said:  # in the supervisor's log, once per change
                said = self.api.why
                print(f"{at.isoformat()} heartbeat: {said or 'reaches the Prefect API again'}", file=sys.stderr,
                      flush=True)
            self.stop.wait(self.every)
