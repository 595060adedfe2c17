"""A run's supervisor beats for its host only while the host's workers do not: the same heartbeat twice is an API
call a run (and one a beat for each running job) that says nothing more; the lease still runs from the last
heartbeat of the host that reached the API, and a silent worker leaves the supervisor beating on its own."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

from e31_prefect.host.heartbeat import Beating, host_variable, read_lease, write_host_reached
from e31_prefect.host.ledger import now

EVERY = 0.2


class CountingApi:
    """The API's variables as a supervisor writes them: each write counted, each taken."""

    def __init__(self) -> None:
        self.puts: list[str] = []
        self.why: str | None = None
        self.wrote = threading.Event()

    def put(self, name: str, value: object, tags: list[str]) -> bool:
        self.puts.append(name)
        self.wrote.set()
        return True


def beating(tmp_path: Path, api: CountingApi) -> Beating:
    folder = tmp_path / "run"
    folder.mkdir()
    return Beating(folder, api, "host-a", 60.0, EVERY, 45.0, tmp_path / "heartbeat.json")


def beat_once(beats: Beating, api: CountingApi) -> None:
    """Start the supervisor's heartbeats, wait for its first write to the API, and stop them."""
    beats.start()
    try:
        assert api.wrote.wait(30), "the supervisor never beat for its host"
    finally:
        beats.stop.set()
        beats.join()


def test_while_the_hosts_worker_beats_its_supervisor_adds_no_call_and_keeps_the_workers_beat(tmp_path):
    api = CountingApi()
    beats = beating(tmp_path, api)
    heard = now()
    write_host_reached(tmp_path, heard)
    beats.start()
    try:
        # Its first look: the worker's beat is fresh, so the lease records it and nothing is written.
        while read_lease(beats.folder)[1] is None:
            assert beats.is_alive()
            beats.stop.wait(0.01)
    finally:
        beats.stop.set()
        beats.join()
    assert api.puts == []
    until, reached = read_lease(beats.folder)
    assert reached == heard and until == heard + timedelta(seconds=45.0)


def test_a_silent_worker_leaves_the_supervisor_beating_on_its_own(tmp_path):
    api = CountingApi()
    beats = beating(tmp_path, api)
    write_host_reached(tmp_path, now() - timedelta(seconds=10 * EVERY))  # its worker's last beat: long ago
    beat_once(beats, api)
    assert api.puts[0] == host_variable("host-a")
    assert read_lease(beats.folder)[1] is not None


def test_with_no_worker_heartbeat_on_the_host_the_supervisor_beats_at_once(tmp_path):
    api = CountingApi()
    beats = beating(tmp_path, api)  # no heartbeat.json: `e31 run`, or a host whose worker never beat
    beat_once(beats, api)
