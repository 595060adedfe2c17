"""A run's supervisor, in the spirit of Slurm's slurmstepd: it owns the work, bounds it and records it.

    python -m e31_prefect.host.supervisor $E31_HOME/ledger/<flow run id>

The worker starts one supervisor per run, in a session of its own, before
renting. The supervisor starts the work (a process in the run's cgroup, or a
container the worker created and names on its control socket, stdin), which
loads Prefect with no device and says ``ready``. The worker then rents and
hands the devices over on the control socket (their variables, their minor
numbers, the time limit, their lock files); the supervisor opens those GPUs'
nodes to the work's cgroup (none open before: :mod:`.device_fence`) and passes
the variables to the waiting work: the meter starts there. A work that dies
while it waits, a cancel, or a worker that goes before handing anything over
ends the work unbilled ("not-started").

From the hand-over on the supervisor outlives the worker: it enforces the time
limit whether or not the worker lives, stops the work when asked (SIGTERM: the
run was cancelled), kills every process of the work at the end (``setsid``
daemons too), and records durably in the ledger when the work started, when it
said its work was done, when it ended and how. It holds the run's device locks
(handed over by the worker), so the devices stay rented exactly as long as the
work can use them.

The meter ends when the devices come back: when the work's last process is gone
(every descendant killed once its main process ends), never at a word the job
writes. The job's own entry (:mod:`e31_prefect.job_entry`) writes to the
``work-ended`` pipe when the flow returns, naming its outcome, and leaves once
the engine has reported it; from that word the job has ``report_grace_seconds``
to end, or it is killed and its run ends as having kept running. The word is
only ever the job's claim: it shortens the job's time, it never stops its bill.

Only the standard library (and the Docker client for containers): it starts in
milliseconds, and every second between renting and starting is billed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import selectors
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from e31_prefect.host import fdtree
from e31_prefect.host import fence as fence_keeper
from e31_prefect.host.gateway import Gateway, auth_header
from e31_prefect.host.heartbeat import ApiVariables, Beating, fenced_at
from e31_prefect.host.ledger import Record, RunFolder, Spec, append_line, moment, now, this_process
from e31_prefect.host.supervised_work import ContainerWork, Exit, ProcessWork, Work
from e31_prefect.host.warm_requests import retitle
from e31_prefect.job_entry import OUTCOMES, READY, UNREPORTED

PR_SET_CHILD_SUBREAPER = 36
KILL_RETRY_SECONDS = 1.0
OUTPUT_COUNT_SECONDS = 2.0  # how often an output dir that is no disk of its own is counted against its bounds
CONTAINER_STOP_EXTRA_SECONDS = 5.0  # past the grace, a container that did not stop is killed, then removed


class Control:
    """The worker's messages on the supervisor's stdin, a Unix socket: one JSON object a line, the lock files
    of the run's devices passed with the hand-over. An end of file: the worker is gone (or let the run go)."""

    def __init__(self, sock: socket.socket | None):
        self.sock = sock
        self.buffer = b""
        self.closed = sock is None
        self.lock_files: list[int] = []  # kept open until the work's last process is gone: the devices stay rented

    def fileno(self) -> int:
        assert self.sock is not None
        return self.sock.fileno()

    def read(self) -> list[dict[str, Any]]:
        """The messages that arrived (call when readable: it waits for one read otherwise)."""
        if self.sock is None or self.closed:
            return []
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, 65536, 64)
        except OSError:
            data, fds = b"", []
        for fd in fds:
            os.set_inheritable(fd, False)
        self.lock_files += fds
        if not data:
            self.closed = True
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        messages = []
        for line in lines:
            with contextlib.suppress(ValueError):
                message = json.loads(line)
                if isinstance(message, dict):
                    messages.append(message)
        return messages

    def release_devices(self) -> None:
        """Close the devices' lock files (the work's last process is gone: the devices are free on the host),
        and tell the worker, if it still listens."""
        for fd in self.lock_files:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.lock_files = []
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.send(b'{"ended": true}\n', socket.MSG_DONTWAIT)

    def first(self) -> dict[str, Any] | None:
        """The first message (waiting for it), or None at an end of file."""
        while not self.closed:
            messages = self.read()
            if messages:
                return messages[0]
        return None


