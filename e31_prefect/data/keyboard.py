"""``e31 run``'s own rule for a job's ``file://`` inputs: the person at the keyboard is the pool's operator too.

    e31 run deployments/jobs/retrain.yaml --now     # its data: ../data/train.csv, beside the job's folder

A shared pool's worker (``prefect worker start``) stages ``file://`` inputs only from
the job's folder and the folders its operator allows (``E31_FILE_ROOTS``,
:mod:`e31_prefect.data.confine`): whoever submits is not the host's operator. ``e31 run``
starts a private worker, in the submitter's own process, for that one run: there the
one who submits is the one who runs the host, and the rule only gets in the way. So
it also stages each ``file://`` input that the invoking user may read, wherever it is,
and the run's log names each one. Outputs keep the rule: this widens only what the
user could read anyway.

The path a job names is resolved first (``..``, symbolic links), and the real path is
what the user must be able to read: a link to a file the user cannot read stays refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from e31_prefect.data import confine

# The kernel's views of processes and devices are no one's data: /proc/self/environ would hand a job the
# environment (the credentials) of the `e31 run` that stages it.
NEVER_DATA = ("/proc", "/sys", "/dev")


def user_may_read(path: str) -> bool:
    """Whether the user running this process may read ``path`` (a folder: list and enter it)."""
    mode = os.R_OK | (os.X_OK if os.path.isdir(path) else 0)
    return os.access(path, mode)


def readable_inputs(sources: Iterable[str], roots: Sequence[Path],
                    may_read: Callable[[str], bool] = user_may_read) -> list[Path]:
    """The real paths of the ``file://`` ``sources`` that lie outside ``roots`` and that ``may_read`` allows:
    the folders ``e31 run`` adds to a run's roots. Other schemes, paths already under a root and the kernel's
    pseudo-files (:data:`NEVER_DATA`) are left out: the rule refuses them as it would anywhere."""
    real_roots = [os.path.realpath(root) for root in roots]
    found: list[Path] = []
    for source in sources:
        if not source.startswith("file://"):
            continue
        real = os.path.realpath(source.removeprefix("file://"))
        if confine.root_holding(real, NEVER_DATA) is not None or confine.root_holding(real, real_roots) is not None:
            continue
        if may_read(real) and Path(real) not in found:
            found.append(Path(real))
    return found


def widened_roots(sources: Iterable[str], roots: Sequence[Path], log: Any) -> list[Path]:
    """``roots`` and the inputs :func:`readable_inputs` adds for ``e31 run``, each said in the run's ``log``."""
    extra = readable_inputs(sources, roots)
    for path in extra:
        log.info("e31 run: staging %s from outside the job's folder, as the user at the keyboard (uid %d) may "
                 "read it; a shared pool (prefect worker start) refuses it unless its operator allows its folder "
                 "(%s)", path, os.getuid(), confine.SETTING)
    return [*roots, *extra]
