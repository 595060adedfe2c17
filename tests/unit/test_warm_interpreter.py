"""The warm interpreter's wire and its processes' titles.

Its forks themselves, with a worker as root: tests/integration/test_warm_interpreter.py.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from e31_prefect.host import warm_requests
from e31_prefect.host.warm_requests import Lines


def test_messages_split_across_reads_or_sent_together_come_one_at_a_time_with_their_descriptors():
    ours, theirs = socket.socketpair()
    read, write = os.pipe()
    try:
        socket.send_fds(theirs, [b'{"pid": 12'], [read])
        theirs.sendall(b'3}\n{"exit": 0}\n')
        lines = Lines(ours)
        assert lines.next() == {"pid": 123}
        assert len(lines.fds) == 1 and os.path.sameopenfile(lines.fds[0], read)
        assert lines.next() == {"exit": 0}
        theirs.close()
        assert lines.next() is None  # the launcher is gone
    finally:
        for fd in (read, write, *lines.fds):
            os.close(fd)
        ours.close()


@pytest.mark.parametrize("sent", [b"[1, 2]\n", b'"a word"\n'])
def test_a_message_that_is_no_object_is_refused(sent):
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(sent)
        with pytest.raises(ValueError, match="no JSON object"):
            Lines(ours).next()


def test_a_message_past_the_bound_is_refused_before_it_is_all_read(monkeypatch):
    monkeypatch.setattr(warm_requests, "REQUEST_BYTES", 50_000)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.setblocking(False)
        ours.settimeout(10)
        with contextlib.suppress(BlockingIOError):
            theirs.send(b"x" * 300_000)  # no line end: as much as the socket takes
        with pytest.raises(ValueError, match="over 50000 bytes"):
            Lines(ours).next()


def shown_after_retitle(words: list[str], folder: Path) -> tuple[bytes, bytes]:
    """A forked child's command line once it retitled itself as ``words``, and this process's own."""
    child = os.fork()
    if child == 0:  # pragma: no cover - the child ends in os._exit
        code = 1
        try:
            warm_requests.retitle(words)
            (folder / "done").write_text("")
            time.sleep(30)
            code = 0
        finally:
            os._exit(code)
    try:
        deadline = time.monotonic() + 30
        while not (folder / "done").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return Path(f"/proc/{child}/cmdline").read_bytes(), Path(f"/proc/{os.getpid()}/cmdline").read_bytes()
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)


def test_a_retitled_process_shows_its_new_words_and_nothing_of_its_old_ones(tmp_path: Path):
    before = Path(f"/proc/{os.getpid()}/cmdline").read_bytes()
    shown, after = shown_after_retitle(["e31-launcher", "run-1"], tmp_path)
    assert shown.rstrip(b"\0").split(b"\0") == [b"e31-launcher", b"run-1"]
    assert len(shown) == len(before)  # the arguments' memory, padded; the parent's own is untouched
    assert after == before
    assert not set(before.split(b"\0")[1:]) & set(shown.split(b"\0")) - {b""}


def test_a_title_longer_than_the_arguments_is_cut_to_them(tmp_path: Path):
    shown, before = shown_after_retitle(["y" * 100_000], tmp_path)
    assert len(shown) == len(before) and shown.startswith(b"y" * (len(before) - 1))


def test_a_request_goes_whole_with_its_descriptors_however_large_its_environment():
    ours, theirs = socket.socketpair()
    read, write = os.pipe()
    request = warm_requests.Request(env={"BIG": "v" * 200_000, "PATH": "/usr/bin"}, cwd="/w", uid=61000,
                                       cgroup_files=["/sys/fs/cgroup/e31/run-1/cgroup.procs"], namespaces=[1, 2])
    try:
        sender = threading.Thread(target=warm_requests.send_request, args=(theirs, request, read, [write]))
        sender.start()
        lines = Lines(ours)
        assert warm_requests.Request(**lines.next()) == request
        sender.join()
        assert len(lines.fds) == 2
    finally:
        for fd in (read, write, *lines.fds):
            os.close(fd)
        ours.close()
        theirs.close()