class Supervisor:
    """Runs one run's work to its end and records it; see the module's docstring."""

    def __init__(self, folder: RunFolder, spec: Spec, work: Work, record: Record, stop: threading.Event,
                 wake: int, control: Control | None = None):
        self.folder = folder
        self.control = control or Control(None)
        self.spec = spec
        self.work = work
        self.record = record
        self.stop = stop  # set by SIGTERM: the run was cancelled
        self.wake = wake  # readable when a signal arrived
        self.stop_at = moment(spec.stop_at)
        self.kill_at: datetime | None = None
        self.grace_until: datetime | None = None  # in a stop with a grace period: when it ends
        self.report_by: datetime | None = None
        self.ending = threading.Event()  # the work said it ended or is being stopped: its run may end (gateway)
        self.outputs_counted = time.monotonic()
        self.beating: Beating | None = None  # the host's heartbeats and the run's fence lease

    def save(self) -> None:
        """Write the record as it stands."""
        self.folder.write_record(self.record)

    def run(self) -> int:
        """Start the work, hand it its devices, bound it, record its end. Returns the exit status (0)."""
        pipe = _open_pipe(self.folder.work_ended_pipe)
        gate = _open_gate(self.folder.hand_over_pipe)
        self.beating = _fence(self.spec, self.folder)  # its keeper runs from before the work does
        try:
            infrastructure = self.work.start()
        except Exception as exc:
            infrastructure = None
            self.record.message = f"the work could not start: {type(exc).__name__}: {exc}"
        if infrastructure is None:
            self.record.ending, self.record.ended = "not-started", now().isoformat()
            self.record.message = self.record.message or "the work never started"
            self.save()
            return 0
        self.record.infrastructure = infrastructure
        self.save()
        # Served only once the work is started: a thread must not run while the work's process forks.
        gateway = _serve_gateway(self.spec, self.ending)
        if self.beating is not None:
            self.beating.start()
        try:
            if not self._hand_over(pipe, gate):
                self._never_handed_over()
                return 0
            # The work's end is recorded (and its devices freed) before its gateway stops serving: stopping
            # it waits out the server's poll (half a second).
            self._finish(self._supervise(pipe))
        except BaseException:
            # Whatever broke the watch (a job that used up the supervisor's descriptors, say), the work does
            # not outlive it: every process of it goes before the supervisor, and its device locks, do.
            self.work.kill()
            self.work.clean_up()
            raise
        finally:
            if gateway is not None:
                gateway.close()
            if self.beating is not None:
                self.beating.stop.set()
        return 0

    def _hand_over(self, pipe: int, gate: int) -> bool:
        """Until the work has both said it is ready and been handed its devices by the worker: then give it
        their variables on the gate, and the meter starts. False: it died, was cancelled, or the worker went
        first (the reason is in the record)."""
        handed: dict[str, Any] | None = None
        selector = selectors.DefaultSelector()
        selector.register(self.work.fileno(), selectors.EVENT_READ, "work")
        selector.register(pipe, selectors.EVENT_READ, "said")
        selector.register(self.wake, selectors.EVENT_READ, "signal")
        if self.control.closed:
            self.record.message = "no worker to hand it its devices (the supervisor has no control socket)"
            return False
        selector.register(self.control, selectors.EVENT_READ, "control")
        while True:
            for key, _ in selector.select(KILL_RETRY_SECONDS):
                if key.data == "said" and READY in _words(pipe) and self.record.ready is None:
                    self.record.ready = now().isoformat()
                    self.save()
                elif key.data == "control":
                    for message in self.control.read():
                        handed = message.get("hand_over", handed)
                    if self.control.closed:
                        if handed is None:
                            self.record.message = "the worker handed over no devices (it stopped, or could not rent)"
                            return False
                        selector.unregister(self.control)
                elif key.data == "signal":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake, 512)
            if self.stop.is_set():
                self.record.message = "cancelled before its devices were handed over"
                return False
            if self._cut_off():
                self.record.message = (f"its host was cut off from the Prefect API for {self._fence_seconds():.0f} s "
                                       "(the pool may have requeued the run elsewhere): stopped before its devices "
                                       "were handed over")
                return False
            exit_ = self.work.ended()
            if exit_ is not None:
                self.record.exit_code = exit_.code
                self.record.message = (f"the job's process ended (exit code {exit_.code}) before its devices "
                                       "were handed over")
                return False
            if handed is not None and self.record.ready is not None:
                break
        try:  # the rented GPUs' nodes open to the work before it hears of them (host/device_fence.py)
            self.record.notes += self.work.open_devices(list(handed.get("gpu_minors") or []))
        except (OSError, ValueError) as exc:
            self.record.message = f"the rented GPUs could not be opened to the job's processes: {exc}"
            return False
        with contextlib.suppress(OSError):  # a job that closed its end gets its variables nowhere: it ends
            _write_all(gate, json.dumps({"env": {**self.spec.hand_over_env, **(handed.get("env") or {})}}).encode()
                       + b"\n")
        os.close(gate)
        self.record.started = now().isoformat()
        self.stop_at = moment(handed.get("stop_at"))
        self.spec.rented = handed.get("rented")
        self.save()
        return True

    def _never_handed_over(self) -> None:
        """The work ends as it waited, unbilled: nothing of the job's own ran."""
        self.work.kill()
        self.work.clean_up()
        self.record.ending, self.record.ended = "not-started", now().isoformat()
        self.save()

    def _supervise(self, pipe: int) -> Exit:
        """Until the work ends: its end said, stop requests, the time limit."""
        selector = selectors.DefaultSelector()
        selector.register(self.work.fileno(), selectors.EVENT_READ, "work")
        selector.register(pipe, selectors.EVENT_READ, "work-ended")
        selector.register(self.wake, selectors.EVENT_READ, "signal")
        while True:
            for key, _ in selector.select(self._seconds_to_next()):
                if key.data == "work-ended" and self._work_said_ended(pipe):
                    selector.unregister(pipe)  # its last word: it gave up reporting and is leaving
                elif key.data == "signal":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake, 512)
            exit_ = self.work.ended()
            if exit_ is not None:
                return exit_
            self._enforce()

    def _seconds_to_next(self) -> float:
        """Until the next thing to do (at most a second, so the work's state is read often)."""
        due = self.kill_at if self.record.stop_reason is not None else self.report_by or self.stop_at
        if due is None:
            return KILL_RETRY_SECONDS
        return max(0.0, min(KILL_RETRY_SECONDS, (due - now()).total_seconds()))

    def _work_said_ended(self, pipe: int) -> bool:
        """The job wrote to the work-ended pipe (anything but its ready): its flow returned, it says, with
        this outcome. From the first word it has its report grace to end. True once it has said one."""
        words = [word for word in _words(pipe) if word != READY]
        if not words:
            return False
        before = (self.record.work_ended, self.record.outcome, self.record.unreported)
        if self.record.work_ended is None:
            self.record.work_ended = now().isoformat()
            self.report_by = now() + timedelta(seconds=self.spec.report_grace_seconds)
            self.ending.set()
        self.record.outcome = self.record.outcome or next((w for w in words if w in OUTCOMES), None)
        self.record.unreported = self.record.unreported or UNREPORTED in words
        if (self.record.work_ended, self.record.outcome, self.record.unreported) != before:
            self.save()  # only what changed: a job writing words without end costs no disk writes
        return self.record.unreported

    def _enforce(self) -> None:
        """Start a stop at the time limit, when asked, or when a job that said it ended never exits."""
        at = now()
        if self.record.stop_reason is None:
            if self._cut_off(at):
                # Cut off from the API for its fence time: the pool requeues the run elsewhere at its lost time.
                self._begin_stop("fenced", at, 0.0)
            elif self.stop.is_set():
                self._begin_stop("stop-requested", at, self.spec.grace_seconds)
            elif self.report_by is not None and at >= self.report_by:
                self._begin_stop("report-overdue", at, 0.0)
            elif self.report_by is None and self.stop_at is not None and at >= self.stop_at:
                self._begin_stop("time-limit", at, self.spec.grace_seconds)
            elif self._outputs_past_bounds():
                self._begin_stop("output-bound", at, self.spec.grace_seconds)
        elif self.kill_at is not None and at >= self.kill_at:
            self.work.kill()
            self.kill_at = at + timedelta(seconds=KILL_RETRY_SECONDS)

    def _cut_off(self, at: datetime | None = None) -> bool:
        """Whether the run's fence lease ran out (its heartbeats have not reached the API for the fence time):
        the work must stop, whether or not the keeper stopped it already."""
        return self.beating is not None and self.beating.expired(at)

    def _fence_seconds(self) -> float:
        return self.beating.fence.total_seconds() if self.beating is not None else 0.0

    def _outputs_past_bounds(self) -> bool:
        """Where the output dir is no disk of its own (the kernel bounds one), whether the work wrote past its
        bounds; counted every few seconds, the count itself bounded."""
        spec = self.spec
        if spec.output_dir is None or spec.output_max_entries is None:
            return False
        if time.monotonic() - self.outputs_counted < OUTPUT_COUNT_SECONDS:
            return False
        self.outputs_counted = time.monotonic()
        entries, size = fdtree.count(Path(spec.output_dir), spec.output_max_entries, fdtree.MAX_OUTPUT_PATH)
        return entries > spec.output_max_entries or (spec.output_max_bytes is not None
                                                    and size > spec.output_max_bytes)

    def _begin_stop(self, reason: str, at: datetime, grace: float) -> None:
        self.record.stop_reason, self.record.stop_requested = reason, at.isoformat()
        self.save()
        self.ending.set()
        if grace > 0:
            self.work.terminate(grace)
            self.grace_until = at + timedelta(seconds=grace)
            extra = CONTAINER_STOP_EXTRA_SECONDS if isinstance(self.work, ContainerWork) else 0.0
            self.kill_at = at + timedelta(seconds=grace + extra)
        else:
            self.work.kill()
            self.kill_at = at + timedelta(seconds=KILL_RETRY_SECONDS)

    def _finish(self, exit_: Exit) -> None:
        # Whatever the work left behind goes with it (daemons, children of a dead leader); the devices are
        # back, and the meter stops, when its last process is gone. The record says so at once (the worker
        # takes the devices back from it); the slower sweep of what the work left on the host comes after.
        self.record.exited = exit_.at.isoformat()
        self.record.ended = self.work.stop_all(self.grace_until).isoformat()
        self.record.exit_code = exit_.code
        fenced = fenced_at(self.folder.path)
        if fenced is not None and self.record.stop_reason in (None, "fenced"):
            # Its keeper stopped it (this supervisor was stopped or hung meanwhile): from then on it did not run.
            self.record.stop_reason, self.record.stop_requested = "fenced", fenced.isoformat()
        reason = self.record.stop_reason
        if reason == "fenced":
            self.record.ending = "fenced"
            self.record.message = (f"its host was cut off from the Prefect API for {self._fence_seconds():.0f} s: the "
                                   "work was stopped, so that the pool could run it elsewhere")
        elif exit_.out_of_memory:
            self.record.ending = "out-of-memory"
        elif reason == "time-limit":
            self.record.ending = "timed-out"
        elif reason == "stop-requested":
            self.record.ending = "stopped"
        elif reason == "output-bound":
            self.record.ending = "output-bound"
        elif reason == "report-overdue":
            self.record.ending = "kept-running"
        else:
            self.record.ending = "exited"
        self.save()
        self.control.release_devices()
        notes = len(self.record.notes)
        self.work.clean_up()
        if len(self.record.notes) != notes:
            self.save()
        if self.spec.accounting:
            # The host's own account of every run, written by the supervisor as the work ends, whatever
            # becomes of the worker or the Prefect API (as Slurm's accounting keeps what slurmstepd saw).
            with contextlib.suppress(OSError):
                append_line(Path(self.spec.accounting), {"run_id": self.spec.run_id, "rented": self.spec.rented,
                                                         "grace_seconds": self.spec.grace_seconds,
                                                         **asdict(self.record)})


