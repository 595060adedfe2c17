"""Start a job's shards as processes over its device slots, as :class:`~e31_prefect.model.shards.Schedule` says.

    python -m e31_prefect.flows.shard_runner JOURNAL       # the shards' runner, started by the job's own process

The built-in command flow (:mod:`e31_prefect.flows.command_flow`) starts the runner for a
job with ``work.shards`` (:class:`ShardProcess`) and follows it. The runner and each
shard descend from the work's process, so the run's supervisor owns them: the time
limit and a cancellation stop every shard. Each shard writes its output (stdout and
stderr) to ``shard-<index>/shard.log`` in the job's output dir, next to what it
writes there itself (no log where it printed nothing).

A sharded command's shards start as the work starts: the job's entry calls
:func:`start_early` before it loads Prefect, which takes seconds while every
rented GPU would sit idle. The command flow then takes that runner
(:func:`take_early`) and follows it. Where the worker could not say the command
beforehand (a sharded flow, a deployment whose pull steps make its folder), the
flow starts the runner itself.

Only the standard library: it runs before Prefect is imported. A shard costs
little more than the process itself (the shards' benchmark,
``benchmarks/arrays.py``, compares it with ``xargs -P``): it is spawned with
``posix_spawn``, its program found once, and its log is its slot's file, named
``shard.log`` only if the shard wrote to it (:class:`SlotLog`).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, NamedTuple

from e31_prefect.dirs import OUTPUT_DIR_VARIABLE
from e31_prefect.host.ledger import output_tail
from e31_prefect.model.shards import (
    SHARDS_VARIABLE,
    Failure,
    Outcome,
    Progress,
    Schedule,
    ShardSettings,
    shard_environment,
    shard_folder,
    slots,
)

SHARD_LOG = "shard.log"
DEFAULT_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)  # ignored by Python, restored for a shard as subprocess does
PROGRESS_EVERY_S = 2.0  # how often a follower hears of progress while shards run
STOP_GRACE_S = 10.0  # a stopped runner has this long to stop its shards


class NoDevicesForShards(RuntimeError):
    """The job sees fewer devices than one shard needs."""


class Attempt(NamedTuple):
    """How one attempt of a shard ended: ``done``, ``retry`` or ``failed``, which attempt it was, and for a
    shard failed for good, its failure."""

    shard: int
    outcome: str
    number: int
    failure: Failure | None = None


def program(command: Sequence[str]) -> list[str]:
    """The argv to start: ``python`` means the job's own interpreter, as in the command flow."""
    return [sys.executable, *command[1:]] if command[0] in ("python", "python3") else list(command)


def job_devices(env: Mapping[str, str]) -> list[str]:
    """The job's devices, as its ``CUDA_VISIBLE_DEVICES`` names them (the worker set it to the rented ones)."""
    return [entry for entry in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]


class SlotLog:
    """A slot's log file, where each of its shards writes its output (stdout and stderr).

    It is reused while its shards print nothing: ten thousand quiet shards cost no file names and leave
    no empty files. Once a shard has printed, or left a process in its process group that still could,
    the file becomes that shard's ``shard.log`` (an attempt after the first: appended to it, or kept as
    ``shard.log.<attempt>`` if it left a process) and the slot takes a new one. A process that left the
    shard's process group (``setsid``, as a daemon does) is not seen: if it keeps the shard's output
    open and writes to it later, its lines land in a later shard's log on the same slot.
    """

    def __init__(self, output_dir: str, slot: int):
        self.path = f"{output_dir}/.e31-shard-slot-{slot}.log"
        self.fd = self._open()

    def _open(self) -> int:
        return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)

    def write(self, text: str) -> None:
        """Add a line of e31's own (a retry's header, why a program did not start)."""
        os.write(self.fd, text.encode())

    def hand_over(self, shard_log: str, number: int, left_behind: bool) -> str | None:
        """After attempt ``number`` of a shard: its output goes to ``shard_log`` (after an earlier attempt's);
        returns the path of what it wrote, None if it wrote nothing."""
        written = os.fstat(self.fd).st_size > 0
        if not written and not left_behind:
            return None
        if not os.path.exists(shard_log):
            os.rename(self.path, shard_log)  # a process left behind still writes to its own shard's log
        elif left_behind:  # a retry that left a process: its own file, which that process goes on writing to
            shard_log = f"{shard_log}.{number}"
            os.rename(self.path, shard_log)
        else:  # a retry: its output follows the earlier attempts'
            os.lseek(self.fd, 0, os.SEEK_SET)
            with open(shard_log, "ab") as log, open(os.dup(self.fd), "rb") as attempt:
                shutil.copyfileobj(attempt, log)
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = self._open()
        return shard_log if written else None

    def close(self) -> None:
        """The slot is done: nothing of it is left in the output dir."""
        os.close(self.fd)
        os.unlink(self.path)


