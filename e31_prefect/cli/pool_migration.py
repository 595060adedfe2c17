"""``e31 pool migrate``: a DockerWorker pool's deployments moved onto an e31 pool, every difference named first.

    e31 pool migrate docker-gpu gpu --gpus 1 --max-duration 2h --dry-run   # what moves, what stays and why
    e31 pool migrate docker-gpu gpu --gpus 1 --max-duration 2h             # make (or update) gpu, move them

The e31 pool gets the template of :mod:`e31_prefect.surface.pool_templates` (a default request, ``image`` as
the job's image) with the defaults the DockerWorker pool's operator set, those an e31 pool takes; its work
queues (name, priority, limit) and its concurrency limit. Each deployment is read as an e31 run of it would
be: one that would run moves (its job variables unchanged, on the queue of the same name), one that would
be refused stays where it is, with every reason. Running it again after fixing those moves them too.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from e31_prefect.model.job_values import Problem, job_name
from e31_prefect.runtimes import container as containers
from e31_prefect.surface import pool_templates
from e31_prefect.surface.life_terms import RunRefused, admitted
from e31_prefect.surface.worker_configuration import E31JobConfiguration, E31Variables

if TYPE_CHECKING:
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.objects import WorkPool
    from prefect.client.schemas.responses import DeploymentResponse

PAGE = 200  # the API's largest page
NOT_IN_THE_FORM = "is not a variable of an e31 pool's form; not carried"
EDITED = ("was edited in this pool's job configuration, which an e31 pool does not copy; set what it did as a "
          "variable default of the e31 pool, if its form has one")


class MigrationRefused(Exception):
    """Nothing can be moved: the pools are not a DockerWorker pool and an e31 one."""


@dataclasses.dataclass
class Move:
    """One deployment of the DockerWorker pool: whether an e31 run of it would run, and if not, why."""

    deployment: DeploymentResponse
    refused: str | None  # every reason at once, as the run's InvalidJob would say them
    unused: list[Problem]  # settings a job without an image leaves unused

    @property
    def name(self) -> str:
        """The deployment's name as the CLI shows it."""
        return self.deployment.name


@dataclasses.dataclass
class Migration:
    """What ``e31 pool migrate`` would do: the e31 pool's template, the defaults it carries and drops, and
    each deployment's move."""

    source: WorkPool
    target: str
    template: dict[str, Any]
    carried: dict[str, Any]
    dropped: list[Problem]
    moves: list[Move]


def carried_defaults(docker_template: dict[str, Any], allowed_volumes: list[Path]) -> tuple[dict[str, Any],
                                                                                          list[Problem]]:
    """The defaults a DockerWorker pool's operator set (those that differ from prefect-docker's own) that
    an e31 pool takes, and each one it does not, with why."""
    from prefect_docker.worker import DockerWorker

    stock = DockerWorker.get_default_base_job_template()
    stock_defaults = {name: spec.get("default") for name, spec in stock["variables"]["properties"].items()}
    carried: dict[str, Any] = {}
    dropped: list[Problem] = []
    for name, spec in (docker_template.get("variables") or {}).get("properties", {}).items():
        value = spec.get("default")
        if value is None or value == stock_defaults.get(name):
            continue
        if name not in E31Variables.model_fields:
            dropped.append(Problem(name, value, NOT_IN_THE_FORM))
            continue
        refused = containers.setting_problems({name: value}, allowed_volumes)
        if refused:
            dropped += [Problem(p.field, p.value, "not carried: " + p.fix) for p in refused]
            continue
        carried[name] = copy.deepcopy(value)
    for key, value in (docker_template.get("job_configuration") or {}).items():
        if stock["job_configuration"].get(key) != value:
            dropped.append(Problem(f"job_configuration.{key}", value, EDITED))
    return carried, dropped


async def plan(client: PrefectClient, source: str, target: str, request: dict[str, Any],
               allowed_volumes: list[Path]) -> Migration:
    """What moving ``source``'s deployments to the e31 pool ``target`` would do; changes nothing."""
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName

    docker_pool = await client.read_work_pool(source)
    if docker_pool.type != "docker":
        raise MigrationRefused(f"{source} is a {docker_pool.type!r} pool; e31 pool migrate moves the deployments "
                               "of a DockerWorker pool (--type docker)")
    try:
        existing = await client.read_work_pool(target)
    except Exception:  # none yet: it is made
        existing = None
    if existing is not None and existing.type != "e31":
        raise MigrationRefused(f"{target} is a {existing.type!r} pool; name a new pool or an e31 one")
    carried, dropped = carried_defaults(docker_pool.base_job_template, allowed_volumes)
    image = carried.pop("image", None)
    template = pool_templates.docker_pool_template(request, image=image, defaults=carried)
    if image:
        carried["image"] = image
    moves = []
    for deployment in await _all(lambda offset: client.read_deployments(
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[source])), limit=PAGE, offset=offset)):
        moves.append(await judge(client, template, deployment, allowed_volumes))
    return Migration(docker_pool, target, template, carried, dropped, moves)