def _words(pipe: int) -> list[str]:
    """What the job wrote to the work-ended pipe since the last read (its words, a line each)."""
    try:
        said = os.read(pipe, 4096)
    except BlockingIOError:
        return []
    return said.decode(errors="replace").split() or []


def _write_all(fd: int, data: bytes, seconds: float = 10.0) -> None:
    """All of ``data`` to the gate, which holds 64 KiB where the job's environment may be more: its entry reads
    it as it waits. TimeoutError after ``seconds`` (an entry that died reads no more)."""
    deadline, left = time.monotonic() + seconds, memoryview(data)
    while left:
        try:
            left = left[os.write(fd, left):]
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError("the work read no more of its hand-over") from None
            select.select([], [fd], [], KILL_RETRY_SECONDS)


def _open_gate(path: Path) -> int:
    """The hand-over pipe, open read-write so the job's open never waits and a supervisor that dies leaves
    it an end of file. Only its supervisor writes it (the job reads)."""
    with contextlib.suppress(FileExistsError):
        os.mkfifo(path, 0o644)
    return os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)


def _open_pipe(path: Path) -> int:
    """The work-ended pipe (the worker made it), open for reading; read-write so a writer closing it
    never reads as an end."""
    with contextlib.suppress(FileExistsError):
        os.mkfifo(path, 0o622)
    return os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)