def left_behind(group: int) -> bool:
    """Whether a process of the shard whose process group is ``group`` still runs (the shard has exited)."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class Launcher:
    """Starts one attempt of a shard: its folder, its environment, its process on its slot's devices."""

    def __init__(self, command: Sequence[str], count: int, env: Mapping[str, str], output_dir: str):
        self.argv = program(command)
        # Found once, on the job's PATH (as a shell would), not searched again for each of ten thousand shards;
        # a name found nowhere is not run from the current folder either.
        found = shutil.which(self.argv[0], path=env.get("PATH", os.defpath))
        self.executable = found or (self.argv[0] if "/" in self.argv[0] else None)
        self.count = count
        self.env = dict(env)
        self.output_dir = output_dir
        self.stdin = os.open(os.devnull, os.O_RDONLY)

    def folder(self, shard: int) -> str:
        """The shard's folder in the output dir."""
        return f"{self.output_dir}/{shard_folder(shard)}"

    def start(self, shard: int, number: int, devices: tuple[str, ...], log: SlotLog) -> int | None:
        """Start attempt ``number`` of ``shard``, its output to ``log``; its pid, or None where the program
        could not start (said in ``log``)."""
        folder = self.folder(shard)
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder)
        if number > 1:
            log.write(f"--- e31: attempt {number} of shard {shard} ---\n")
        env = {**self.env, **shard_environment(shard, self.count, devices, folder)}
        if self.executable is None:  # a program that does not exist fails its shard, as a shell's 127 would
            log.write(f"e31: cannot start {self.argv[0]}: not found on PATH\n")
            return None
        try:
            # A process group of its own: what the shard leaves running is seen (left_behind). The signals
            # Python ignores (a closed pipe, a file too big) are the shard's to get, as from a shell.
            return os.posix_spawn(self.executable, self.argv, env, setpgroup=0, setsigdef=DEFAULT_SIGNALS,
                                  file_actions=[(os.POSIX_SPAWN_DUP2, self.stdin, 0),
                                                (os.POSIX_SPAWN_DUP2, log.fd, 1), (os.POSIX_SPAWN_DUP2, log.fd, 2)])
        except OSError as exc:
            log.write(f"e31: cannot start {self.argv[0]}: {exc.strerror or exc}\n")
            return None

    def close(self) -> None:
        """Done starting shards."""
        os.close(self.stdin)


class Running(NamedTuple):
    """A shard's attempt that runs now: its process, and where."""

    pid: int
    shard: int
    number: int
    slot: int


