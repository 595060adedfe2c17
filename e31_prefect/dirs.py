"""Where a running job reads its data and writes its outputs, in every runtime.

Flow code calls ``e31_prefect.data_dir()`` and ``e31_prefect.output_dir()``;
the worker sets ``E31_DATA_DIR`` and ``E31_OUTPUT_DIR`` for each run.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_VARIABLE = "E31_DATA_DIR"
OUTPUT_DIR_VARIABLE = "E31_OUTPUT_DIR"


class NotAnE31Run(RuntimeError):
    """Flow code asked for its E31 directories outside an E31 job."""


def _directory(variable: str) -> Path:
    value = os.environ.get(variable)
    if not value:
        raise NotAnE31Run(
            f"{variable} is not set: this code is not running as an E31 job. "
            f"Run it with `e31 run JOB.yaml`, or set {variable} to a folder to try it by hand."
        )
    return Path(value)


def data_dir() -> Path:
    """The job's staged inputs (read-only), laid out as the job's ``data`` entries say."""
    return _directory(DATA_DIR_VARIABLE)


def output_dir() -> Path:
    """The folder whose contents are sent to the job's output destination after the run."""
    return _directory(OUTPUT_DIR_VARIABLE)
