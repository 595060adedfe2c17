"""E31 jobs on Prefect: an e31 work pool and worker that rent GPUs, stage data, run, return outputs and meter.

Flow code reads :func:`data_dir` and writes :func:`output_dir`; :func:`e31` binds a
flow to an e31 pool so that calling it runs it as an E31 job; the worker
type ``e31`` and the ``E31 Storage`` block are registered through the
``prefect.collections`` entry point.
"""

from e31_prefect.blocks import E31Storage
from e31_prefect.decorators import e31
from e31_prefect.dirs import data_dir, output_dir
from e31_prefect.job import Job, JobError, load_job_file
from e31_prefect.worker import E31Worker

__all__ = ["E31Storage", "E31Worker", "e31", "Job", "JobError", "data_dir", "load_job_file", "output_dir"]
