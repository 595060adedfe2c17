"""The base job template of an e31 pool that replaces a DockerWorker pool: that pool's deployments run
unchanged, as container jobs (pure).

    e31 pool migrate docker-gpu gpu --gpus 1 --max-duration 2h      # makes the pool and moves the deployments
    e31 pool template --gpus 1 --max-duration 2h > gpu.json         # or only the template, for
    prefect work-pool create gpu --type e31 --base-job-template gpu.json

A prefect-docker deployment gives an ``image`` and no e31 field. This template, Prefect's own templating
and nothing else, makes it an e31 job: the pool's form holds a default ``request`` (the GPUs and time
limit every run that gives none rents), and its job configuration maps the ``image`` variable onto the
job's ``work.image``. Prefect's placeholders replace whole values and cannot merge two, so ``work`` is
templated field by field, ``image`` standing for ``work.image``; the form's ``work`` then has no image of
its own, and the server refuses a ``work.image`` given on this pool by name, instead of one of the two
being dropped without a word.
"""

from __future__ import annotations

import copy
from typing import Any

from prefect.utilities.dockerutils import get_prefect_image_name

from e31_prefect.model.job import Request, parse_job
from e31_prefect.model.job_values import Problem
from e31_prefect.model.job_work import Work
from e31_prefect.runtimes import container as containers
from e31_prefect.surface.worker import E31Worker
from e31_prefect.surface.worker_configuration import IMAGE_VARIABLE

IMAGE_MEANING = ("The job's container image (what work.image is on other e31 pools). A run with none runs in "
                 "the pool's default, as DockerWorker runs one in Prefect's image; set it to null to run the "
                 "job as a local process.")
WORK_MEANING = ("What runs. On this pool a job's image is the image variable (as in prefect-docker), "
                "not work.image.")


def stock_template() -> dict[str, Any]:
    """The base job template ``prefect work-pool create NAME --type e31`` gives a pool."""
    return E31Worker.get_default_base_job_template()


def default_image() -> str:
    """The image DockerWorker runs a deployment that names none in: Prefect's, of this Prefect version."""
    return get_prefect_image_name()


def docker_pool_template(request: dict[str, Any], image: str | None = None,
                         defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """An e31 pool's base job template that runs a DockerWorker pool's deployments as they are.

    ``request``: the default request (``{"gpus": 1, "max_duration": "2h"}``) of every run that gives none;
    checked as a job's request is, a bad one raises :class:`JobError` naming it. ``image``: the default
    image (None: Prefect's, as DockerWorker's). ``defaults``: other defaults of the pool's form (those a
    DockerWorker pool's operator set), by variable name.
    """
    template = stock_template()
    properties = template["variables"]["properties"]
    properties["request"]["default"] = checked_request(request)
    properties["image"] = {**properties["image"], "description": IMAGE_MEANING, "default": image or default_image()}
    for name, value in (defaults or {}).items():
        properties[name]["default"] = copy.deepcopy(value)
    work = template["variables"]["definitions"]["Work"]
    work["properties"].pop("image")
    work["additionalProperties"] = False  # a work.image given here is refused by the server, by name
    properties["work"]["description"] = WORK_MEANING
    configuration = template["job_configuration"]
    del configuration["image"]  # the image is the job's, not a container setting e31 refuses
    configuration["work"] = work_mapping()
    return template


def work_mapping() -> dict[str, str]:
    """The job configuration's ``work`` on such a pool: each field of the ``work`` variable, and ``image``."""
    return {name: IMAGE_VARIABLE if name == "image" else f"{{{{ work.{name} }}}}" for name in Work.model_fields}


def checked_request(request: dict[str, Any]) -> dict[str, Any]:
    """A default request, checked as a job's is (a bad one raises :class:`JobError` naming each field), and
    written as a job's job variables write it."""
    checked = parse_job({"name": "pool-default", "request": request}, source="the pool's default request").request
    written = checked.model_dump(mode="json", exclude_none=True)
    return {key: written[key] for key in Request.model_fields if key in request and key in written}


def refused_defaults(defaults: dict[str, Any], allowed_volumes: list[Any]) -> list[Problem]:
    """The pool defaults (a DockerWorker pool's) that an e31 pool would refuse in every run, each with why."""
    return containers.setting_problems(defaults, allowed_volumes)
