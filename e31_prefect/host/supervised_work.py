"""The work a run's supervisor owns: a process in the run's cgroup (:class:`ProcessWork`) or a container
(:class:`ContainerWork`), how it is started, ended and reaped, and how it exited (:class:`Exit`).

Only the standard library (and the Docker client for containers): it runs in the supervisor.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from e31_prefect.host import cgroups, job_init, job_users, leftovers, sandbox, warm_requests
from e31_prefect.host.device_fence import DeviceFence
from e31_prefect.host.ledger import Record, RunFolder, Spec, now
from e31_prefect.host.warm_requests import ForkedProcess, NotServed

GRACE_POLL_SECONDS = 0.05  # how often, in a stop, the supervisor looks for a job's processes still ending
KILL_WAIT_SECONDS = 10.0  # a killed process is gone in milliseconds; one in uninterruptible sleep may take longer


@dataclass
class Exit:
    """How the work ended: its exit code, when, and whether it was killed at its memory limit."""

    code: int
    at: datetime
    out_of_memory: bool = False


class Work(Protocol):
    """What the supervisor supervises: a process group in a cgroup, or a container."""

    def start(self) -> str | None:
        """Start it; its pid or container id (None: it never started)."""

    def fileno(self) -> int:
        """A file that becomes readable when the work ends."""

    def ended(self) -> Exit | None:
        """Its exit, once it ended (call when :meth:`fileno` is readable, or any time)."""

    def terminate(self, grace_seconds: float) -> None:
        """Ask every process of the work to stop (SIGTERM, or docker stop)."""

    def kill(self) -> None:
        """Kill every process of the work, now."""

    def stop_all(self, grace_until: datetime | None = None) -> datetime:
        """After its main process ended: every process of the work killed. In a stop whose grace runs until
        ``grace_until``, its other processes got the same SIGTERM as the main one and have until then to end
        on their own. Returns when its last process was gone: from then no process of the job can use its
        devices."""

    def open_devices(self, minors: list[int]) -> list[str]:
        """At the hand-over, before the work hears of it: open the rented GPUs (their minor numbers) to it;
        what to tell the operator. Raises OSError where they could not be opened."""

    def clean_up(self) -> None:
        """After the end: nothing of the work is left (processes, cgroup, container, its uid's files)."""


class ProcessWork:
    """The work as a process in a session and cgroup of its own; the supervisor is its subreaper."""

    def __init__(self, spec: Spec, folder: RunFolder, record: Record):
        self.spec = spec
        self.log = folder.output_log
        self.ledger_folder = folder.path
        self.record = record
        # Named by host too: two e31 hosts on one machine may hold attempts of one run (one lost, one new), and
        # a fence keeper that kills its attempt's group must never reach the other's.
        name = f"run-{spec.host}-{spec.run_id}" if spec.host else f"run-{spec.run_id}"
        self.group = cgroups.RunGroup.create(name, spec.memory_bytes, spec.pids_limit,
                                             None if spec.cgroups else cgroups.Mounts())
        record.cgroup = str(self.group.v2) if self.group.v2 else None
        # No GPU node opens to the work until its hand-over, from its first instruction on.
        self.fence = DeviceFence.create(self.group.v2, self.group.v1.get("devices"), Path(spec.device_table))
        record.limits = {**self.group.limits, "devices": self.fence.enforced}
        record.notes += self.group.why + self.fence.why
        self.process: subprocess.Popen[bytes] | ForkedProcess | None = None
        self._user: job_users.JobUser | None = None
        self._pidfd = -1
        self._init: int | None = None  # the PID 1 of the job's own PID namespace, where it has one
        # The host's world-writable folders as its start found them: the end sweeps the uid's files there (one
        # made world-writable since is swept when the uid is claimed next, before another job has it).
        self._searched: list[Path] | None = None
        self._exit: Exit | None = None

    def start(self) -> str | None:
        # The host's world-writable folders (milliseconds): the job gets private ones in their place.
        self._searched = leftovers.world_writable() if self.spec.job_view else None
        temps = self._searched or []
        files, private, uid = self.group.join_files, self.spec.private_network, self._job_uid(temps)
        view = sandbox.plan_view(map(Path, self.spec.job_view), temps=temps, hides=map(Path, self.spec.job_hidden),
                                 temp_bytes=self.spec.job_temp_bytes) if self.spec.job_view else None

        def become_job_user() -> None:
            if uid is not None:
                leftovers.become(uid)

        def before_exec() -> None:  # as root, in the child: its cgroup, its namespaces, then its user
            if files:
                cgroups.join(files)
            sandbox.enter(view, private)
            become_job_user()

        def init_before_exec() -> None:  # the same, and the PID namespace's own /proc, mounted as root
            if files:
                cgroups.join(files)
            sandbox.enter(view, private)
            sandbox.own_proc()
            os.chdir("/")  # no handle on a host folder under the view's covers, for the job's user to follow
            become_job_user()

        if view is None:  # no root to give it namespaces of its own (E31_JOB_USERS=worker): as it always was
            self.process = self._popen(self.spec.argv, self.spec.env, self.spec.cwd,
                                       before_exec if files or private or uid is not None else None)
            self._pidfd = os.pidfd_open(self.process.pid)
        else:
            self.process = self._start_beside_init(init_before_exec, files, uid, become_job_user)
            self._pidfd = (self.process.pidfd if isinstance(self.process, ForkedProcess)
                           else os.pidfd_open(self.process.pid))
        return str(self.process.pid)

    def _start_beside_init(self, init_before_exec: Callable[[], None], files: list[Path], uid: int | None,
                           become_job_user: Callable[[], None]) -> subprocess.Popen[bytes] | ForkedProcess:
        """The job's process in a PID namespace of its own, beside the namespace's init (returned: the job's).

        The init is forked first, so it is PID 1: it enters the job's cgroup and namespaces, mounts the
        namespace's /proc, becomes the job's user and execs :mod:`e31_prefect.host.job_init`, which reaps
        the job's orphans. The job's process comes next, into the same PID namespace, joining the init's
        other namespaces: forked by the host's warm interpreter, with Prefect loaded
        (:mod:`e31_prefect.host.warm_interpreter`), or else as this supervisor's child, a new interpreter.
        Neither holds the supervisor's memory (its Prefect API key) or runs anything of the job's before
        it is the job's user in the job's namespaces.
        """
        with sandbox.own_pids():
            init = self._popen([sys.executable, "-I", "-S", job_init.__file__], {}, "/", init_before_exec)
            self._init = init.pid
            try:
                namespaces = sandbox.namespaces_of(init.pid)
                try:
                    if self.spec.warm_interpreter:
                        with contextlib.suppress(NotServed):
                            return self._fork_warm(Path(self.spec.warm_interpreter), init.pid, namespaces,
                                                   files, uid)

                    def before_exec() -> None:  # as root, in the child: its cgroup, the init's namespaces, its user
                        if files:
                            cgroups.join(files)
                        sandbox.join(namespaces, self.spec.cwd)
                        become_job_user()

                    return self._popen(self.spec.argv, self.spec.env, self.spec.cwd, before_exec)
                finally:
                    for handle, _ in namespaces:
                        os.close(handle)
            except BaseException:
                init.kill()  # the namespace goes with it
                init.wait()
                raise

    def _fork_warm(self, path: Path, init: int, namespaces: list[tuple[int, int]], files: list[Path],
                   uid: int | None) -> ForkedProcess:
        """The job's process forked by the host's warm interpreter into the init's PID namespace, joining its
        other namespaces (NotServed: none answered, nothing started)."""
        pid_namespace = os.open(sandbox.PROC / str(init) / "ns" / "pid", os.O_RDONLY | os.O_CLOEXEC)
        try:
            with open(self.log, "ab") as out:
                request = warm_requests.Request(
                    env=self.spec.env, cwd=self.spec.cwd, uid=uid, cgroup_files=[str(f) for f in files],
                    namespaces=[sandbox.CLONE_NEWPID, *(flag for _, flag in namespaces)])
                forked = warm_requests.fork_entry(path, request, out.fileno(),
                                                     [pid_namespace, *(handle for handle, _ in namespaces)])
        finally:
            os.close(pid_namespace)
        self.record.warm = True
        return forked

    def _popen(self, argv: list[str], env: dict[str, str], cwd: str | None,
               before_exec: Callable[[], None] | None) -> subprocess.Popen[bytes]:
        """A child in a session of its own, its output in the run's log."""
        with open(self.log, "ab") as out:
            return subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=before_exec)

    def _job_uid(self, world_writable: list[Path]) -> int | None:
        """The uid of the job's own (held by this supervisor until it exits), its folders handed over, and
        nothing left on the host by an earlier job of that uid whose supervisor died before it swept."""
        if not self.spec.job_user_locks:
            return None
        first, last = self.spec.job_uids
        user = job_users.claim(Path(self.spec.job_user_locks), range(first, last + 1))
        if user is None:
            raise RuntimeError(f"every job uid of this host ({first}-{last}) is held by a running job")
        self._user = user  # its lock stays open as long as the supervisor runs
        self.record.notes += leftovers.sweep(user.uid, world_writable)
        job_users.hand_over(user.uid, Path(self.spec.cwd or "."), [Path(p) for p in self.spec.job_writable],
                            self.ledger_folder)
        self.record.job_user = user.uid
        return user.uid

    def open_devices(self, minors: list[int]) -> list[str]:
        return self.fence.open_gpus(minors)

    def fileno(self) -> int:
        return self._pidfd

    def ended(self) -> Exit | None:
        if isinstance(self.process, ForkedProcess):  # its launcher's child: the launcher says how it exited
            reap()
            code = self.process.poll() if self._exit is None else None
            if code is not None:
                self._exit = Exit(code, now(), self.group.out_of_memory())
        elif self._exit is None and self.process is not None:
            reap(but=self.process.pid)
            try:
                pid, status = os.waitpid(self.process.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.process.pid, 0
            if pid:
                # The process was reaped here, not by Popen: tell it, so it never waits on a reused pid.
                self.process.returncode = os.waitstatus_to_exitcode(status)
                self._exit = Exit(self.process.returncode, now(), self.group.out_of_memory())
        return self._exit

    def terminate(self, grace_seconds: float) -> None:
        if isinstance(self.process, ForkedProcess):
            self.process.send_signal(signal.SIGTERM)
        for pid in self._everyone():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)

    def kill(self) -> None:
        self.group.kill()
        forked = self.process if isinstance(self.process, ForkedProcess) else None
        if forked is not None:  # not a descendant of this supervisor: killed by its pidfd, and waited for
            forked.send_signal(signal.SIGKILL)
            forked.wait_gone(KILL_WAIT_SECONDS)
            self.ended()
        main = self.process.pid if self.process is not None and forked is None else None
        for _ in range(100):  # without a cgroup, its processes are ours to find, reparented or not
            left = _descendants(os.getpid())
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            # The main process's status is the run's exit code: kept as it is reaped, at once, since the init of
            # its PID namespace, killed beside it, ends only once it is.
            self.ended()
            reap(but=None if self._exit else main)
            time.sleep(0.01)

    def stop_all(self, grace_until: datetime | None = None) -> datetime:
        # A main process that ends at once on its SIGTERM does not cut its children's grace short: each one
        # may still be saving its work when the main one is gone (a loaded host runs their handlers late).
        while grace_until is not None and now() < grace_until and self._others_running():
            time.sleep(GRACE_POLL_SECONDS)
        self.kill()
        return now()

    def _others_running(self) -> bool:
        """After its main process ended: whether another process of the job still runs. In its own PID
        namespace, every process left is its init's (orphans are reparented there); otherwise its cgroup's
        (with neither, nothing tells the job's processes from the supervisor's own: none is waited for)."""
        if self._init is not None:
            return bool(_descendants(self._init))
        main = self.process.pid if self.process is not None else None
        return bool(self.group.pids() - {main})

    def clean_up(self) -> None:
        self.kill()
        reap()
        self.group.remove()
        self.fence.close()
        if self._user is not None:  # before the uid goes back (this supervisor's exit): nothing of it stays
            searched = self._searched if self._searched is not None else leftovers.world_writable()
            self.record.notes += leftovers.sweep(self._user.uid, searched)
        if isinstance(self.process, ForkedProcess):
            self.process.close()  # its pidfd is this work's
        else:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)

    def _everyone(self) -> set[int]:
        return self.group.pids() | _descendants(os.getpid())


