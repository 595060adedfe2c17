"""The first process (PID 1) of a process job's own PID namespace: it reaps the job's orphans, nothing else.

    python -I -S .../e31_prefect/host/job_init.py     # started by the run's supervisor, as the job's user

The kernel reparents a process of the namespace whose parent died (a double-forked daemon, the children
of a process that exited) to the namespace's init, which must reap them or they stay as zombies, each
holding a pid of the job's. The job's own process is a sibling, not a child: it is the supervisor's
child, so the supervisor watches it, signals it and reads its exit status itself, and nothing here needs
to forward a signal. The supervisor kills this process at the end of the run; the kernel then kills
every process left in the namespace.

Only the standard library, run isolated and without ``site`` (milliseconds): it imports nothing of the
job's, reads none of its variables, and holds nothing of its supervisor.
"""

import os
import signal


def reap() -> None:
    """Reap every child that has exited (none waiting is fine)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main() -> None:
    """Reap, then wait for the next child's exit, for ever (the supervisor ends it with SIGKILL)."""
    # Blocked, so an exit between a reap and the wait stays pending for the wait instead of being lost.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    while True:
        reap()
        signal.sigwaitinfo({signal.SIGCHLD})


if __name__ == "__main__":
    main()
