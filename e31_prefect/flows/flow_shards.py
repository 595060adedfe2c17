"""The built-in flow that runs a job's ``work.flow`` as shards, each shard a call of the flow's function.

    e31 submit job.yaml        # work: {flow: flows/sweep.py:sweep, shards: 8}: deployed with this flow
    python -m e31_prefect.flows.flow_shards flows/sweep.py:sweep PARAMETERS.json     # one shard (run by the runner)

A job file with ``work: {flow: flows/sweep.py:sweep, parameters: {...}, shards: 8}``
is deployed with :func:`run_flow_shards` as its entrypoint (``e31-flow-shards``),
its parameters ``{flow: flows/sweep.py:sweep, parameters: {...}}``. The job's one
flow run is that flow: it checks the job's flow once, then runs it as shards
through :func:`e31_prefect.flows.command_flow.run_sharded`, the command shards' own
code, so both kinds share one rent, one meter, one supervisor, the slots, each
shard's devices, environment and ``shard-<index>/`` folder, retries, allowed
failures, the progress artifact, the failure table and the reduce command.

Each shard is a process, ``python -m e31_prefect.flows.flow_shards ENTRYPOINT FILE``,
that imports the flow's file and calls the flow's function (``flow.fn``) with
the job's parameters plus ``shard_index`` and ``shard_count``, validated against
its signature as Prefect validates a flow run's. Why this shape:

- **Not a flow run per shard.** A Prefect flow run costs API calls for its
  creation, every state and its logs, and a row in the UI: ten thousand shards
  would be ten thousand runs, the overhead a job array exists to avoid. A shard
  costs a Python process and an import of its flow's file, no API call.
- **Not the job's own flow as the deployment's entrypoint.** Prefect's engine
  runs a deployment's entrypoint once; making it run the shards instead would
  mean replacing the flow the engine loads, which is Prefect's inside. A built-in
  flow named in the deployment is what the command shards already do
  (``e31-command``), and it works the same from ``e31 submit`` and ``prefect.yaml``.

A shard is not a flow run, so ``get_run_logger()`` in the flow's own code (outside
a task) would find no run: in a shard it writes to the shard's log instead
(:func:`log_without_a_run`). The shard's return value is not kept; a shard writes
what it makes under ``e31_prefect.output_dir()``, its own folder.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prefect import flow

from e31_prefect.flows.command_flow import run_sharded
from e31_prefect.model.shards import (
    SHARD_PARAMETERS,
    SHARDS_VARIABLE,
    ShardSettings,
    missing_parameters_fix,
    missing_shard_parameters,
    shard_parameters,
)

FLOW_SHARDS_NAME = "e31-flow-shards"
FLOW_SHARDS_ENTRYPOINT = "e31_prefect.flow_shards.run_flow_shards"
SHARD_MODULE = "e31_prefect.flows.flow_shards"  # what each shard's process runs (python -m)


class FlowCannotShard(RuntimeError):
    """The job's flow cannot run as shards: not loadable, no room for its shard, or bad parameters."""


