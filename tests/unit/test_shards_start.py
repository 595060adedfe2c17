"""Which runs' shards the job's entry may start before Prefect loads: e31's command flow, moved into its
folder and nothing else first, its command read from the run's own parameters."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from e31_prefect.flows.command_flow import COMMAND_FLOW_ENTRYPOINT
from e31_prefect.flows.flow_shards import FLOW_SHARDS_ENTRYPOINT
from e31_prefect.surface.worker_configuration import SET_WORKING_DIRECTORY, shards_start


def run(command=("python", "sim.py")) -> SimpleNamespace:
    return SimpleNamespace(parameters={"command": list(command)} if command is not None else {})


def deployment(folder: Path | str, entrypoint: str = COMMAND_FLOW_ENTRYPOINT, *more_steps: dict) -> SimpleNamespace:
    return SimpleNamespace(entrypoint=entrypoint,
                           pull_steps=[{SET_WORKING_DIRECTORY: {"directory": str(folder)}}, *more_steps])


def test_a_command_deployed_in_its_folder_starts_with_the_runs_own_command(tmp_path):
    assert shards_start(run(["python", "sim.py", "--seed", "3"]), deployment(tmp_path)) == (
        ["python", "sim.py", "--seed", "3"], str(tmp_path))


@pytest.mark.parametrize("case", ["no deployment", "a flow of its own", "flow shards", "a git clone first",
                                  "a relative folder", "a folder not here", "no command", "a command not a list"])
def test_the_flow_starts_the_shards_where_the_worker_cannot_say_what_they_run_or_where(tmp_path, case):
    flow_run, where = run(), deployment(tmp_path)
    if case == "no deployment":
        where = None
    elif case == "a flow of its own":
        where = deployment(tmp_path, "flows/train.py:train")
    elif case == "flow shards":
        where = deployment(tmp_path, FLOW_SHARDS_ENTRYPOINT)
    elif case == "a git clone first":
        where.pull_steps.insert(0, {"prefect.deployments.steps.git_clone": {"repository": "https://x/y.git"}})
    elif case == "a relative folder":
        where = deployment("jobs/sims")
    elif case == "a folder not here":
        where = deployment(tmp_path / "gone")
    elif case == "no command":
        flow_run = run(None)
    elif case == "a command not a list":
        flow_run.parameters["command"] = "python sim.py"
    assert shards_start(flow_run, where) is None
