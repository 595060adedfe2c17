"""The built-in flow that runs a job's plain ``command`` in the job's folder.

A job file with ``work: {command: [python, sim.py, --n, "10000"]}`` is deployed
with this flow as its entrypoint; its output streams into the run's logs.

A job with ``work.shards`` has its command run as that many shards over the
job's rented devices (:mod:`e31_prefect.flows.shard_runner`), inside this one flow run:
one rent, one meter, one supervisor. A progress artifact follows the shards;
the run fails, listing the failed shards, unless their failures are allowed;
then the optional ``work.reduce`` command runs once.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Any

from prefect import flow, get_run_logger

from e31_prefect.flows.shard_runner import Attempt, ShardProcess, program, take_early
from e31_prefect.host.gateway_rules import SHARD_FAILURES_KEY, SHARDS_PROGRESS_KEY
from e31_prefect.model.shards import (
    SHARDS_VARIABLE,
    Outcome,
    Progress,
    ShardSettings,
    failure_rows,
    failure_summary,
    reduce_environment,
)

COMMAND_FLOW_NAME = "e31-command"
COMMAND_FLOW_ENTRYPOINT = "e31_prefect.command_flow.run_command"
PROGRESS_KEY, FAILURES_KEY = SHARDS_PROGRESS_KEY, SHARD_FAILURES_KEY  # written from the job, so its gateway passes them
LOG_COUNTS_EVERY_S = 30.0  # shard counts in the run's logs: often enough to follow, rare enough to read


class CommandFailed(RuntimeError):
    """The job's command exited with a non-zero status."""


class ShardsFailed(RuntimeError):
    """More of the job's shards failed than it allows."""


@flow(name=COMMAND_FLOW_NAME, log_prints=False)
def run_command(command: list[str]) -> Any:
    """Run ``command``; ``python`` means the worker's own interpreter. Fails on a non-zero exit.

    With shards (``E31_SHARDS``, set by the worker from ``work.shards``) the command runs once per shard
    and the result is a summary of the shards.
    """
    shards = os.environ.get(SHARDS_VARIABLE)
    if shards:
        return run_sharded(command, ShardSettings.from_text(shards))
    stream(command, os.environ)
    return 0


def stream(command: Sequence[str], env: Mapping[str, str]) -> None:
    """Run ``command`` with its output in the run's logs; raises :class:`CommandFailed` on a non-zero exit."""
    logger = get_run_logger()
    logger.info("Running %s", " ".join(command))
    with subprocess.Popen(program(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=dict(env)) as process:
        assert process.stdout is not None
        for line in process.stdout:
            logger.info(line.rstrip())
    if process.returncode != 0:
        raise CommandFailed(f"{' '.join(command)} exited with status {process.returncode}")


def run_sharded(command: list[str], settings: ShardSettings, what: str | None = None) -> dict[str, Any]:
    """Run the shards, report them, fail unless their failures are allowed, then run the reduce command.

    ``what`` names the work in the run's logs (default: the command line), so the flow-shards flow
    (:mod:`e31_prefect.flows.flow_shards`) can say "the flow ..." rather than its shard program.
    """
    logger = get_run_logger()
    progress = ProgressReport(settings.count)
    logger.info("Running %s as %d shards (%s GPU(s) each, %d at once per GPU, %d retries each, %d failures "
                "allowed)", what or " ".join(command), settings.count, settings.gpus_per_shard, settings.shards_per_gpu,
                settings.retries, settings.allowed_failures)

    # Started by the job's entry before Prefect loaded, where the worker could say what they run.
    shards = take_early(command) or ShardProcess(command, settings, os.environ)

    def ended(attempt: Attempt) -> None:
        if attempt.outcome == "retry":
            logger.warning("Shard %d failed (attempt %d); retrying it", attempt.shard, attempt.number)
        elif attempt.failure is not None:
            failure = attempt.failure
            logger.error("Shard %d failed for good (exit %d after %d attempt(s)):\n%s", attempt.shard,
                         failure.exit_code, failure.attempts, failure.tail)

    outcome = shards.follow(on_progress=progress.update, on_attempt=ended)
    progress.update(shards.progress, final=True)
    summary = {"shards": settings.count, "succeeded": outcome.succeeded, "retried": outcome.retried,
               "failed": sorted(outcome.failures), "not_run": outcome.not_run}
    if outcome.failures:
        report_failures(outcome)
    if not outcome.ok:
        raise ShardsFailed(failure_summary(outcome))
    if outcome.failures:
        logger.warning("%d shard(s) failed, within the %d allowed: %s", len(outcome.failures),
                       settings.allowed_failures, ", ".join(map(str, sorted(outcome.failures))))
    if settings.reduce:
        stream(settings.reduce, {**os.environ, **reduce_environment(settings.count, list(outcome.failures))})
    return summary


def report_failures(outcome: Outcome) -> None:
    """A table artifact of the failed shards with their last log lines."""
    from prefect.artifacts import create_table_artifact

    try:
        create_table_artifact(failure_rows(outcome), key=FAILURES_KEY,
                              description=failure_summary(outcome).splitlines()[0])
    except Exception as exc:  # the run's outcome stands even if the API cannot take the artifact
        get_run_logger().warning("Could not record the failed shards as an artifact: %s", exc)


class ProgressReport:
    """A Prefect progress artifact and log lines following the shards; an API hiccup never fails the run."""

    def __init__(self, count: int):
        self.count = count
        self.logged = time.monotonic()
        self.artifact_id: Any = None
        self.last: Progress | None = None
        self.logger = get_run_logger()
        self._publish(Progress(count=count, done=0, failed=0, running=0, elapsed_s=0.0))

    def update(self, progress: Progress, final: bool = False) -> None:
        """Show ``progress`` (when it changed) and, now and then and at the end, log the counts."""
        if progress != self.last:
            self._publish(progress)
        now = time.monotonic()
        if final or now - self.logged >= LOG_COUNTS_EVERY_S:
            self.logged = now
            self.logger.info("Shards: %s", progress.describe())

    def _publish(self, progress: Progress) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        if self.last is not None and (progress.finished, progress.running) == (self.last.finished,
                                                                                 self.last.running):
            return
        self.last = progress
        try:
            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(100 * progress.fraction, key=PROGRESS_KEY,
                                                            description=progress.describe())
            else:
                update_progress_artifact(self.artifact_id, 100 * progress.fraction, description=progress.describe())
        except Exception as exc:
            self.logger.warning("Could not update the shards' progress artifact: %s", exc)