def _signal_pipe(stop: threading.Event) -> int:
    """SIGTERM asks for a stop; SIGCHLD wakes the loop; the terminal's signals are not the supervisor's."""
    read, write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(write)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    for ignored in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(ignored, signal.SIG_IGN)
    return read


def _serve_gateway(spec: Spec, ending: threading.Event) -> Gateway | None:
    """The run's API gateway on the socket the worker made (None: the job talks to no Prefect API); its
    run may end once ``ending`` is set."""
    if spec.api_upstream is None or spec.api_socket_fd is None:
        return None
    listening = socket.socket(fileno=spec.api_socket_fd)
    os.set_inheritable(listening.fileno(), False)  # the work never holds it
    gateway = Gateway(listening, spec.api_upstream, spec.run_id, auth_header(spec.api_key, spec.api_auth_string),
                      token=spec.api_key or spec.api_auth_string)
    gateway.work_ending = ending
    gateway.serve()
    return gateway


def _fence(spec: Spec, folder: RunFolder) -> Beating | None:
    """The run's heartbeats (a thread, started once the work is) and its fence keeper (a process of its own, so
    that the work stops at the lease's end even if this supervisor is stopped); None where the run has no
    Prefect API or its pool judges no lost hosts (``E31_HOST_LOST_SECONDS=0``)."""
    if not spec.api_upstream or not spec.host or spec.host_lost_seconds <= 0:
        return None
    from e31_prefect.model.attempts import beat_seconds, fence_seconds

    api = ApiVariables(spec.api_upstream, auth_header(spec.api_key, spec.api_auth_string))
    beating = Beating(folder.path, api, spec.host, spec.host_lost_seconds, beat_seconds(spec.host_lost_seconds),
                      fence_seconds(spec.host_lost_seconds), Path(spec.host_beat_file) if spec.host_beat_file else None)
    _start_keeper(folder)
    return beating