async def judge(client: PrefectClient, template: dict[str, Any], deployment: DeploymentResponse,
                allowed_volumes: list[Path]) -> Move:
    """Whether a run of ``deployment`` (with no job variables of its own) would run on a pool of ``template``."""
    from prefect.utilities.schema_tools import ValidationError, validate

    variables = deployment.job_variables or {}
    try:  # as the server checks a deployment's variables against its pool's form
        validate(variables, template["variables"], raise_on_error=True, preprocess=True, ignore_required=True,
                 allow_none_with_default=True)
    except ValidationError as exc:
        return Move(deployment, f"Prefect refuses its job variables on the e31 pool: {exc}", [])
    configuration = await E31JobConfiguration.from_template_and_values(template, variables, client=client)
    configuration._job_name = job_name(deployment.name)
    try:
        _, unused = admitted(configuration, allowed_volumes)
    except RunRefused as exc:
        return Move(deployment, str(exc), [])
    return Move(deployment, None, unused)


async def apply(client: PrefectClient, migration: Migration) -> list[str]:
    """Make (or update) the e31 pool and its queues, and move each deployment that would run; what was done."""
    from prefect.client.schemas.actions import DeploymentUpdate, WorkPoolCreate, WorkPoolUpdate

    done = []
    source = migration.source
    try:
        await client.read_work_pool(migration.target)
        await client.update_work_pool(migration.target, WorkPoolUpdate(base_job_template=migration.template))
        done.append(f"Updated e31 pool {migration.target}'s base job template.")
    except Exception as exc:
        from prefect.exceptions import ObjectNotFound

        if not isinstance(exc, ObjectNotFound):
            raise
        await client.create_work_pool(WorkPoolCreate(
            name=migration.target, type="e31", base_job_template=migration.template,
            description=f"Replaces DockerWorker pool {source.name} (e31 pool migrate)",
            concurrency_limit=source.concurrency_limit))
        done.append(f"Made e31 pool {migration.target}" + (f" (concurrency limit {source.concurrency_limit})"
                                                           if source.concurrency_limit else "") + ".")
    have = {queue.name for queue in await client.read_work_queues(work_pool_name=migration.target)}
    for queue in await client.read_work_queues(work_pool_name=source.name):
        if queue.name not in have:
            await client.create_work_queue(name=queue.name, work_pool_name=migration.target,
                                           priority=queue.priority, concurrency_limit=queue.concurrency_limit,
                                           description=queue.description)
            done.append(f"Made work queue {queue.name} (priority {queue.priority}).")
    moved = [move for move in migration.moves if move.refused is None]
    for move in moved:
        await client.update_deployment(move.deployment.id, DeploymentUpdate(
            work_pool_name=migration.target, work_queue_name=move.deployment.work_queue_name))
        done.append(f"Moved {move.name} to {migration.target} (queue {move.deployment.work_queue_name}).")
    left = await _runs_left(client, [move.deployment.id for move in moved])
    if left:
        done.append(f"{left} run(s) of the moved deployments were scheduled already and stay in {source.name}'s "
                    "queues (Prefect schedules the rest again on the e31 pool): run them with a docker worker, "
                    "or delete them and schedule them again.")
    return done


def render(migration: Migration) -> list[str]:
    """The plan as the CLI prints it: the e31 pool's defaults, what is not carried, and each deployment."""
    properties = migration.template["variables"]["properties"]
    request = ", ".join(f"{k} {v}" for k, v in properties["request"]["default"].items())
    lines = [f"e31 pool {migration.target}, replacing DockerWorker pool {migration.source.name}:",
             f"  a run that gives no request rents: {request}",
             f"  image is the job's container image; a deployment with none runs in {properties['image']['default']}"]
    lines += [f"  carried: {name} = {value!r}" for name, value in migration.carried.items() if name != "image"]
    lines += [f"  not carried: {problem}" for problem in migration.dropped]
    lines.append(f"Deployments of {migration.source.name}:" if migration.moves else
                 f"{migration.source.name} has no deployments.")
    for move in migration.moves:
        if move.refused is None:
            lines.append(f"  moves: {move.name}")
            lines += [f"    unused by a job with no image: {problem}" for problem in move.unused]
        else:
            lines.append(f"  stays: {move.name}, as a run of it would be refused:")
            lines += [f"    {line}" for line in move.refused.splitlines()]
    return lines


async def _all(read: Any) -> list[Any]:
    """Every page of a paged read."""
    found: list[Any] = []
    while True:
        page = await read(len(found))
        found += page
        if len(page) < PAGE:
            return found


async def _runs_left(client: PrefectClient, deployment_ids: list[Any]) -> int:
    """How many runs of these deployments wait, scheduled before they moved (Prefect deletes the future runs of
    their schedules as it updates a deployment, and makes them again on its new pool; others stay)."""
    if not deployment_ids:
        return 0
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    runs = await client.read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=deployment_ids)),
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))))
    return len(runs)