class ContainerWork:
    """The work as a container the worker created and started; the supervisor watches, stops and removes it.

    Docker keeps the container's own start, end, exit code and memory kill; the supervisor adds
    the time limit, the stop when asked, and a stop that escalates (stop, kill, remove) so a
    container that will not stop never bills past its limit and grace.
    """

    def __init__(self, spec: Spec, names: list[str], client: Any = None, log: Path | None = None):
        self.log = log
        if client is None:
            import docker

            client = docker.from_env(timeout=30)
        self.spec = spec
        self.client = client
        self.api = client.api
        self.id: str | None = next(iter(names), None)
        self._read, self._write = os.pipe()
        self._exit: Exit | None = None
        self._stopping: threading.Thread | None = None

    def start(self) -> str | None:
        if self.id is None and self.spec.container_label:
            # The worker never named it (it died or failed first): one may exist, under the run's label.
            found = self.api.containers(all=True, filters={"label": self.spec.container_label})
            self.id = found[0]["Id"] if found else None
        if self.id is None:
            return None
        threading.Thread(target=self._wait, daemon=True).start()
        if self.spec.container_logs and self.log is not None:
            threading.Thread(target=self._copy_output, daemon=True).start()
        return self.id

    def _copy_output(self) -> None:
        """The container's output, as it comes, into the run's output log."""
        with contextlib.suppress(Exception), open(self.log, "ab") as out:
            for chunk in self.api.logs(self.id, stream=True, follow=True):
                out.write(chunk)
                out.flush()

    def _wait(self) -> None:
        import docker.errors
        import requests.exceptions

        while True:
            try:
                self.api.wait(self.id, timeout=30)
                break
            except requests.exceptions.RequestException:
                continue  # the wait timed out or the engine restarted: wait again
            except docker.errors.NotFound:
                break
            except docker.errors.APIError:
                time.sleep(1)
        os.write(self._write, b"x")

    def open_devices(self, minors: list[int]) -> list[str]:
        return []  # Docker gave the container its devices as it created it (device requests)

    def fileno(self) -> int:
        return self._read

    def ended(self) -> Exit | None:
        if self._exit is None:
            state = self._state()
            if state is not None and state.get("Status") in ("running", "restarting", "created", "paused"):
                return None
            state = state or {}
            finished = _docker_time(state.get("FinishedAt")) or now()
            self._exit = Exit(int(state.get("ExitCode", -1)), finished, bool(state.get("OOMKilled")))
        return self._exit

    def _state(self) -> dict | None:
        import docker.errors

        try:
            return self.api.inspect_container(self.id)["State"]
        except docker.errors.NotFound:
            return None
        except Exception:
            return {"Status": "running"}  # the engine does not answer: assume the worst, ask again

    def terminate(self, grace_seconds: float) -> None:
        if self._stopping is None or not self._stopping.is_alive():
            self._stopping = threading.Thread(target=self._stop, args=(grace_seconds,), daemon=True)
            self._stopping.start()

    def _stop(self, grace_seconds: float) -> None:
        with contextlib.suppress(Exception):
            self.api.stop(self.id, timeout=max(1, round(grace_seconds)))
            return
        self.kill()

    def kill(self) -> None:
        for action in (lambda: self.api.kill(self.id), lambda: self.api.remove_container(self.id, force=True)):
            with contextlib.suppress(Exception):
                action()
                return

    def stop_all(self, grace_until: datetime | None = None) -> datetime:
        # Docker ends every process of a container with its first: they were gone when it finished.
        return self._exit.at if self._exit is not None else now()

    def clean_up(self) -> None:
        with contextlib.suppress(Exception):
            self.api.remove_container(self.id, force=True)
        self.client.close()


