"""The worker's side of a run's supervisor: start it, hand it the run's devices, stop it, wait for it.

The supervisor (:mod:`e31_prefect.host.supervisor`) runs in a session of its own: forked by the host's warm
interpreter for a process run where one serves (:func:`e31_prefect.host.warm_requests.fork_supervisor`),
else started as a new interpreter.
The worker speaks to it on a control socket (the supervisor's stdin): the
container it started, then the hand-over of the rented devices with their lock
files. From the hand-over on it outlives the worker; a worker that adopts a
dead worker's run reaches its supervisor by pid, as the ledger names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import socket
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

from e31_prefect.host.ledger import Record, RunFolder, Spec, same_process

STARTED_POLL_SECONDS = 0.02


def make_work_ended_pipe(folder: RunFolder) -> None:
    """The pipe the job says its work ended on; made before a container that mounts it is created."""
    with contextlib.suppress(FileExistsError):
        os.mkfifo(folder.work_ended_pipe, 0o622)
    os.chmod(folder.work_ended_pipe, 0o622)  # the job may run as another user; it only writes


def make_hand_over_pipe(folder: RunFolder) -> None:
    """The pipe the supervisor hands the devices over on; the job may run as another user, and only reads."""
    with contextlib.suppress(FileExistsError):
        os.mkfifo(folder.hand_over_pipe, 0o644)
    os.chmod(folder.hand_over_pipe, 0o644)


def make_api_socket(folder: RunFolder) -> socket.socket:
    """The Unix socket the run's gateway serves the job's Prefect calls on; the job may run as another
    user, and only its own supervisor's folder leads to it."""
    with contextlib.suppress(FileNotFoundError):
        folder.api_socket.unlink()
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    folder_fd = os.open(folder.path, os.O_PATH | os.O_CLOEXEC)
    try:  # by the folder's descriptor: a socket's path may be at most 107 bytes, a ledger's is longer
        listening.bind(f"/proc/self/fd/{folder_fd}/{folder.api_socket.name}")
    finally:
        os.close(folder_fd)
    os.chmod(folder.api_socket, 0o666)
    listening.listen(64)
    return listening


async def exited(pidfd: int) -> None:
    """Until the process of ``pidfd`` exited (a pidfd reads as ready then, whoever its parent is)."""
    ready = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(pidfd, ready.set)
    try:
        await ready.wait()
    finally:
        loop.remove_reader(pidfd)


