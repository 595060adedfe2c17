"""A job file becomes a Prefect deployment (named after the job) and each submission a flow run.

``e31 submit job.yaml`` calls :func:`submit_job`: the E31 pool is created if
missing, the job is deployed with its folder as working directory, and a flow
run is scheduled at the job's earliest start.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.objects import FlowRun, WorkPool
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.flows import load_flow_arguments_from_entrypoint
from prefect.states import Scheduled
from prefect.utilities.callables import parameter_schema_from_entrypoint

from e31_prefect.flows.command_flow import COMMAND_FLOW_ENTRYPOINT, COMMAND_FLOW_NAME
from e31_prefect.flows.flow_shards import FLOW_SHARDS_ENTRYPOINT, FLOW_SHARDS_NAME
from e31_prefect.model.job import Job
from e31_prefect.model.job_file import flow_file
from e31_prefect.model.job_plan import plan, plan_problems
from e31_prefect.model.job_values import JobError, Problem

DEFAULT_POOL = "e31"


class PoolTypeError(RuntimeError):
    """The named work pool exists but is not an e31 pool."""


async def ensure_pool(client: PrefectClient, name: str) -> WorkPool:
    """The e31 work pool ``name``, created with the e31 base job template if missing."""
    from e31_prefect.surface.worker import E31Worker

    try:
        pool = await client.read_work_pool(name)
    except ObjectNotFound:
        try:
            return await client.create_work_pool(WorkPoolCreate(
                name=name, type=E31Worker.type,
                base_job_template=E31Worker.get_default_base_job_template(),
                description="E31 GPU jobs",
            ))
        except ObjectAlreadyExists:  # another submit or worker created it meanwhile: that pool it is
            pool = await client.read_work_pool(name)
    if pool.type != E31Worker.type:
        raise PoolTypeError(f"work pool {name!r} is of type {pool.type!r}, not 'e31'; "
                            f"choose another --pool or create one with --type e31")
    return pool


def entrypoint_of(job: Job, folder: Path) -> tuple[str, str, dict[str, Any]]:
    """The deployment's entrypoint, flow name and parameters for a job anchored at ``folder``: a command
    runs in e31's command flow, a sharded flow in e31's flow-shards flow, any other flow is its own."""
    if job.work.command:
        return COMMAND_FLOW_ENTRYPOINT, COMMAND_FLOW_NAME, {"command": job.work.command}
    if job.work.shards is not None:
        return FLOW_SHARDS_ENTRYPOINT, FLOW_SHARDS_NAME, {"flow": job.work.flow,
                                                          "parameters": dict(job.work.parameters)}
    source, function = flow_file(job.work, folder)
    name = load_flow_arguments_from_entrypoint(f"{source}:{function}", arguments={"name"})["name"]
    return job.work.flow or "", name, dict(job.work.parameters)


async def deploy_job(client: PrefectClient, job: Job, folder: Path, pool: str) -> Any:
    """Create or update the deployment named after the job; returns its id."""
    entrypoint, flow_name, parameters = entrypoint_of(job, folder)
    try:
        schema = parameter_schema_from_entrypoint(
            entrypoint if ":" not in entrypoint else f"{folder / entrypoint.rsplit(':', 1)[0]}:"
            + entrypoint.rsplit(":", 1)[1]).model_dump()
    except Exception:
        schema = None
    flow_id = await client.create_flow_from_name(flow_name)
    return await client.create_deployment(
        flow_id=flow_id,
        name=job.name,
        work_pool_name=pool,
        entrypoint=entrypoint,
        path=str(folder),
        pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(folder)}}],
        parameters=parameters,
        parameter_openapi_schema=schema,
        job_variables=job.to_job_variables(),
        tags=["e31"] + ([f"e31:team={job.team}"] if job.team else []),
        description=f"E31 job {job.name}",
    )


async def submit_job(
    client: PrefectClient, job: Job, folder: Path, pool: str, now: datetime, *, start_now: bool = False
) -> FlowRun:
    """Validate the job's times, deploy it and schedule one flow run at its earliest start."""
    the_plan = plan(job, now, start_now=start_now)
    problems: list[Problem] = plan_problems(job, the_plan)
    if problems:
        raise JobError(problems)
    await ensure_pool(client, pool)
    deployment_id = await deploy_job(client, job, folder, pool)
    return await client.create_flow_run_from_deployment(
        deployment_id, state=Scheduled(scheduled_time=the_plan.start),
    )