# validate_parameters=False: the job's parameters reach each shard as they were given (JSON), and the
# job's own flow validates them there, against its own signature, as Prefect would for a run of it.
@flow(name=FLOW_SHARDS_NAME, log_prints=False, validate_parameters=False)
def run_flow_shards(flow: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the flow ``flow`` (``path/to/file.py:function``) once per shard of the job (``E31_SHARDS``, set by
    the worker from ``work.shards``), each with ``parameters`` and its ``shard_index`` and ``shard_count``.

    The result is a summary of the shards; the run fails listing the failed shards unless allowed.
    """
    text = os.environ.get(SHARDS_VARIABLE)
    if not text:
        raise FlowCannotShard(f"{FLOW_SHARDS_NAME} runs a sharded job, and this job has no work.shards; set it "
                              f"(e.g. shards: 8), or deploy {flow} itself as the entrypoint")
    # Not validated by Prefect (above), so a hand-written deployment's odd values are refused here.
    if not isinstance(flow, str) or not flow:
        raise FlowCannotShard(f"flow = {flow!r}: is not a flow entrypoint; give path/to/file.py:function")
    if not isinstance(parameters, (dict, type(None))):
        raise FlowCannotShard(f"parameters = {parameters!r}: is not a mapping of the flow's parameters; give "
                              "e.g. {epochs: 3}")
    settings = ShardSettings.from_text(text)
    given = dict(parameters or {})
    check_flow(flow, given, settings.count)
    # A shard is no flow run, so Prefect's log handler has no run to send its task runs' lines to: they stay
    # in the shard's own log, without a warning in each.
    os.environ["PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW"] = "ignore"
    # The parameters go to the shards in a file: any size, and not in every shard's command line.
    with tempfile.TemporaryDirectory(prefix="e31-flow-shards-") as folder:
        path = Path(folder) / "parameters.json"
        path.write_text(json.dumps(given))
        return run_sharded(["python", "-m", SHARD_MODULE, flow, str(path)], settings, what=f"the flow {flow}")


def check_flow(entrypoint: str, parameters: Mapping[str, Any], count: int) -> None:
    """Fail once, before any shard starts, where every shard would fail alike: the flow cannot be loaded,
    cannot receive its shard, or refuses the job's parameters. Raises :class:`FlowCannotShard`.

    A job file's flow was checked for its shard parameters when it was validated (from its source); a
    ``prefect.yaml`` deployment's flow is known only here, so this check says the same thing at run time.
    """
    taken = [name for name in SHARD_PARAMETERS if name in parameters]
    if taken:
        raise FlowCannotShard(f"The flow {entrypoint} is given {', '.join(taken)} in its parameters; e31 gives "
                              "each shard its own, so remove them from the job's parameters")
    the_flow = load(entrypoint)
    missing = flow_missing_parameters(the_flow)
    if missing:
        raise FlowCannotShard(f"The flow {entrypoint} cannot receive its shard: "
                              + missing_parameters_fix(entrypoint, missing))
    if the_flow.should_validate_parameters:
        try:
            the_flow.validate_parameters(shard_parameters(parameters, 0, count))
        except Exception as exc:  # Prefect's ParameterTypeError names the parameter and what was wrong
            raise FlowCannotShard(f"The flow {entrypoint} refuses the job's parameters: {exc}") from None


def load(entrypoint: str) -> Any:
    """The Prefect flow at ``entrypoint``, loaded by running its file (relative to the job's folder)."""
    from prefect.flows import load_flow_from_entrypoint

    try:
        # No placeholder flow: a flow whose imports fail must fail here, not run as a stub.
        return load_flow_from_entrypoint(entrypoint, use_placeholder_flow=False)
    except Exception as exc:
        raise FlowCannotShard(f"The flow {entrypoint} cannot be loaded: {exc}") from exc


def flow_missing_parameters(the_flow: Any) -> list[str]:
    """Which shard parameters the flow's function cannot be given by keyword."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return missing_shard_parameters([p.name for p in inspect.signature(the_flow.fn).parameters.values()
                                     if p.kind in kinds])


def run_shard(the_flow: Any, parameters: dict[str, Any]) -> Any:
    """Call the flow's function with ``parameters``, validated (and coerced to its annotations) as Prefect
    does for a run of it; an async flow runs in an event loop of its own. Returns what it returns."""
    from prefect.utilities.callables import call_with_parameters

    if the_flow.should_validate_parameters:
        parameters = the_flow.validate_parameters(parameters)
    result = call_with_parameters(the_flow.fn, parameters)
    return asyncio.run(result) if inspect.iscoroutine(result) else result


def log_without_a_run() -> None:
    """Make ``get_run_logger()`` outside a task run, which in a shard finds no flow run, log to the shard's
    stderr (its ``shard.log``) instead of raising; inside a task run it is Prefect's own.

    Replaced where a flow's file may import it from (``prefect``, ``prefect.logging``), before the file
    is loaded.
    """
    import prefect.logging
    import prefect.logging.loggers
    import prefect.main
    from prefect.exceptions import MissingContextError

    original = prefect.logging.loggers.get_run_logger
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    shard_logger = logging.getLogger("e31.shard")
    shard_logger.addHandler(handler)
    shard_logger.setLevel(logging.INFO)
    shard_logger.propagate = False  # Prefect's handlers would send it to the API as a run's log: there is none

    def get_run_logger(context: Any = None, **kwargs: Any) -> Any:
        try:
            return original(context, **kwargs)
        except MissingContextError:
            return shard_logger

    for module in (prefect.logging.loggers, prefect.logging, prefect.main):
        module.get_run_logger = get_run_logger  # type: ignore[attr-defined]


def main(argv: Sequence[str] | None = None) -> None:
    """One shard: ``python -m e31_prefect.flows.flow_shards ENTRYPOINT PARAMETERS_FILE``, its index and count from
    ``E31_SHARD_INDEX`` and ``E31_SHARD_COUNT``. An exception in the flow ends it with its traceback (the
    shard's last log lines) and a non-zero status, so it fails alone."""
    entrypoint, parameters_file = sys.argv[1:] if argv is None else argv
    # Its output is a file (shard.log): line by line, so prints, log lines and a traceback keep their order
    # and a failed shard's last lines are its error, not the tail of a buffer flushed at exit.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    parameters = json.loads(Path(parameters_file).read_text())
    index, count = int(os.environ["E31_SHARD_INDEX"]), int(os.environ["E31_SHARD_COUNT"])
    log_without_a_run()
    the_flow = load(entrypoint)
    missing = flow_missing_parameters(the_flow)
    if missing:  # checked before the shards started; a file changed since then fails each shard clearly
        sys.exit(f"e31: the flow {entrypoint} cannot receive its shard: {missing_parameters_fix(entrypoint, missing)}")
    run_shard(the_flow, shard_parameters(parameters, index, count))


if __name__ == "__main__":
    main()
