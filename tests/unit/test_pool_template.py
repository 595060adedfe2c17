"""A DockerWorker pool's deployments on an e31 pool: the template that runs them unchanged (`e31 pool migrate`,
`e31 pool template`), and the message a run gets where no such template gives it a request.

Each run's configuration is made by Prefect's own templating (`from_template_and_values`), as a worker makes it,
and its job variables are checked by Prefect's own schema validation, as the server checks them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prefect.utilities.schema_tools import validate

from e31_prefect.cli.pool_migration import carried_defaults
from e31_prefect.model.job_values import JobError
from e31_prefect.surface.life_terms import RunRefused, admitted
from e31_prefect.surface.pool_templates import docker_pool_template, stock_template
from e31_prefect.surface.worker_configuration import E31JobConfiguration

# What `prefect deploy` stores for a prefect-docker deployment: an image, its env and labels, no e31 field.
DOCKER_DEPLOYMENT = {"image": "acme/trainer:2026.12", "env": {"SEED": "7"}, "labels": {"team": "vision"}}


def configuration(template: dict[str, Any], variables: dict[str, Any]) -> Any:
    """A run's configuration as a worker makes it from its pool's template and its job variables (the client
    resolves block references and Prefect variables, which these templates have none of)."""
    made = asyncio.run(E31JobConfiguration.from_template_and_values(template, variables, client=SimpleNamespace()))
    made._job_name = "nightly"
    return made


def server_check(template: dict[str, Any], variables: dict[str, Any]) -> None:
    """What the Prefect server checks of a run's job variables against its pool's form (raises if refused)."""
    validate(variables, template["variables"], raise_on_error=True, preprocess=True, ignore_required=False,
             allow_none_with_default=True)


# -- the template -----------------------------------------------------------------------------


def test_a_prefect_docker_deployment_runs_as_a_container_job_with_the_pools_default_request():
    template = docker_pool_template({"gpus": 1, "max_duration": "2h"})
    server_check(template, DOCKER_DEPLOYMENT)
    run = configuration(template, DOCKER_DEPLOYMENT)
    job, unused = admitted(run, [])
    assert job.work.image == "acme/trainer:2026.12"  # `image` means the job's image: a container job
    assert (job.request.gpus, job.request.max_duration.total_seconds()) == (1, 7200)
    assert run.env == {"SEED": "7"} and run.labels == {"team": "vision"}  # prefect-docker's settings, as they were
    assert unused == [] and run.setting_problems([]) == []


def test_a_deployment_that_names_no_image_runs_in_prefects_as_dockerworker_runs_it_and_null_runs_a_process():
    from prefect.utilities.dockerutils import get_prefect_image_name

    template = docker_pool_template({"gpus": 0, "max_duration": "30m"})
    assert admitted(configuration(template, {}), [])[0].work.image == get_prefect_image_name()
    assert admitted(configuration(template, {"image": None}), [])[0].work.image is None


def test_a_deployments_own_request_and_e31_fields_still_apply_on_such_a_pool():
    template = docker_pool_template({"gpus": 1, "max_duration": "2h"})
    variables = {"request": {"gpus": 4, "max_duration": "9h", "gpu_type": "H100"}, "team": "physics",
                 "work": {"command": ["python", "sim.py"], "env": {"N": "10000"}, "shards": 8, "image": "acme/sim:3"}}
    server_check(template, variables)
    job, _ = admitted(configuration(template, variables), [])
    assert (job.request.gpus, job.request.gpu_type, job.team) == (4, "H100", "physics")
    # A job's work.image is its image, over the pool's default image.
    assert (job.work.image, job.work.command, job.work.env, job.work.shards) == (
        "acme/sim:3", ["python", "sim.py"], {"N": "10000"}, 8)


def test_the_template_is_one_a_prefect_server_takes():
    """Prefect refuses a template whose placeholders name anything but its form's variables."""
    from prefect.server.schemas.actions import WorkPoolCreate

    template = docker_pool_template({"gpus": 1, "max_duration": "2h"}, defaults={"image_pull_policy": "Always"})
    created = WorkPoolCreate(name="gpu", type="e31", base_job_template=template)
    assert created.base_job_template["variables"]["properties"]["request"]["default"] == {
        "gpus": 1, "max_duration": "2h"}


