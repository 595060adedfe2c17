"""What a worker and a run's supervisor ask of the host's warm interpreter (:mod:`e31_prefect.host.warm_interpreter`),
and how they hold what it forks: the worker's handle on the interpreter, the messages on its socket (JSON lines
with descriptors, bounded), a job's process or a run's supervisor forked, and the title a forked process takes.

Only the standard library: a run's supervisor uses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

INTERPRETER_MODULE = "e31_prefect.host.warm_interpreter"
REQUEST_BYTES = 4 * 2**20  # a request is a run's environment: bounded, like everything a socket brings
MAX_DESCRIPTORS = 8
ANSWER_SECONDS = 120.0  # the interpreter may still be loading Prefect (a new worker's first run)
EXIT_WORD_SECONDS = 5.0  # the launcher reaps the job's process and says how it exited at once


@dataclass
class Request:
    """What a run's supervisor asks the launcher to start: the job's entry, in the job's own world.

    ``namespaces`` are the flags of the namespace descriptors passed with the request, after the log's
    (the first the PID namespace the process is forked into, the others joined in order)."""

    env: dict[str, str]
    cwd: str | None
    uid: int | None
    cgroup_files: list[str] = field(default_factory=list)
    namespaces: list[int] = field(default_factory=list)


class WarmInterpreter:
    """A worker's warm interpreter, as the worker holds it: started at its first process run, stopped with
    the worker (and ended by the kernel if the worker dies). Runs it forked keep going without it."""

    def __init__(self, folder: Path, environment: dict[str, str]):
        self.folder = folder
        self.environment = environment
        self.path = folder / f"{os.getpid()}.sock"
        self.process: subprocess.Popen[bytes] | None = None

    def socket_path(self) -> Path:
        """Its socket, started (again, where it ended) if need be. The socket is bound here and inherited, so
        it takes connections at once: they wait in its backlog while the interpreter loads Prefect."""
        if self.process is None or self.process.poll() is not None:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            home = self.folder / "home"
            home.mkdir(mode=0o700, exist_ok=True)
            with bind(self.path) as listening, open(self.folder / "interpreter.log", "ab") as log:
                self.process = subprocess.Popen(
                    [sys.executable, "-s", "-P", "-m", INTERPRETER_MODULE, str(listening.fileno()), str(os.getpid())],
                    env={**self.environment, "HOME": str(home), "PREFECT_HOME": str(home / ".prefect")},
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd="/",
                    pass_fds=(listening.fileno(),),
                    start_new_session=True)  # a Ctrl-C to the worker's group is not its
        return self.path

    def stop(self) -> None:
        """End it (its launchers, and the runs they hold, go on)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def bind(path: Path) -> socket.socket:
    """The interpreter's listening socket at ``path``, bound by its worker, open to their user alone (reached
    by its folder's descriptor: a socket's path may be at most 107 bytes)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    folder = os.open(path.parent, os.O_PATH | os.O_CLOEXEC)
    old_mask = os.umask(0o177)
    try:
        listening.bind(f"/proc/self/fd/{folder}/{path.name}")
    finally:
        os.umask(old_mask)
        os.close(folder)
    listening.listen(128)
    return listening


def connect(path: Path, timeout: float) -> socket.socket:
    """A connection to the interpreter at ``path`` (OSError where none listens)."""
    folder = os.open(path.parent, os.O_PATH | os.O_CLOEXEC)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout)
        conn.connect(f"/proc/self/fd/{folder}/{path.name}")
    except OSError:
        conn.close()
        raise
    finally:
        os.close(folder)
    return conn


def send_request(conn: socket.socket, request: Request, log: int, namespaces: list[int]) -> None:
    """Send a run's request, its log and its namespaces' descriptors (the PID namespace's first)."""
    data = json.dumps(asdict(request)).encode() + b"\n"
    socket.send_fds(conn, [data[:65536]], [log, *namespaces])
    if len(data) > 65536:
        conn.sendall(data[65536:])


def fork_supervisor(path: Path, folder: str, control: int, log: int, api_socket: int | None) -> tuple[int, int]:
    """Ask the warm interpreter at ``path`` for a run's supervisor: the folder of its ledger, its control socket
    (its stdin), its log (its stderr) and the listening socket of its gateway (kept at the same number, which the
    run's spec names). Returns its pid and a pidfd of it; raises :class:`NotServed` where none answers before
    anything was sent (start one as a new interpreter instead), OSError after."""
    data = json.dumps({"supervise": folder, "api_socket": api_socket}).encode() + b"\n"
    files = [control, log, *([api_socket] if api_socket is not None else [])]
    conn, _, pid, pidfd = _ask(path, lambda conn: socket.send_fds(conn, [data], files))
    conn.close()
    return pid, pidfd


def _ask(path: Path, send: Callable[[socket.socket], None]) -> tuple[socket.socket, Lines, int, int]:
    """Send the interpreter at ``path`` a request and read its launcher's answer: the connection, its lines, the
    pid of the process forked and a pidfd of it. :class:`NotServed` where none answers before anything was sent,
    OSError after (the connection closed)."""
    try:
        conn = connect(path, ANSWER_SECONDS)
    except OSError as exc:
        raise NotServed(f"no warm interpreter answers at {path}: {exc}") from exc
    try:
        send(conn)
        lines = Lines(conn)
        answer = lines.next()
        fds, lines.fds = lines.fds, []
        if answer is None or not isinstance(answer.get("pid"), int) or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise OSError(f"the warm interpreter's launcher said {answer!r}")
        return conn, lines, answer["pid"], fds[0]
    except BaseException:
        conn.close()
        raise


class ForkedProcess:
    """A job's process forked by the warm interpreter, as its supervisor holds it: its pid, a pidfd of it
    (readable once it exited; its signals go by it, never by a pid that may be reused), and its launcher,
    which says how it exited."""

    def __init__(self, pid: int, pidfd: int, lines: Lines):
        self.pid = pid
        self.pidfd = pidfd
        self.lines = lines
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit code once it exited (its launcher's word, waited for at most a few seconds: it reaps it at
        once), else None. A launcher that is gone says nothing: the process counts as killed."""
        if self.returncode is None and self.wait_gone(0):
            self.lines.conn.settimeout(EXIT_WORD_SECONDS)
            try:
                message = self.lines.next() or {}
            except (OSError, ValueError):
                message = {}
            code = message.get("exit")
            self.returncode = code if isinstance(code, int) else -signal.SIGKILL
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Signal the process by its pidfd (nothing where it exited)."""
        with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
            signal.pidfd_send_signal(self.pidfd, signum)

    def wait_gone(self, seconds: float) -> bool:
        """Wait (at most ``seconds``) until it exited; whether it did."""
        return bool(select.select([self.pidfd], [], [], seconds)[0])

    def close(self) -> None:
        """Let go of the pidfd and the launcher."""
        with contextlib.suppress(OSError):
            os.close(self.pidfd)
        self.lines.conn.close()


def fork_entry(path: Path, request: Request, log: int, namespaces: list[int]) -> ForkedProcess:
    """Ask the warm interpreter at ``path`` for a job's process; raises :class:`NotServed` where none
    answers before anything was sent (start a new interpreter instead), OSError after."""
    _, lines, pid, pidfd = _ask(path, lambda conn: send_request(conn, request, log, namespaces))
    return ForkedProcess(pid, pidfd, lines)


class NotServed(OSError):
    """No warm interpreter took the request: nothing was started."""


class Lines:
    """JSON objects, a line each, and the descriptors that came with them, read from a stream socket."""

    def __init__(self, conn: socket.socket):
        self.conn = conn
        self.buffer = b""
        self.fds: list[int] = []

    def next(self) -> dict[str, Any] | None:
        """The next object, waiting for it (the socket's timeout bounds each read); None at an end of file."""
        while b"\n" not in self.buffer:
            data, fds, _, _ = socket.recv_fds(self.conn, 65536, MAX_DESCRIPTORS)
            self.fds += fds
            if not data:
                return None
            self.buffer += data
            if len(self.buffer) > REQUEST_BYTES:
                raise ValueError(f"a message of over {REQUEST_BYTES} bytes")
        line, self.buffer = self.buffer.split(b"\n", 1)
        message = json.loads(line)
        if not isinstance(message, dict):
            raise ValueError("a message that is no JSON object")
        return message


def retitle(words: list[str]) -> None:
    """Show this process as ``words`` (its ``/proc/<pid>/cmdline``, what ``ps`` lists): the memory of the
    arguments it was started with, rewritten in place and padded with NULs (cut to their length). A forked
    process otherwise shows the interpreter's arguments (its socket, its worker's pid)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49 of proc(5)
    title = "\0".join(words).encode()[:end - start - 1]
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        mem.seek(start)
        mem.write(title.ljust(end - start, b"\0"))
