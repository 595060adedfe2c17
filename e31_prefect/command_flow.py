"""The built-in flow that runs a job's plain ``command`` in the job's folder.

A job file with ``work: {command: [python, sim.py, --n, "10000"]}`` is deployed
with this flow as its entrypoint; its output streams into the run's logs.
"""

from __future__ import annotations

import subprocess
import sys

from prefect import flow, get_run_logger

COMMAND_FLOW_NAME = "e31-command"
COMMAND_FLOW_ENTRYPOINT = "e31_prefect.command_flow.run_command"


class CommandFailed(RuntimeError):
    """The job's command exited with a non-zero status."""


@flow(name=COMMAND_FLOW_NAME, log_prints=False)
def run_command(command: list[str]) -> int:
    """Run ``command``; ``python`` means the worker's own interpreter. Fails on a non-zero exit."""
    logger = get_run_logger()
    argv = [sys.executable, *command[1:]] if command[0] in ("python", "python3") else list(command)
    logger.info("Running %s", " ".join(command))
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        assert process.stdout is not None
        for line in process.stdout:
            logger.info(line.rstrip())
    if process.returncode != 0:
        raise CommandFailed(f"{' '.join(command)} exited with status {process.returncode}")
    return process.returncode
