"""Start a job's shards as processes over its device slots, as :class:`~e31_prefect.shards.Schedule` says.

The built-in command flow (:mod:`e31_prefect.command_flow`) calls :func:`run_shards`
for a job with ``work.shards``. Each shard is a child of the flow's process, so the
run's supervisor owns it: the time limit and a cancellation stop every shard.
Each shard writes its output (stdout and stderr) to ``shard-<index>/shard.log``
in the job's output dir, next to what it writes there itself (no log where it
printed nothing).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from e31_prefect.ledger import output_tail
from e31_prefect.shards import Progress, Schedule, ShardSettings, shard_environment, shard_folder, slots

SHARD_LOG = "shard.log"
PROGRESS_EVERY_S = 2.0  # how often the progress callback runs while shards run


class NoDevicesForShards(RuntimeError):
    """The job sees fewer devices than one shard needs."""


def program(command: Sequence[str]) -> list[str]:
    """The argv to start: ``python`` means the job's own interpreter, as in the command flow."""
    return [sys.executable, *command[1:]] if command[0] in ("python", "python3") else list(command)


def job_devices(env: Mapping[str, str]) -> list[str]:
    """The job's devices, as its ``CUDA_VISIBLE_DEVICES`` names them (the worker set it to the rented ones)."""
    return [entry for entry in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]


def run_shards(command: Sequence[str], settings: ShardSettings, env: Mapping[str, str], output_dir: Path,
               on_progress: Callable[[Progress], None] = lambda progress: None,
               on_finish: Callable[[int, str, Schedule], None] = lambda shard, outcome, schedule: None) -> Schedule:
    """Run every shard of ``command`` over the job's slots; returns the schedule once it is over.

    ``env`` is the job's environment; each shard gets it with its index, devices and folder. ``on_progress``
    is called every ``PROGRESS_EVERY_S`` seconds and once at the end; ``on_finish`` after each attempt
    (``done``, ``retry`` or ``failed``), under the schedule's lock.
    """
    # A slot is a thread: never more than there are shards to run.
    places = slots(job_devices(env), settings.gpus_per_shard, settings.shards_per_gpu)[:settings.count]
    if not places:
        raise NoDevicesForShards(f"each shard needs {settings.gpus_per_shard} GPU(s) and the job sees "
                                 f"{len(job_devices(env))} ({env.get('CUDA_VISIBLE_DEVICES', '')!r})")
    schedule = Schedule(settings.count, settings.retries, settings.allowed_failures)
    argv = program(command)
    changed = threading.Condition()
    errors: list[BaseException] = []
    started = time.monotonic()

    def attempt(shard: int, devices: tuple[str, ...]) -> tuple[int, str]:
        folder = output_dir / shard_folder(shard)
        folder.mkdir(parents=True, exist_ok=True)
        log_path = folder / SHARD_LOG
        with open(log_path, "ab") as log:
            if schedule.attempts[shard] > 1:
                log.write(f"--- e31: attempt {schedule.attempts[shard]} of shard {shard} ---\n".encode())
                log.flush()
            shard_env = {**env, **shard_environment(shard, settings.count, devices, str(folder))}
            try:
                code = subprocess.call(argv, env=shard_env, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT)
            except OSError as exc:  # a program that does not exist fails its shard, as a shell's 127 would
                log.write(f"e31: cannot start {argv[0]}: {exc.strerror or exc}\n".encode())
                code = 127
        tail = output_tail(log_path) if code else ""
        if log_path.stat().st_size == 0:
            log_path.unlink()  # a shard that said nothing leaves no log: ten thousand empty files help no one
        return code, tail

    def serve(slot: int, devices: tuple[str, ...]) -> None:
        try:
            while True:
                with changed:
                    while (shard := schedule.take(slot)) is None:
                        if schedule.over:
                            return
                        changed.wait()
                code, tail = attempt(shard, devices)
                with changed:
                    outcome = schedule.finish(shard, code, tail)
                    on_finish(shard, outcome, schedule)
                    changed.notify_all()
        except BaseException as exc:  # a broken slot must not leave the others waiting forever
            with changed:
                errors.append(exc)
                schedule.pending.clear()
                schedule.running.pop(next((s for s, at in schedule.running.items() if at == slot), -1), None)
                changed.notify_all()

    threads = [threading.Thread(target=serve, args=(n, devices), name=f"e31-shard-slot-{n}", daemon=True)
               for n, devices in enumerate(places)]
    for thread in threads:
        thread.start()
    while alive := [thread for thread in threads if thread.is_alive()]:
        alive[0].join(PROGRESS_EVERY_S)
        with changed:
            progress = schedule.progress(time.monotonic() - started)
        on_progress(progress)
    on_progress(schedule.progress(time.monotonic() - started))  # the final counts, whatever the timing
    if errors:
        raise errors[0]
    return schedule
