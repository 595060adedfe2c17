"""The process runtime: the flow run as a local process, in a session and cgroup of its own.

Its supervisor starts ``python -m e31_prefect.job_entry`` (Prefect's engine,
saying when the work is done) with exactly the rented devices visible, and
kills every process of it at the end.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from e31_prefect import endings
from e31_prefect.ledger import Spec
from e31_prefect.runtimes import WORK_ENDED_VARIABLE, Placement, job_environment

if TYPE_CHECKING:
    from e31_prefect.supervision import Supervisor

# Environment a job never inherits from its worker: storage credentials and the worker's own settings.
WITHHELD_PREFIXES = ("AWS_", "AZURE_", "GOOGLE_APPLICATION_CREDENTIALS", "E31_")


class ProcessRuntime:
    """A run as a local process under its supervisor."""

    name = "process"
    died = endings.PROCESS_DIED

    async def check(self) -> str | None:
        return None

    def spec(self, placement: Placement) -> Spec:
        return placement.spec(
            self.name, argv=[sys.executable, "-m", "e31_prefect.job_entry"], env=environment(placement),
            cwd=str(placement.workspace))

    async def start(self, placement: Placement, supervisor: Supervisor) -> None:
        return None  # the supervisor starts the process itself


def environment(placement: Placement) -> dict[str, str]:
    """The job's environment: the host's (no credentials, no e31 settings), Prefect's, the job's own."""
    from prefect.settings import PREFECT_API_URL

    inherited = {k: v for k, v in os.environ.items() if not k.startswith(WITHHELD_PREFIXES)}
    prefect_env = {k: v for k, v in placement.configuration.env.items() if v is not None}
    # prefect-docker rewrites a loopback API URL for containers; a local process uses the worker's own.
    prefect_env["PREFECT_API_URL"] = PREFECT_API_URL.value() or prefect_env.get("PREFECT_API_URL", "")
    return {**inherited, **prefect_env,
            **job_environment(placement.job, placement.devices, placement.data_dir, placement.output_dir),
            WORK_ENDED_VARIABLE: str(placement.folder.work_ended_pipe)}
