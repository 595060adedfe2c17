"""The base job template of an e31 pool that replaces a DockerWorker pool: that pool's deployments run
unchanged, as container jobs (pure).

    e31 pool migrate docker-gpu gpu --gpus 1 --max-duration 2h      # makes the pool and moves the deployments
    e31 pool template --gpus 1 --max-duration 2h > gpu.json         # or only the template, for
    prefect work-pool create gpu --type e31 --base-job-template gpu.json

A prefect-docker deployment gives an ``image`` and no e31 field. On every e31 pool a run's ``image`` is its
job's image where its ``work`` names none (:meth:`E31JobConfiguration.job`); this template adds what only
the pool's operator can choose, as the defaults of the pool's form, which Prefect's templating applies to
every run that does not give its own: the ``request`` (the GPUs and time limit such a run rents) and the
``image`` of a deployment that names none (Prefect's, as DockerWorker's), with the defaults that the
DockerWorker pool's operator set.

Why defaults and not a mapping in ``job_configuration``: Prefect's placeholders fill whole values from
top-level variables only (a server refuses ``{{ work.flow }}``), so ``{{ image }}`` could become
``work.image`` only by giving up the ``work`` variable, and with it every e31 job on the pool.
"""

from __future__ import annotations

import copy
from typing import Any

from prefect.utilities.dockerutils import get_prefect_image_name

from e31_prefect.model.job import Request, parse_job
from e31_prefect.surface.worker import E31Worker

IMAGE_MEANING = ("The job's container image, as in prefect-docker (the same as work.image, which is the image "
                 "where both are given). A run with neither runs in this default, as DockerWorker runs one in "
                 "Prefect's image; null runs it as a local process.")
REQUEST_MEANING = ("GPUs, time limit, start and deadline. This pool's default is what a run that gives no "
                   "request of its own rents (a run that gives one gives all of it: a request is not merged).")


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
    properties["request"].update(default=checked_request(request), description=REQUEST_MEANING)
    properties["image"].update(default=image or default_image(), description=IMAGE_MEANING)
    for name, value in (defaults or {}).items():
        properties[name]["default"] = copy.deepcopy(value)
    return template


def checked_request(request: dict[str, Any]) -> dict[str, Any]:
    """A default request, checked as a job's is (a bad one raises :class:`JobError` naming each field), and
    written as a job's job variables write it."""
    checked = parse_job({"name": "pool-default", "request": request}, source="the pool's default request").request
    written = checked.model_dump(mode="json", exclude_none=True)
    return {key: written[key] for key in Request.model_fields if key in request and key in written}

