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
from pathlib import Path

from e31_prefect.runtimes import RunOutcome


async def run_process(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    time_limit: float | None,
    grace_seconds: float,
    stop: asyncio.Event,
    on_started: Callable[[int], None] = lambda pid: None,
) -> RunOutcome:
    """Run ``command`` until it exits, ``time_limit`` seconds pass or ``stop`` is set; then stop its group.

    If the caller is cancelled the group is stopped too: no run outlives its worker's watch.
    """
    process = await asyncio.create_subprocess_exec(*command, env=dict(env), cwd=str(cwd), start_new_session=True)
    on_started(process.pid)
    exited = asyncio.ensure_future(process.wait())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({exited, stopped}, timeout=time_limit, return_when=asyncio.FIRST_COMPLETED)
        timed_out = not exited.done() and not stopped.done()
        if not exited.done():
            await stop_group(process, grace_seconds)
    except BaseException:
        await asyncio.shield(stop_group(process, grace_seconds))
        raise
    finally:
        stopped.cancel()
        # Whatever the leader left behind in its group goes with it.
        _signal_group(process.pid, signal.SIGKILL)
    code = process.returncode
    return RunOutcome(exit_code=code if code is not None else -9, timed_out=timed_out,
                      stopped=stop.is_set() and not timed_out)


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
