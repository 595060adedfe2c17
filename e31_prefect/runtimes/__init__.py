"""Where a flow run's work executes: a local process, or a container on the host's Docker engine.

Both runtimes stop the work at its time limit or when asked (cancellation), and say how it ended.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePath

from e31_prefect.dirs import DATA_DIR_VARIABLE, OUTPUT_DIR_VARIABLE
from e31_prefect.inventory import Device, visible_devices_env
from e31_prefect.job import Job
from e31_prefect.results import result_environment


@dataclass(frozen=True)
class RunOutcome:
    """How a run's work ended: its exit code, and whether the worker stopped it and why."""

    exit_code: int
    timed_out: bool = False
    stopped: bool = False
    out_of_memory: bool = False


def job_environment(job: Job, devices: Sequence[Device], data_dir: PurePath | str,
                    output_dir: PurePath | str) -> dict[str, str]:
    """What every runtime adds for a job: its own variables, then its devices and dirs.

    The devices and dirs come last so a job cannot widen its own view of the host; the result
    settings come first so a job may choose its own result storage.
    """
    return {
        **result_environment(output_dir),
        **job.work.env,
        **visible_devices_env(devices),
        DATA_DIR_VARIABLE: str(data_dir),
        OUTPUT_DIR_VARIABLE: str(output_dir),
    }