def run_shards(command: Sequence[str], settings: ShardSettings, env: Mapping[str, str], output_dir: Path,
               on_progress: Callable[[Progress], None] = lambda progress: None,
               on_attempt: Callable[[Attempt], None] = lambda attempt: None) -> Schedule:
    """Run every shard of ``command`` over the job's slots to the end; returns the schedule once it is over.

    ``env`` is the job's environment; each shard gets it with its index, devices and folder, and runs in
    the current folder. ``on_attempt`` hears of each attempt that ended, ``on_progress`` of the counts
    every ``PROGRESS_EVERY_S`` seconds and once at the end.

    One thread starts every shard and waits for them all (xargs's way): slots as threads of one Python
    process would queue for its interpreter lock between two shards, and on a busy host leave devices idle.
    """
    places = slots(job_devices(env), settings.gpus_per_shard, settings.shards_per_gpu)[:settings.count]
    if not places:
        raise NoDevicesForShards(f"each shard needs {settings.gpus_per_shard} GPU(s) and the job sees "
                                 f"{len(job_devices(env))} ({env.get('CUDA_VISIBLE_DEVICES', '')!r})")
    schedule = Schedule(settings.count, settings.retries, settings.allowed_failures)
    os.makedirs(output_dir, exist_ok=True)
    launcher = Launcher(command, settings.count, env, str(output_dir))
    logs = [SlotLog(str(output_dir), slot) for slot in range(len(places))]
    free = list(reversed(range(len(places))))  # the lowest slot first
    running: dict[int, Running] = {}  # by the pidfd that says when the process ended
    ends = select.poll()
    started = reported = time.monotonic()

    def finish(shard: int, number: int, slot: int, code: int, left: bool) -> None:
        kept = logs[slot].hand_over(f"{launcher.folder(shard)}/{SHARD_LOG}", number, left)
        if not kept and not left:
            # A quiet shard leaves no empty folder: a hundred thousand of them would fill the output dir's bound
            # on files with nothing. A folder the shard wrote in is not empty, and stays.
            with contextlib.suppress(OSError):
                os.rmdir(launcher.folder(shard))
        outcome = schedule.finish(shard, code, output_tail(Path(kept)) if code and kept else "")
        free.append(slot)
        on_attempt(Attempt(shard, outcome, number, schedule.failures.get(shard)))

    try:
        while True:
            while free and (shard := schedule.take(free[-1])) is not None:
                slot = free.pop()
                number = schedule.attempts[shard]
                pid = launcher.start(shard, number, places[slot], logs[slot])
                if pid is None:
                    finish(shard, number, slot, 127, False)
                    continue
                try:
                    pidfd = os.pidfd_open(pid)
                except OSError:  # not followed, so not left running
                    os.killpg(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    raise
                running[pidfd] = Running(pid, shard, number, slot)
                ends.register(pidfd, select.POLLIN)
            if not running:
                break
            for pidfd, _ in ends.poll(max(0.0, reported + PROGRESS_EVERY_S - time.monotonic()) * 1000):
                ended = running.pop(pidfd)
                ends.unregister(pidfd)
                os.close(pidfd)
                code = os.waitstatus_to_exitcode(os.waitpid(ended.pid, 0)[1])
                finish(ended.shard, ended.number, ended.slot, code, left_behind(ended.pid))
            if time.monotonic() - reported >= PROGRESS_EVERY_S:
                reported = time.monotonic()
                on_progress(schedule.progress(reported - started))
    finally:
        for ended in running.values():  # only where this failed or was stopped: its shards stop with it
            with contextlib.suppress(OSError):
                os.killpg(ended.pid, signal.SIGTERM)
        for log in logs:
            log.close()
        launcher.close()
    on_progress(schedule.progress(time.monotonic() - started))  # the final counts, whatever the timing
    return schedule


class ShardsRunnerFailed(RuntimeError):
    """The shards' runner could not run them (too few devices), or ended before they did."""


class ShardProcess:
    """The shards' runner as a process of its own, followed from the flow through its journal.

    A process, not threads of the flow's: they would share one interpreter lock, and Prefect loading or
    reporting in the flow would stall every slot between two shards (and the other way round). The
    runner writes a line of JSON to its journal for each progress, each retried or failed shard, and at
    the end; a file, so a flow busy elsewhere never holds the shards up.
    """

    def __init__(self, command: Sequence[str], settings: ShardSettings, env: Mapping[str, str],
                 cwd: str | None = None):
        self.command = list(command)
        self._folder = tempfile.mkdtemp(prefix="e31-shards-")  # the job's own: mode 0700
        self._journal = Path(self._folder) / "journal.jsonl"
        self._journal.touch()
        runner_env = {**env, SHARDS_VARIABLE: replace(settings, command=self.command).to_text()}
        self._process = subprocess.Popen([sys.executable, "-m", __name__, str(self._journal)], env=runner_env,
                                         cwd=cwd, stdin=subprocess.DEVNULL)
        self._offset = 0
        self._outcome: Outcome | None = None
        self._error: str | None = None
        self.progress = Progress(count=settings.count, done=0, failed=0, running=0, elapsed_s=0.0)

    def follow(self, on_progress: Callable[[Progress], None] = lambda progress: None,
               on_attempt: Callable[[Attempt], None] = lambda attempt: None) -> Outcome:
        """Wait until the runner is done; returns how the shards ended. Callbacks as :func:`run_shards`,
        in the caller's thread. Raises :class:`ShardsRunnerFailed` if the runner could not finish; if following
        fails (the flow is stopped, a callback raises), the runner and its shards are stopped first."""
        try:
            while True:
                try:
                    code = self._process.wait(PROGRESS_EVERY_S)
                except subprocess.TimeoutExpired:
                    self._read(on_progress, on_attempt)
                    continue
                self._read(on_progress, on_attempt)
                break
        except BaseException:
            self.stop()
            raise
        finally:
            shutil.rmtree(self._folder, ignore_errors=True)
        if self._error is not None:
            raise ShardsRunnerFailed(self._error)
        if self._outcome is None:
            raise ShardsRunnerFailed(f"the shards' runner ended (exit status {code}) before the shards did")
        return self._outcome

    def stop(self) -> None:
        """Stop the runner, which stops the shards it runs (SIGTERM to each), and wait for it."""
        self._process.terminate()
        try:
            self._process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _read(self, on_progress: Callable[[Progress], None], on_attempt: Callable[[Attempt], None]) -> None:
        with open(self._journal, "rb") as journal:
            journal.seek(self._offset)
            text = journal.read()
        text = text[:text.rfind(b"\n") + 1]  # a line being written is read next time
        self._offset += len(text)
        for line in text.splitlines():
            event = json.loads(line)
            if "attempt" in event:
                shard, outcome, number, failure = event["attempt"]
                on_attempt(Attempt(shard, outcome, number, Failure(**failure) if failure else None))
            elif "progress" in event:
                self.progress = Progress(**event["progress"])
                on_progress(self.progress)
            elif "over" in event:
                self._outcome = Outcome.from_json(event["over"])
            elif "error" in event:
                self._error = event["error"]


def main(argv: Sequence[str] | None = None) -> int:
    """The shards' runner: ``python -m e31_prefect.flows.shard_runner JOURNAL``, the shards and their command in
    ``E31_SHARDS``, the job's output dir in ``E31_OUTPUT_DIR``; run in the folder the shards run in."""
    [journal_path] = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, _stop)  # stopped: its shards are stopped too (run_shards' finally)
    with open(journal_path, "a", buffering=1) as journal:
        def say(**event: Any) -> None:
            journal.write(json.dumps(event, separators=(",", ":")) + "\n")

        def attempt(ended: Attempt) -> None:
            if ended.outcome != "done":  # ten thousand lines of success say nothing the counts do not
                failure = asdict(ended.failure) if ended.failure else None
                say(attempt=[ended.shard, ended.outcome, ended.number, failure])

        try:
            settings = ShardSettings.from_text(os.environ[SHARDS_VARIABLE])
            assert settings.command is not None
            schedule = run_shards(settings.command, settings, os.environ, Path(os.environ[OUTPUT_DIR_VARIABLE]),
                                  on_progress=lambda progress: say(progress=asdict(progress)), on_attempt=attempt)
        except Exception as exc:
            say(error=str(exc))
            return 1
        say(over=schedule.outcome().to_json())
    return 0


def _stop(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


_early: list[ShardProcess | BaseException] = []  # the shards the job's entry started, or why it could not


def start_early(env: Mapping[str, str]) -> None:
    """Start the job's shards now, in their folder, where the worker named their command and folder in
    ``E31_SHARDS``; else do nothing. Never raises: :func:`take_early` raises what went wrong."""
    text = env.get(SHARDS_VARIABLE)
    settings = ShardSettings.from_text(text) if text else None
    if settings is None or settings.command is None or settings.folder is None:
        return
    try:
        _early.append(ShardProcess(settings.command, settings, env, cwd=settings.folder))
    except Exception as exc:
        _early.append(exc)


def take_early(command: Sequence[str]) -> ShardProcess | None:
    """The shards :func:`start_early` started for ``command`` (once), or None where it started none."""
    if not _early:
        return None
    early = _early.pop()
    if isinstance(early, BaseException):
        raise early
    if early.command != list(command):  # the run's parameters changed after the worker read them
        early.stop()
        raise RuntimeError(f"the shards started early run {early.command}, not the flow's {list(command)}")
    return early


if __name__ == "__main__":
    sys.exit(main())