def _docker_time(text: str | None) -> datetime | None:
    """Docker's RFC 3339 times (nanoseconds); None for its zero time."""
    if not text or text.startswith("0001-"):
        return None
    head, _, rest = text.partition(".")
    fraction = "".join(c for c in rest if c.isdigit())[:6]
    zone = "+00:00" if rest.endswith("Z") or text.endswith("Z") else rest[len(fraction):][-6:]
    try:
        return datetime.fromisoformat(f"{head}.{fraction or '0'}{zone}").astimezone(timezone.utc)
    except ValueError:
        return None


def _descendants(root: int) -> set[int]:
    """Every live process below ``root`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = leftovers.read_small(f"/proc/{entry}/stat").rpartition(b")")[2].split(None, 2)
        if len(stat) < 2:
            continue  # gone
        if stat[0] not in (b"Z", b"X") or _threads_live(entry):
            children.setdefault(int(stat[1]), []).append(int(entry))
    found: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _threads_live(pid: str) -> bool:
    """Whether a process /proc shows as a zombie still has live threads: its main thread exited while others
    work on (a cgroup's kill misses them; a SIGKILL to the process ends them all)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return any(line.startswith("Threads:") and int(line.split()[1]) > 1 for line in status)
    except (OSError, ValueError):
        return False


def reap(but: int | None = None) -> None:
    """Reap every exited child (orphans of the work are reparented here), except ``but``, left for its owner."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid == but:
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, 0)
