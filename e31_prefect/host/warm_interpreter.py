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

A process run's supervisor (:mod:`e31_prefect.host.supervisor`, standard library only) is forked the same way,
at the worker's request (:func:`e31_prefect.host.warm_requests.fork_supervisor`): its launcher sends the worker
its pid and a pidfd of it, then becomes the supervisor as ``python -m e31_prefect.supervisor FOLDER`` would start,
the worker's control socket its stdin and the run's supervisor log its stderr. An interpreter's start and imports
(about a tenth of a host CPU-second a run) are spared; what is loaded here is frozen (``gc.freeze``), so a
supervisor that lives as long as its run never walks it, and its memory stays shared (about 9 MB of a forked
supervisor's own, against about 25 MB of one started as an interpreter).

What the worker and the supervisors send and hold: :mod:`e31_prefect.host.warm_requests`.

Where the interpreter is gone or does not answer, the supervisor starts the entry as a new interpreter
(:class:`e31_prefect.host.supervised_work.ProcessWork`); a job whose variables act as an interpreter
starts (``PYTHONPATH``, ``LD_PRELOAD``) gets one too, after its hand-over, billed.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import signal
import socket
import struct
import sys
from pathlib import Path

from e31_prefect.host import cgroups, leftovers, sandbox
from e31_prefect.host.warm_requests import Lines, Request, retitle

PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4


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
    if "supervise" in message:
        return supervise(str(message["supervise"]), message.get("api_socket"), lines.fds, conn)
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


def supervise(folder: str, api_socket: int | None, fds: list[int], conn: socket.socket) -> int:
    """In the launcher, as root: become the run's supervisor in a session of its own, as the worker would start
    it (its control socket as stdin, nothing as stdout, its log as stderr, its gateway's socket at the number the
    spec names, nothing else of this interpreter's open), once the worker holds its pid and a pidfd of it."""
    from e31_prefect.host.lock_holders import SUPERVISOR_MODULE

    if len(fds) != 2 + (api_socket is not None):  # the worker hears no pid: nothing was started
        return 2
    retitle([sys.executable, "-m", SUPERVISOR_MODULE, folder])  # a device lock's holder is named by it
    os.setsid()
    pidfd = os.pidfd_open(os.getpid())
    socket.send_fds(conn, [json.dumps({"pid": os.getpid()}).encode() + b"\n"], [pidfd])
    os.close(pidfd)
    conn.close()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd, number in zip((fds[0], devnull, fds[1]), (0, 1, 2), strict=True):
        os.dup2(fd, number)
    keep = {0, 1, 2}
    if api_socket is not None:
        os.dup2(fds[2], api_socket)  # after the three above: none of theirs is needed any more
        keep.add(api_socket)
    for fd in os.listdir("/proc/self/fd"):
        if int(fd) not in keep:
            with contextlib.suppress(OSError):
                os.close(int(fd))
    os.chdir("/")
    from e31_prefect.host import supervisor

    try:
        return supervisor.main([folder])
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()


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


def main() -> None:
    """Load Prefect and the engine (connections wait meanwhile on the socket the worker bound and passed),
    then serve until the worker is gone."""
    listening, parent = socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2])
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the worker died before the line above
        return
    from e31_prefect import job_entry
    from e31_prefect.host import supervisor  # noqa: F401 -- loaded once here, for the supervisors forked

    job_entry.prepare_engine()
    job_entry.remember_logging()
    gc.freeze()  # what is loaded stays shared with each fork: no collection of theirs walks (and copies) it
    serve(listening, parent)


if __name__ == "__main__":
    main()
