"""Each process job's own unprivileged user: a uid no other running job on this host has.

Where the worker runs as root, a process job runs as a uid of its own (and the
group of the same number; no account is needed), taken from :data:`JOB_UIDS` by
a lock file in :data:`LOCKS`, held by the run's supervisor for as long
as the work lives (a worker may take a narrower range, ``E31_JOB_UIDS``: every range shares the
host's lock folder). What a uid left in the host's world-writable folders is removed before it
is handed out again (:mod:`e31_prefect.host.leftovers`). So a job cannot read the worker's or another job's
``/proc`` entries, the ledger, the spool, the cache, or another run's workspace:
it owns only its output dir and its home, and its workspace and ledger folder
let its group in, to reach what it was given.

Only the standard library: the supervisor uses it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from e31_prefect.host.filelocks import try_lock

JOB_UIDS = range(61000, 62000)  # far from the accounts distributions create (1000 and up, system below 1000)
# A uid is the host's, whatever folder its workers lock devices in (two pools, or a test's "hosts", may
# keep device locks apart): one folder per host, cleared at boot like the processes that held them.
LOCKS = Path("/run/e31/job-users")


@dataclass(frozen=True)
class JobUser:
    """A uid (and gid) held for one run while its lock file is open."""

    uid: int
    lock: int  # the open lock file; closing it (or the holder dying) frees the uid


def claim(locks: Path = LOCKS, uids: range = JOB_UIDS) -> JobUser | None:
    """The first uid of ``uids`` no running job holds (None: every one is taken)."""
    locks.mkdir(parents=True, exist_ok=True)
    for uid in uids:
        fd = try_lock(locks / f"uid-{uid}.lock")
        if fd is not None:
            return JobUser(uid, fd)
    return None


def hand_over(uid: int, workspace: Path, writable: list[Path], ledger_folder: Path) -> None:
    """Give the job's user what it may touch, and only that.

    Its workspace and its ledger folder let its group pass (the data in it stays read-only and the
    supervisor's files stay the supervisor's); its output dir and its home become its own.
    """
    os.chown(workspace, -1, uid)
    os.chmod(workspace, 0o750)
    os.chown(ledger_folder, -1, uid)
    os.chmod(ledger_folder, 0o710)
    for folder in writable:
        folder.mkdir(parents=True, exist_ok=True)
        os.chown(folder, uid, uid)
        os.chmod(folder, 0o700)
