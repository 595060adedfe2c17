"""The process runtime: a flow run as a subprocess in its own session, stopped at its time limit.

The run gets its own process group, so everything it starts (a command, a
data loader's workers) is stopped with it: SIGTERM to the group, a grace
period, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcessOutcome:
    """How a run's process ended."""

    exit_code: int
    timed_out: bool


async def run_process(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    time_limit: float | None,
    grace_seconds: float,
    on_started: Callable[[int], None] = lambda pid: None,
) -> ProcessOutcome:
    """Run ``command`` until it exits or ``time_limit`` seconds pass, then stop its whole group.

    If the caller is cancelled the group is stopped too: no run outlives its worker's watch.
    """
    process = await asyncio.create_subprocess_exec(
        *command, env=dict(env), cwd=str(cwd), start_new_session=True
    )
    on_started(process.pid)
    timed_out = False
    try:
        await asyncio.wait_for(process.wait(), timeout=time_limit)
    except asyncio.TimeoutError:
        timed_out = True
        await stop_group(process, grace_seconds)
    except BaseException:
        await asyncio.shield(stop_group(process, grace_seconds))
        raise
    finally:
        # Whatever the leader left behind in its group goes with it.
        _signal_group(process.pid, signal.SIGKILL)
    return ProcessOutcome(exit_code=process.returncode if process.returncode is not None else -9,
                          timed_out=timed_out)


async def stop_group(process: asyncio.subprocess.Process, grace_seconds: float) -> None:
    """SIGTERM the process group, wait up to ``grace_seconds``, then SIGKILL it."""
    _signal_group(process.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), timeout=grace_seconds)
    except asyncio.TimeoutError:
        _signal_group(process.pid, signal.SIGKILL)
        await process.wait()


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