def test_a_bad_default_request_is_named_before_any_pool_is_made():
    with pytest.raises(JobError) as refused:
        docker_pool_template({"gpus": 2, "max_duration": "soon", "gpu_type": "H100"})
    assert [p.field for p in refused.value.problems] == ["request.max_duration"]
    assert "is not a duration" in str(refused.value)


def test_the_docker_pools_own_defaults_are_carried_and_each_one_e31_refuses_is_named(tmp_path: Path):
    from prefect_docker.worker import DockerWorker

    docker = DockerWorker.get_default_base_job_template()
    defaults = {"image_pull_policy": "Always", "networks": ["lab"], "privileged": True, "mem_limit": "8g",
                "image": "acme/base:1"}
    for name, value in defaults.items():
        docker["variables"]["properties"][name]["default"] = value
    docker["variables"]["properties"]["gpu_count"] = {"type": "integer", "default": 2}  # an operator's own
    docker["job_configuration"]["container_create_kwargs"] = {"runtime": "nvidia"}
    carried, dropped = carried_defaults(docker, [])
    assert carried == {"image_pull_policy": "Always", "networks": ["lab"], "image": "acme/base:1"}
    named = {problem.field: str(problem) for problem in dropped}
    assert set(named) == {"privileged", "mem_limit", "gpu_count", "job_configuration.container_create_kwargs"}
    assert "not carried: is not an e31 setting: use request.memory" in named["mem_limit"]
    assert "is not a variable of an e31 pool's form" in named["gpu_count"]


# -- a run with no request, on a pool with no default ----------------------------------------------


def test_a_run_with_no_request_is_told_both_fixes_and_every_other_refused_setting_at_once():
    # As a prefect-docker deployment moved to a stock e31 pool: its image makes it a container job.
    run = configuration(stock_template(), {**DOCKER_DEPLOYMENT, "mem_limit": "8g", "privileged": True})
    with pytest.raises(RunRefused) as refused:
        admitted(run, [])
    message = str(refused.value)
    job_part, settings_part = message.split("The run's worker settings are not valid:\n")
    assert job_part.startswith("The job is not valid:\nrequest: is required")
    # The job-variable form, and the pool default.
    assert "job_variables: {request: {gpus: 1, max_duration: 2h}}" in job_part
    assert "--job-variable 'request={\"gpus\": 1, \"max_duration\": \"2h\"}'" in job_part
    assert "e31 pool migrate" in job_part and "variables.properties.request.default" in job_part
    # Every setting an e31 pool refuses, in the same message: no second round trip.
    assert [line.split(" = ")[0] for line in settings_part.splitlines()] == ["mem_limit", "privileged"]


def test_a_prefect_docker_image_on_a_stock_pool_is_the_jobs_image_not_a_refused_setting():
    """prefect-docker's image variable means a container on any e31 pool: never a refusal, never a process."""
    run = configuration(stock_template(), {"image": "acme/trainer:1", "request": {"max_duration": "1h"},
                                           "work": {"command": ["true"]}})
    job, unused = admitted(run, [])
    assert job.work.image == "acme/trainer:1" and unused == []
    both = configuration(stock_template(), {"image": "acme/trainer:1", "request": {"max_duration": "1h"},
                                            "work": {"command": ["true"], "image": "acme/trainer:2"}})
    assert admitted(both, [])[0].work.image == "acme/trainer:2"  # work.image is the image where both are given


def test_a_process_job_warns_of_container_settings_it_leaves_unused():
    run = configuration(stock_template(), {"request": {"max_duration": "1h"}, "work": {"command": ["true"]},
                                           "mem_limit": "8g"})
    job, unused = admitted(run, [])
    assert job.work.image is None and [p.field for p in unused] == ["mem_limit"]


def test_each_run_gets_the_workers_prefect_settings_serialized_once_per_settings_object():
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    from e31_prefect.surface.worker_configuration import E31JobConfiguration, settings_environment

    settings = get_current_settings()
    first = settings_environment(settings)
    assert settings_environment(settings) is first, "serialized again for the same settings"
    assert first == settings.to_environment_variables(exclude_unset=True)
    given = E31JobConfiguration._base_environment()
    given["PREFECT_API_URL"] = "changed by one run"  # a run's copy: the next run's is untouched
    assert E31JobConfiguration._base_environment() == first
    with temporary_settings({PREFECT_API_URL: "http://elsewhere:4200/api"}):  # new settings, new variables
        assert E31JobConfiguration._base_environment()["PREFECT_API_URL"] == "http://elsewhere:4200/api"
    assert E31JobConfiguration._base_environment() == first
