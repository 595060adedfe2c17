"""The host's warm interpreter: Prefect and its engine loaded once, each process job's entry forked from it.

    python -s -P -m e31_prefect.host.warm_interpreter FD WORKER_PID    # started by the worker, as root

Loading Prefect, its engine and its client costs a job's process about 1.5 host CPU-seconds before its
rent: no team pays for it, the host does, for every run. This interpreter loads them once, with nothing
of any job's (e31's own environment: the host's paths and locale, a home of its own), and forks each
process job's entry from there, as Android's and Chrome's zygotes fork their sandboxed children.

It must never hold what a job could use against another, so it never reads a request. For each
connection of a run's supervisor (root only, checked by the socket's peer credentials), it forks a
*launcher* and goes back to waiting; it stays single-threaded and holds no secret and no job's bytes.
The launcher, root and outside the job, reads its run's request (the job's environment, working folder,
uid, cgroup, and the namespaces the supervisor made for it, passed as descriptors), enters the job's PID
namespace and forks the job's process. That process joins the run's cgroup and namespaces, becomes the
job's user, keeps only its standard streams (the run's log) and runs :func:`e31_prefect.job_entry.main`
in the job's environment, exactly as ``python -s -P -m e31_prefect.job_entry`` would. The launcher
sends the supervisor the process's pid and a pidfd of it, reaps it and says how it exited.

Where the interpreter is gone or does not answer, the supervisor starts the entry as a new interpreter
(:class:`e31_prefect.host.supervised_work.ProcessWork`); a job whose variables act as an interpreter
starts (``PYTHONPATH``, ``LD_PRELOAD``) gets one too, after its hand-over, billed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from e31_prefect.host import cgroups, leftovers, sandbox

PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
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
                    [sys.executable, "-s", "-P", "-m", __spec__.name, str(listening.fileno()), str(os.getpid())],
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
    try:
        conn = connect(path, ANSWER_SECONDS)
    except OSError as exc:
        raise NotServed(f"no warm interpreter answers at {path}: {exc}") from exc
    try:
        send_request(conn, request, log, namespaces)
        lines = Lines(conn)
        answer = lines.next()
        if answer is None or not isinstance(answer.get("pid"), int) or not lines.fds:
            raise OSError(f"the warm interpreter's launcher said {answer!r}")
        pidfd, *extra = lines.fds
        for fd in extra:
            os.close(fd)
        lines.fds = []
        return ForkedProcess(answer["pid"], pidfd, lines)
    except BaseException:
        conn.close()
        raise


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


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def serve(listening: socket.socket, parent: int) -> None:
    """Fork a launcher for each connection of this host's root; never read what it brings."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the launchers: no zombie, no handler
    while True:
        conn, _ = listening.accept()
        if _peer_uid(conn) != os.geteuid() or os.getppid() != parent:
            conn.close()
            if os.getppid() != parent:  # the worker is gone: so is its interpreter
                return
            continue
        if os.fork() == 0:  # pragma: no cover - the launcher ends in os._exit
            code = 1
            try:
                listening.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                code = launch(conn)
            finally:
                os._exit(code)
        conn.close()


def launch(conn: socket.socket) -> int:
    """In the launcher, as root: read the run's request, fork the job's process into the job's PID
    namespace, send its pid and pidfd, reap it and send its exit code."""
    conn.settimeout(30)
    lines = Lines(conn)
    message = lines.next()
    if message is None:
        return 1
    request, fds = Request(**message), lines.fds
    retitle(["e31-launcher", request.env.get("PREFECT__FLOW_RUN_ID", "")])
    log, namespaces = fds[0], list(zip(fds[1:], request.namespaces, strict=True))
    own = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    if namespaces:
        sandbox.setns(*namespaces[0])  # only this process's later children enter it: the job's process
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the job's process ends in os._exit
        os._exit(become_job(request, log, namespaces[1:], conn))
    sandbox.setns(own, sandbox.CLONE_NEWPID)
    pidfd = os.pidfd_open(pid)
    for fd in (own, *fds):
        os.close(fd)
    socket.send_fds(conn, [json.dumps({"pid": pid}).encode() + b"\n"], [pidfd])
    os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    return 0


def become_job(request: Request, log: int, namespaces: list[tuple[int, int]], conn: socket.socket) -> int:
    """In the job's process, as root until its user is taken: a session of its own, the run's log as its
    streams, its cgroup, its namespaces, its user, its environment; then the job's entry. Returns its exit
    code (it never returns to the interpreter's loop)."""
    try:
        from e31_prefect import job_entry

        retitle([sys.executable, *job_entry.entry_arguments(user_site=False)])  # what it stands for
        os.setsid()
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        if request.cgroup_files:
            cgroups.join([Path(p) for p in request.cgroup_files])
        if namespaces:
            sandbox.join(namespaces, request.cwd)
        elif request.cwd:
            os.chdir(request.cwd)
        if request.uid is not None:
            leftovers.become(request.uid)
            # A new uid makes a process undumpable (its /proc files root's), as exec would not: it is the job's.
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        conn.close()
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # nothing of the launcher's: only its standard streams
        os.environ.clear()
        os.environ.update(request.env)
    except BaseException as exc:  # noqa: BLE001 -- said in the run's log; the supervisor sees the exit code
        with contextlib.suppress(Exception):
            os.write(2, f"e31: the job's process could not be set up: {exc!r}\n".encode())
        return 126
    sys.argv = [job_entry.__file__]
    code = 0
    try:
        job_entry.main(loaded=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 -- as the interpreter would: the traceback in the log, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


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


def main() -> None:
    """Load Prefect and the engine (connections wait meanwhile on the socket the worker bound and passed),
    then serve until the worker is gone."""
    listening, parent = socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2])
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the worker died before the line above
        return
    from e31_prefect import job_entry

    job_entry.prepare_engine()
    job_entry.remember_logging()
    serve(listening, parent)


if __name__ == "__main__":
    main()
