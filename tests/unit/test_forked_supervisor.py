"""A supervisor forked by the warm interpreter is no child of its worker: the worker holds it by a pidfd, and every
wait for it ends when it exits, however many wait and whichever of them is cancelled."""

from __future__ import annotations

import asyncio
import os
import signal

from e31_prefect.host.supervision import ForkedSupervisor


def forked(seconds: float) -> int:
    """A child that exits 0 at a SIGTERM or after ``seconds`` (SIGTERM blocked from its first instruction)."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child ends in os._exit
        signal.sigtimedwait([signal.SIGTERM], seconds)
        os._exit(0)
    signal.pthread_sigmask(signal.SIG_SETMASK, before)
    return pid


def test_every_wait_ends_when_it_exits_and_a_cancelled_one_stops_none_of_the_others():
    async def scenario() -> tuple[int | None, int | None]:
        pid = forked(0.5)
        supervisor = ForkedSupervisor(pid, os.pidfd_open(pid))
        running = supervisor.returncode
        first, second, third = (asyncio.ensure_future(supervisor.wait()) for _ in range(3))
        await asyncio.sleep(0.05)
        second.cancel()
        await asyncio.wait_for(asyncio.gather(first, third), 30)
        os.waitpid(pid, 0)
        return running, supervisor.returncode

    assert asyncio.run(scenario()) == (None, 0)


def test_a_signal_reaches_it_by_its_pidfd_and_none_is_sent_once_it_exited():
    async def scenario() -> int:
        pid = forked(60)
        supervisor = ForkedSupervisor(pid, os.pidfd_open(pid))
        supervisor.send_signal(signal.SIGTERM)  # it waits for SIGTERM, then exits 0
        await asyncio.wait_for(supervisor.wait(), 30)
        _, status = os.waitpid(pid, 0)
        supervisor.send_signal(signal.SIGTERM)  # its pidfd is let go: nothing is signalled
        return os.waitstatus_to_exitcode(status)

    assert asyncio.run(scenario()) == 0