class ForkedSupervisor:
    """A supervisor the host's warm interpreter forked: no child of this worker, so held by a pidfd (its pid
    may be reused once it exited), as an :class:`asyncio.subprocess.Process` is held by its pid."""

    def __init__(self, pid: int, pidfd: int):
        self.pid = pid
        self._pidfd: int | None = pidfd
        self._exit: asyncio.Future[None] | None = None  # one watch of the pidfd, however many wait

    @property
    def returncode(self) -> int | None:
        """None while it runs, 0 once it exited: its record, not its exit code, says how its run ended."""
        if self._pidfd is None:
            return 0
        if not select.select([self._pidfd], [], [], 0)[0]:
            return None
        if self._exit is None or self._exit.done():
            self._let_go()
        return 0

    def send_signal(self, signum: int) -> None:
        """Signal it by its pidfd (nothing once it exited)."""
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._pidfd, signum)

    async def wait(self) -> int:
        """Until it exited."""
        if self._pidfd is not None:
            if self._exit is None:
                self._exit = asyncio.ensure_future(exited(self._pidfd))
            await asyncio.shield(self._exit)
            self._let_go()
        return 0

    def _let_go(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


async def fork_supervisor(folder: RunFolder, spec: Spec, control: socket.socket, log: BinaryIO
                          ) -> ForkedSupervisor | None:
    """A process run's supervisor forked by the host's warm interpreter, where one serves (None: start one)."""
    if spec.runtime != "process" or not spec.warm_interpreter:
        return None
    from e31_prefect.host import warm_requests

    try:
        pid, pidfd = await asyncio.to_thread(warm_requests.fork_supervisor, Path(spec.warm_interpreter),
                                             str(folder.path), control.fileno(), log.fileno(), spec.api_socket_fd)
    except warm_requests.NotServed:
        return None
    return ForkedSupervisor(pid, pidfd)


class SupervisorGone(RuntimeError):
    """The supervisor ended without saying whether the work started."""


class Supervisor:
    """One run's supervisor, started here or adopted from the ledger."""

    def __init__(self, folder: RunFolder, process: asyncio.subprocess.Process | ForkedSupervisor | None = None,
                 control: socket.socket | None = None):
        self.folder = folder
        self.process = process
        self.control = control  # the worker's end of the control socket, until the hand-over
        self.told: socket.socket | None = None  # the same socket from the hand-over on: where the work's end is told

    @classmethod
    async def start(cls, folder: RunFolder, spec: Spec) -> Supervisor:
        """Write the spec and start the supervisor with its control socket and the listening socket of the
        run's API gateway (made here, so it exists before a container that mounts it is created): forked by the
        host's warm interpreter where one serves a process run, else as a new interpreter."""
        make_work_ended_pipe(folder)
        make_hand_over_pipe(folder)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.ExitStack() as held:
            held.enter_context(theirs)
            passed: tuple[int, ...] = ()
            if spec.api_upstream:
                listening = held.enter_context(make_api_socket(folder))
                spec.api_socket_fd = listening.fileno()
                passed = (listening.fileno(),)
            folder.write_spec(spec)
            with open(folder.supervisor_log, "ab") as log:
                process = await fork_supervisor(folder, spec, theirs, log) or await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "e31_prefect.supervisor", str(folder.path),
                    stdin=theirs, stdout=asyncio.subprocess.DEVNULL, stderr=log,
                    start_new_session=True,  # a signal to the worker's group (Ctrl-C, a service stop) is not its
                    pass_fds=passed, cwd="/")
        return cls(folder, process, ours)

    @property
    def pid(self) -> int | None:
        """The supervisor's pid (from the ledger when adopted)."""
        if self.process is not None:
            return self.process.pid
        record = self.folder.record()
        return record.supervisor_pid if record else None

    def alive(self) -> bool:
        """Whether the supervisor still runs."""
        if self.process is not None:
            return self.process.returncode is None
        record = self.folder.record()
        return record is not None and same_process(record.supervisor_pid, record.supervisor_started)

    def _say(self, message: dict[str, Any], files: Sequence[int] = ()) -> None:
        if self.control is None:
            return
        with contextlib.suppress(OSError):  # a supervisor that is gone hears nothing; its record says why
            socket.send_fds(self.control, [json.dumps(message).encode() + b"\n"], list(files))

    def name_container(self, container_id: str | None) -> None:
        """Tell a container run's supervisor which container to watch (None: none was started)."""
        self._say({"container": container_id})

    def hand_over(self, env: dict[str, str], stop_at: datetime | None, rented: datetime,
                  lock_files: Sequence[int], gpu_minors: Sequence[int] = ()) -> None:
        """Hand the rented devices to the work: their variables, their minor numbers (the nodes its supervisor
        opens to it), the time limit, and their lock files (the supervisor holds the devices from now on,
        whatever becomes of this worker)."""
        self._say({"hand_over": {"env": env, "stop_at": stop_at.isoformat() if stop_at else None,
                                 "rented": rented.isoformat(), "gpu_minors": list(gpu_minors)}}, lock_files)
        self.told, self.control = self.control, None

    def let_go(self) -> None:
        """Close the control socket: a supervisor not handed its devices yet ends its work, unbilled."""
        if self.control is not None:
            self.control.close()
            self.control = None

    async def ready(self) -> Record:
        """The record once the work waits for its devices, or ended before."""
        return await self._record_when(lambda record: bool(record.ready or record.started or record.finished))

    async def started(self) -> Record:
        """The record once the work was handed its devices, or ended without them."""
        return await self._record_when(lambda record: bool(record.started or record.finished))

    async def _record_when(self, reached: Any) -> Record:
        while True:
            record = self.folder.record()
            if record is not None and reached(record):
                return record
            if not self.alive():
                record = self.folder.record()
                if record is not None and reached(record):
                    return record
                raise SupervisorGone(f"the run's supervisor ended before starting the work; see "
                                     f"{self.folder.supervisor_log}")
            await asyncio.sleep(STARTED_POLL_SECONDS)

    def stop(self) -> None:
        """Ask the supervisor to stop the work (the run was cancelled)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            return
        record = self.folder.record()
        if record is not None and same_process(record.supervisor_pid, record.supervisor_started):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(record.supervisor_pid, signal.SIGTERM)

    async def wait(self) -> Record | None:
        """The supervisor's record once the work has ended (its last process gone, its devices free: the
        supervisor says so on its control socket, and may still be sweeping what the work left on the host),
        or once the supervisor exited (None if it left no record)."""
        waits = [asyncio.ensure_future(self.process.wait() if self.process is not None else self._wait_adopted())]
        if self.told is not None:
            waits.append(asyncio.ensure_future(self._told_ended(self.told)))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
            if self.told is not None:
                self.told.close()
                self.told = None
        return self.folder.record()

    async def _told_ended(self, told: socket.socket) -> None:
        """Until the supervisor says the work ended (a line), or closes its end (it exited)."""
        told.setblocking(False)
        loop = asyncio.get_running_loop()
        while True:
            try:
                data = await loop.sock_recv(told, 4096)
            except OSError:
                return
            if not data or b"ended" in data:
                return

    async def _wait_adopted(self) -> None:
        record = self.folder.record()
        if record is None or not same_process(record.supervisor_pid, record.supervisor_started):
            return
        try:
            fd = os.pidfd_open(record.supervisor_pid)
        except OSError:
            return
        try:
            await exited(fd)
        finally:
            os.close(fd)