def _start_keeper(folder: RunFolder) -> None:
    """The run's fence keeper (:mod:`e31_prefect.host.fence`), forked from this supervisor while it is still
    single-threaded: its modules are loaded already, so it costs no interpreter start. It keeps none of the
    supervisor's descriptors (its control socket, its pipes) and writes only to the supervisor's log."""
    log = os.open(folder.supervisor_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if os.fork() == 0:
            code = 70
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                null = os.open(os.devnull, os.O_RDWR)
                os.dup2(null, 0)
                os.dup2(null, 1)
                os.dup2(log, 2)
                os.closerange(3, os.sysconf("SC_OPEN_MAX"))
                os.chdir("/")
                # Named as the keeper it is, never as a run's supervisor (whose command line names a lock's holder).
                retitle([sys.executable, "-m", fence_keeper.__name__, str(folder.path)])
                code = fence_keeper.main([str(folder.path)])
            finally:
                os._exit(code)  # nothing of the supervisor's (its exit handlers, its buffers) runs twice
    finally:
        os.close(log)


def _become_subreaper() -> None:
    # The work's orphans (a double-forked daemon) are reparented here, not to init: the
    # supervisor can find and kill them where the host gives it no cgroup.
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _control() -> Control:
    """The worker's control socket (stdin); none where stdin is no socket (a supervisor started by hand)."""
    try:
        sock = socket.socket(fileno=os.dup(0))
    except OSError:
        return Control(None)
    if sock.family != socket.AF_UNIX:
        sock.detach()
        return Control(None)
    return Control(sock)


def main(argv: list[str] | None = None) -> int:
    """Supervise the run whose ledger folder is the first argument."""
    argv = sys.argv[1:] if argv is None else argv
    folder = RunFolder(Path(argv[0]))
    spec = folder.spec()
    if spec is None:
        print(f"no readable spec.json in {folder.path}", file=sys.stderr)
        return 2
    pid, started = this_process()
    record = Record(supervisor_pid=pid, supervisor_started=started)
    folder.write_record(record)
    stop = threading.Event()
    wake = _signal_pipe(stop)  # before anything else: a cancel may come while the work starts
    _become_subreaper()
    control = _control()
    if spec.runtime == "container":  # the worker names the container it started first (none: it started none)
        named = (control.first() or {}).get("container")
        work: Work = ContainerWork(spec, [named] if named else [], log=folder.output_log)
    else:
        work = ProcessWork(spec, folder, record)
    return Supervisor(folder, spec, work, record, stop, wake, control).run()


if __name__ == "__main__":
    sys.exit(main())
