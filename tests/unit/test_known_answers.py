"""What a process job's engine is spared asking the Prefect API: the server's version (the worker's own Prefect
checked it), CSRF tokens where the API uses none, and the deployment where its pull steps only move into a
folder on this host (the flow is then loaded from its entrypoint there)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from e31_prefect.job_entry import FLOW_FOLDER_VARIABLE
from e31_prefect.runtimes.process import csrf_in_use, known_answers
from e31_prefect.surface.worker_configuration import SET_WORKING_DIRECTORY, only_moves_into

ENTRYPOINT = "PREFECT__FLOW_ENTRYPOINT"


def deployment(*steps: dict, entrypoint: str = "flow.py:train") -> SimpleNamespace:
    return SimpleNamespace(entrypoint=entrypoint, pull_steps=list(steps))


def moves_into(folder: Path | str, **more: str) -> dict:
    return {SET_WORKING_DIRECTORY: {"directory": str(folder), **more}}


def configuration(folder: str | None, entrypoint: str | None = "flow.py:train",
                  run_env: dict[str, str] | None = None) -> SimpleNamespace:
    return SimpleNamespace(flow_folder=folder, entrypoint=entrypoint, run_environment=run_env or {})


def test_a_deployment_that_only_moves_into_a_folder_here_names_it(tmp_path):
    assert only_moves_into(deployment(moves_into(tmp_path))) == str(tmp_path)


@pytest.mark.parametrize("case", ["no deployment", "no pull step", "a git clone first", "a step after it",
                                  "a relative folder", "a folder not here", "a file, not a folder",
                                  "a step option more", "a templated folder"])
def test_any_other_pull_step_is_left_to_prefects_engine(tmp_path, case):
    (tmp_path / "file").write_text("")
    where = {
        "no deployment": None,
        "no pull step": deployment(),
        "a git clone first": deployment({"prefect.deployments.steps.git_clone": {"repository": "https://x/y.git"}},
                                        moves_into(tmp_path)),
        "a step after it": deployment(moves_into(tmp_path), {"prefect.deployments.steps.run_shell_script": {
            "script": "make data"}}),
        "a relative folder": deployment(moves_into("jobs/sims")),
        "a folder not here": deployment(moves_into(tmp_path / "gone")),
        "a file, not a folder": deployment(moves_into(tmp_path / "file")),
        "a step option more": deployment(moves_into(tmp_path, id="cd")),  # its output named: kept as Prefect's
        "a templated folder": deployment(moves_into("{{ clone.directory }}")),
    }[case]
    assert only_moves_into(where) is None


def test_the_engine_loads_the_flow_in_its_folder_and_asks_no_version_or_csrf_token():
    assert known_answers(configuration("/srv/jobs/train"), api_csrf=False) == {
        "PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED": "false",
        "PREFECT_CLIENT_CSRF_SUPPORT_ENABLED": "false",
        ENTRYPOINT: "flow.py:train",
        FLOW_FOLDER_VARIABLE: "/srv/jobs/train",
    }


def test_a_csrf_api_keeps_its_tokens_and_other_deployments_their_pull_steps():
    answers = known_answers(configuration(None), api_csrf=True)
    assert answers == {"PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED": "false"}


def test_a_flow_whose_entrypoint_prefect_already_has_keeps_it():
    # An @e31 flow (no deployment) names its own source file in Prefect's variables for the run.
    answers = known_answers(configuration("/srv/jobs/train", run_env={ENTRYPOINT: "/home/a/f.py:g"}), api_csrf=True)
    assert ENTRYPOINT not in answers and FLOW_FOLDER_VARIABLE not in answers


def test_csrf_is_in_use_until_the_workers_client_was_told_otherwise():
    assert csrf_in_use(SimpleNamespace())  # a client that does not say
    assert csrf_in_use(SimpleNamespace(_client=SimpleNamespace(enable_csrf_support=True)))
    assert not csrf_in_use(SimpleNamespace(_client=SimpleNamespace(enable_csrf_support=False)))
