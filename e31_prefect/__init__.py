"""E31 jobs on Prefect: an e31 work pool and worker that rent GPUs, stage data, run, return outputs and meter.

Flow code reads :func:`data_dir` and writes :func:`output_dir`; :func:`e31` binds a
flow to an e31 pool so that calling it runs it as an E31 job; the worker
type ``e31`` and the ``E31 Storage`` block are registered through the
``prefect.collections`` entry point (``e31_prefect.worker``, a stable name for
:mod:`e31_prefect.surface.worker`).

The other public names load on first use: a job's own process (``from e31_prefect
import output_dir``) and a run's supervisor import this package, and neither
should pay for importing Prefect's worker and the Docker client.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from e31_prefect.dirs import data_dir, output_dir

if TYPE_CHECKING:
    from e31_prefect.data.blocks import E31Storage
    from e31_prefect.model.job import Job
    from e31_prefect.model.job_file import load_job_file
    from e31_prefect.model.job_values import JobError
    from e31_prefect.surface.decorators import e31
    from e31_prefect.surface.worker import E31Worker

_LAZY = {
    "E31Storage": "e31_prefect.data.blocks",
    "E31Worker": "e31_prefect.surface.worker",
    "e31": "e31_prefect.surface.decorators",
    "Job": "e31_prefect.model.job",
    "JobError": "e31_prefect.model.job_values",
    "load_job_file": "e31_prefect.model.job_file",
}

__all__ = ["E31Storage", "E31Worker", "e31", "Job", "JobError", "data_dir", "load_job_file", "output_dir"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'e31_prefect' has no attribute {name!r}")
