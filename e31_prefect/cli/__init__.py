"""The ``e31`` command: validate, submit and run E31 job files on Prefect.

    e31 run deployments/jobs/retrain.yaml --now   # submit, run it here, print state, outputs, meter
    e31 submit job.yaml                           # schedule it; a worker runs it later
    e31 validate job.yaml                         # the normalized job, or its problems
    e31 queue --pool gpu                          # every waiting run: planned start, finish, deadline met
    e31 hosts --pool gpu                          # every host: its GPUs, rented to whom or drained, last heartbeat
    e31 drain HOST [GPU] --reason TEXT            # no new run lands there (e31 undrain HOST [GPU] ends it)
    e31 blocks apply blocks/                      # create or update the blocks described in blocks/*.yaml
    e31 pool migrate docker-gpu gpu --gpus 1 --max-duration 2h   # a DockerWorker pool's deployments, on e31

With no ``PREFECT_API_URL`` set, a local Prefect server is started in the background.
A job that is not valid exits with status 2 and one line per problem.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from uuid import UUID

from e31_prefect.host.home_files import HomeOpen
from e31_prefect.host.inventory import DeviceLocksError
from e31_prefect.model import meter as metering
from e31_prefect.model import timing
from e31_prefect.model.job import Job
from e31_prefect.model.job_file import load_job_file
from e31_prefect.model.job_plan import plan, plan_problems
from e31_prefect.model.job_values import JobError

EXIT_INVALID = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``e31`` command."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except JobError as exc:
        print(f"{exc.source or args.file}: the job is not valid", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return EXIT_INVALID
    except (HomeOpen, DeviceLocksError) as exc:  # this host's files would be open to jobs: its operator's to fix
        print(f"e31: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="e31", description="Run E31 GPU jobs on Prefect.")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    validate = commands.add_parser("validate", help="check a job file and print it normalized")
    validate.add_argument("file", type=Path)
    validate.add_argument("--now", action="store_true", help="plan as if started now, ignoring start")
    validate.set_defaults(handler=_validate)

    usage = commands.add_parser("usage", help="what finished jobs cost, by team, deployment, pool or day")
    usage.add_argument("--since", type=_moment, help="ISO date or datetime (default: 7 days ago)")
    usage.add_argument("--until", type=_moment, help="ISO date or datetime (default: now)")
    usage.add_argument("--by", choices=["team", "deployment", "pool", "day"], default="team")
    usage.add_argument("--format", choices=["table", "csv", "json"], default="table")
    usage.set_defaults(handler=_usage)

    queue = commands.add_parser("queue", help="every waiting run of a pool with its planned start and finish "
                                "and whether it meets its deadline (like squeue --start)")
    queue.add_argument("--pool", default="e31", help="e31 work pool (default: e31)")
    queue.set_defaults(handler=_queue)

    hosts = commands.add_parser("hosts", help="every host of a pool: its GPUs (free, rented and to which run, drained "
                                "and why), its last heartbeat and its worker's version (like sinfo)")
    hosts.add_argument("--pool", default="e31", help="e31 work pool (default: e31)")
    hosts.set_defaults(handler=_hosts)

    for name, text in (("drain", "no new run lands on a host or one GPU of it (running work finishes), like "
                        "scontrol update state=drain"), ("undrain", "a drained host or GPU takes runs again")):
        command = commands.add_parser(name, help=text)
        command.set_defaults(command=name)
        command.add_argument("host", help="the host's name (its E31_HOST_NAME, as e31 hosts shows it)")
        command.add_argument("gpu", nargs="?", type=int, help="one GPU's index (default: the whole host)")
        if name == "drain":
            command.add_argument("--reason", default="maintenance", help="why, shown by e31 hosts and e31 queue")
        command.set_defaults(handler=_drain)

    quota = commands.add_parser("quota", help="GPUs a team (or with --pool, a pool) may hold at once")
    quota_actions = quota.add_subparsers(required=True, metavar="ACTION")
    quota_set = quota_actions.add_parser("set", help="set a quota: e31 quota set vision 8")
    quota_set.add_argument("name", help="the team (or the pool, with --pool)")
    quota_set.add_argument("gpus", type=int)
    quota_set.add_argument("--pool", action="store_true", help="NAME is a work pool: set its capacity")
    quota_set.set_defaults(handler=_quota_set)

    blocks = commands.add_parser("blocks", help="Prefect blocks described in YAML files (storage credentials)")
    blocks_apply = blocks.add_subparsers(required=True, metavar="ACTION").add_parser(
        "apply", help="create or update the blocks in YAML files or folders: e31 blocks apply blocks/")
    blocks_apply.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    blocks_apply.set_defaults(handler=_blocks_apply)

    pool = commands.add_parser("pool", help="e31 work pools: one that replaces a DockerWorker pool")
    pool_actions = pool.add_subparsers(required=True, metavar="ACTION")
    migrate = pool_actions.add_parser(
        "migrate", help="move a DockerWorker pool's deployments to an e31 pool that runs them unchanged, as "
        "container jobs: e31 pool migrate docker-gpu gpu --gpus 1 --max-duration 2h")
    migrate.add_argument("source", metavar="DOCKER_POOL", help="the DockerWorker pool (--type docker)")
    migrate.add_argument("target", metavar="E31_POOL", help="the e31 pool, made if it does not exist")
    template = pool_actions.add_parser(
        "template", help="print that e31 pool's base job template, for prefect work-pool create --base-job-template")
    for command in (migrate, template):
        command.add_argument("--gpus", type=int, required=True, help="GPUs a run that gives no request rents")
        command.add_argument("--max-duration", required=True, help="its time limit, e.g. 2h")
        command.add_argument("--gpu-type", help="only devices whose name contains this, e.g. H100")
    migrate.add_argument("--dry-run", action="store_true", help="say what would move and what not; change nothing")
    migrate.set_defaults(handler=_pool_migrate)
    template.set_defaults(handler=_pool_template)

    outputs = commands.add_parser("outputs", help="outputs kept on this host because their store was down")
    outputs_actions = outputs.add_subparsers(required=True, metavar="ACTION")
    outputs_retry = outputs_actions.add_parser("retry", help="send a run's kept outputs: e31 outputs retry RUN_ID")
    outputs_retry.add_argument("run_id", help="the flow run id its OutputNotSent message names")
    outputs_retry.add_argument("--to", help="send them here instead of the destination on record")
    outputs_retry.set_defaults(handler=_outputs_retry)

    server = commands.add_parser("server", help="the local Prefect server the CLI starts")
    server.add_argument("action", choices=["stop"])
    server.set_defaults(handler=_server)

    for name, handler, text in (
        ("submit", _submit, "schedule a job as a flow run and return at once"),
        ("run", _run, "submit a job and run it here with an e31 worker until it ends"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("file", type=Path)
        command.add_argument("--pool", default="e31", help="e31 work pool (default: e31)")
        command.add_argument("--now", action="store_true", help="ignore the job's start and run now")
        command.set_defaults(handler=handler)
    return parser


def _load(args: argparse.Namespace) -> tuple[Job, datetime]:
    job = load_job_file(args.file)
    now = datetime.now(timezone.utc)
    problems = plan_problems(job, plan(job, now, start_now=args.now))
    if problems:
        raise JobError(problems, str(args.file))
    return job, now


def _validate(args: argparse.Namespace) -> int:
    job, now = _load(args)
    the_plan = plan(job, now, start_now=args.now)
    import yaml

    print(yaml.safe_dump({"name": job.name, **job.to_job_variables()}, sort_keys=False).rstrip())
    limit = the_plan.time_limit
    print(f"# time limit:     {timing.format_duration(limit) if limit else 'none (until done)'}")
    print(f"# earliest start: {the_plan.start.astimezone(job.tz).isoformat(timespec='minutes')}")
    if the_plan.deadline:
        print(f"# deadline:       {the_plan.deadline.astimezone(job.tz).isoformat(timespec='minutes')}")
        assert the_plan.latest_start is not None
        print(f"# latest start:   {the_plan.latest_start.astimezone(job.tz).isoformat(timespec='minutes')}")
    return 0


def _moment(text: str) -> datetime:
    moment = datetime.fromisoformat(text)
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def _usage(args: argparse.Namespace) -> int:
    from e31_prefect.cli import usage

    _connect()
    until = args.until or datetime.now(timezone.utc)
    since = args.since or until - timedelta(days=7)
    runs = asyncio.run(_read_usage(since, until))
    print(usage.render(usage.summarize(runs, args.by), args.by, args.format))
    return 0


def _queue(args: argparse.Namespace) -> int:
    from e31_prefect.cli.forecast import forecast

    _connect()
    print(asyncio.run(forecast(args.pool)))
    return 0


async def _read_usage(since: datetime, until: datetime):
    """Each finished E31 run scheduled in [since, until], with its meter (a malformed one is named and skipped)."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterExpectedStartTime,
        FlowRunFilterTags,
    )

    from e31_prefect.cli.usage import MalformedMeter, RunUsage, gpus_of, meter_from_table, meter_rows

    found = []
    async with get_client() as client:
        flow_runs, offset = [], 0
        while True:
            page = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=["e31"]),
                expected_start_time=FlowRunFilterExpectedStartTime(after_=since, before_=until)),
                limit=200, offset=offset)
            flow_runs += page
            offset += len(page)
            if len(page) < 200:
                break
        deployments: dict = {}
        for flow_run in flow_runs:
            tags = {t.split("=", 1)[0]: t.split("=", 1)[1] for t in flow_run.tags if "=" in t}
            if "e31:billed-s" not in tags:
                continue  # not closed yet
            # The worker's meter (a job's gateway refuses e31-* keys): the table it wrote last, if several.
            meters = [a for a in await client.read_artifacts(artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))) if a.key and a.key.startswith("e31-meter")]
            if not meters:
                continue
            meter = max(meters, key=lambda a: a.created or datetime.min.replace(tzinfo=timezone.utc))
            try:
                gpus = gpus_of(tags)
                billed, run_seconds, queue = meter_from_table(meter_rows(meter.data), gpus)
            except MalformedMeter as exc:
                print(f"e31 usage: skipped flow run {flow_run.name} ({flow_run.id}): {exc}", file=sys.stderr)
                continue
            if flow_run.deployment_id and flow_run.deployment_id not in deployments:
                deployments[flow_run.deployment_id] = (await client.read_deployment(flow_run.deployment_id)).name
            outcome = next((t.removeprefix("e31:") for t in flow_run.tags
                            if t in ("e31:deadline-missed", "e31:timed-out")), None)
            found.append(RunUsage(
                team=tags.get("e31:team", "-"), deployment=deployments.get(flow_run.deployment_id, "-"),
                pool=flow_run.work_pool_name or "-", day=flow_run.expected_start_time.date().isoformat(),
                gpus=gpus, billed_seconds=billed, run_seconds=run_seconds, queue_seconds=queue, outcome=outcome))
    return found


def _hosts(args: argparse.Namespace) -> int:
    from prefect import get_client

    from e31_prefect.host.settings import E31Settings
    from e31_prefect.surface import hosts_table

    _connect()

    async def show() -> str:
        async with get_client() as client:
            table = await hosts_table.read_rows(client, args.pool, E31Settings().host_lost_seconds)
            with contextlib.suppress(Exception):  # shown in the UI too; only the UI's copy would be missing
                await hosts_table.write(client, args.pool, table)
        return hosts_table.render(table) if table else f"No host of pool {args.pool!r} has published itself yet."

    print(asyncio.run(show()))
    return 0


def _drain(args: argparse.Namespace) -> int:
    from prefect import get_client

    from e31_prefect.surface import drains

    if args.gpu is not None and args.gpu < 0:
        print(f"{args.command}: {args.gpu} is not a GPU index; give 0 or more", file=sys.stderr)
        return EXIT_INVALID
    device = drains.WHOLE_HOST if args.gpu is None else str(args.gpu)
    reason = getattr(args, "reason", None)
    _connect()

    async def apply() -> dict:
        async with get_client() as client:
            return await drains.change(client, args.host, device, reason, "operator")

    now = asyncio.run(apply())
    what = f"GPU {args.gpu} of host {args.host}" if args.gpu is not None else f"host {args.host}"
    if reason is not None:
        print(f"Drained {what}: no new run lands there; running work finishes ({reason}).")
    else:
        print(f"Undrained {what}." + (f" Still drained: {', '.join(sorted(now))}." if now else ""))
    return 0


def _quota_set(args: argparse.Namespace) -> int:
    from prefect import get_client

    from e31_prefect.surface import quotas

    if args.gpus < 1:
        print(f"quota {args.name}: {args.gpus} is not a number of GPUs; give 1 or more", file=sys.stderr)
        return EXIT_INVALID
    name = quotas.pool_limit(args.name) if args.pool else quotas.team_limit(args.name)
    _connect()

    async def apply() -> None:
        async with get_client() as client:
            await quotas.set_quota(client, name, args.gpus)

    asyncio.run(apply())
    print(f"{'Pool' if args.pool else 'Team'} {args.name} may hold {args.gpus} GPU(s) at once "
          f"(global concurrency limit {name}).")
    return 0


def _blocks_apply(args: argparse.Namespace) -> int:
    import os

    from e31_prefect.cli.block_documents import BlockFileError, apply_blocks, read_block_files

    try:
        documents = read_block_files(args.paths, os.environ)
    except BlockFileError as exc:
        print("Nothing was applied; fix these block files first:", file=sys.stderr)
        for source, problem in exc.problems:
            print(f"  {source}: {problem}", file=sys.stderr)
        return EXIT_INVALID
    _connect()
    for line in asyncio.run(apply_blocks(documents)):
        print(line)
    return 0


def _default_request(args: argparse.Namespace) -> dict[str, Any]:
    request: dict[str, Any] = {"gpus": args.gpus, "max_duration": args.max_duration}
    return {**request, "gpu_type": args.gpu_type} if args.gpu_type else request


def _pool_template(args: argparse.Namespace) -> int:
    import json

    from e31_prefect.surface.pool_templates import docker_pool_template

    print(json.dumps(docker_pool_template(_default_request(args)), indent=2))
    return 0


def _pool_migrate(args: argparse.Namespace) -> int:
    from prefect import get_client

    from e31_prefect.cli import pool_migration
    from e31_prefect.host.settings import E31Settings
    from e31_prefect.surface.pool_templates import checked_request

    checked_request(_default_request(args))  # a bad one is named before anything is read
    _connect()

    async def migrate() -> int:
        async with get_client() as client:
            migration = await pool_migration.plan(client, args.source, args.target, _default_request(args),
                                                  E31Settings().allowed_volumes)
            print("\n".join(pool_migration.render(migration)))
            if not args.dry_run:
                print("\n".join(await pool_migration.apply(client, migration)))
        staying = [move for move in migration.moves if move.refused is not None]
        return EXIT_INVALID if staying else 0

    try:
        return asyncio.run(migrate())
    except pool_migration.MigrationRefused as exc:
        print(f"e31 pool migrate: {exc}", file=sys.stderr)
        return EXIT_INVALID


def _outputs_retry(args: argparse.Namespace) -> int:
    from e31_prefect.host.settings import E31Settings
    from e31_prefect.surface import spool

    _connect()
    return asyncio.run(spool.retry(args.run_id, E31Settings().spool, args.to))


def _server(args: argparse.Namespace) -> int:
    from e31_prefect.cli.local_server import stop_local_server

    print("Stopped the local Prefect server." if stop_local_server() else "No local Prefect server was running.")
    return 0


def _connect() -> None:
    """Point Prefect at the configured server, or at a local one started on demand."""
    import os

    from e31_prefect.cli.local_server import configured_api_url, ensure_local_server

    if not configured_api_url():
        os.environ["PREFECT_API_URL"] = ensure_local_server()
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()


def _submit(args: argparse.Namespace) -> int:
    job, now = _load(args)
    _connect()
    the_plan = plan(job, now, start_now=args.now)
    flow_run, planned_start, planned_length = asyncio.run(_submit_and_plan(job, args, now, the_plan.start))
    print(f"Submitted flow run {flow_run.name!r} ({flow_run.id}) to pool {args.pool!r}")
    print(f"  {_ui_link(flow_run.id)}")
    if the_plan.latest_start:
        print(f"  latest start: {the_plan.latest_start.astimezone(job.tz).isoformat(timespec='minutes')} "
              "(to finish by its deadline)")
    print(f"  {planned_start}")
    if planned_length:
        print(f"  {planned_length}")
    return 0


async def _submit_and_plan(job: Job, args: argparse.Namespace, now: datetime, scheduled: datetime,
                           ) -> tuple[Any, str, str | None]:
    """Submit the job, then say when the pool's plan starts it (it is due at ``scheduled``), as ``e31 queue``
    would show it."""
    from e31_prefect.cli.forecast import length_line, planned_line, read_plan

    flow_run = await _submit_async(job, args, now)
    try:
        planned, _, hosts, planned_at = await read_plan(args.pool)
    except Exception as error:  # the run is submitted either way; only the forecast is missing
        return flow_run, f"planned start: unknown ({type(error).__name__}: {error})", None
    return flow_run, planned_line(planned, flow_run.id, hosts, scheduled, planned_at), length_line(planned, flow_run.id)


async def _submit_async(job: Job, args: argparse.Namespace, now: datetime):
    from prefect import get_client

    from e31_prefect.surface.submission import submit_job

    async with get_client() as client:
        return await submit_job(client, job, args.file.resolve().parent, args.pool, now, start_now=args.now)


def _ui_link(flow_run_id: UUID) -> str:
    from prefect.utilities.urls import url_for

    return url_for("flow-run", obj_id=flow_run_id) or f"flow run {flow_run_id}"


def _run(args: argparse.Namespace) -> int:
    job, now = _load(args)
    if not _fits_here(job):
        return EXIT_INVALID
    _connect()
    return asyncio.run(_run_async(job, args, now))


def _fits_here(job: Job) -> bool:
    """``e31 run`` runs the job on this host: say so at once if this host can never fit it."""
    from e31_prefect.host.inventory import discover, pick_devices
    from e31_prefect.host.settings import E31Settings

    devices = discover(E31Settings().gpus)
    if pick_devices(devices, job.request.gpus, job.request.gpu_type) is not None:
        return True
    have = ", ".join(f"{d.index}:{d.name}" for d in devices) or "no GPU"
    wanted = f"{job.request.gpus} GPU(s)" + (f" of type {job.request.gpu_type}" if job.request.gpu_type else "")
    print(f"{job.name}: asks for {wanted}, and this host has {have} (NVML, or E31_GPUS when set). "
          "Run it on a GPU host, use `e31 submit` for a worker that has them, or declare this "
          "host's GPUs, e.g. E31_GPUS=1xH100.", file=sys.stderr)
    return False


async def _run_async(job: Job, args: argparse.Namespace, now: datetime) -> int:
    from e31_prefect.surface.worker import E31Worker

    flow_run = await _submit_async(job, args, now)
    print(f"Submitted flow run {flow_run.name!r} ({flow_run.id}): {_ui_link(flow_run.id)}")
    if flow_run.expected_start_time and flow_run.expected_start_time > datetime.now(timezone.utc):
        print(f"Waiting for its start at {flow_run.expected_start_time.isoformat(timespec='minutes')} "
              "(use --now to start at once)")
    bar = ShardsBar(flow_run.id) if job.work.shards and sys.stdout.isatty() else None
    async with E31Worker(work_pool_name=args.pool, only_flow_run_ids={flow_run.id}, at_keyboard=True) as worker:
        await worker.sync_with_backend()
        while True:
            if not worker.busy:  # once the run is taken, polling for it would only load the API
                await worker.get_and_submit_flow_runs()
            current = await worker.client.read_flow_run(flow_run.id)
            if current.state and current.state.is_final() and not worker.busy:
                break
            if bar is not None:
                await bar.show(worker.client)
            await asyncio.sleep(0.5)
        if bar is not None:
            await bar.show(worker.client, last=True)
        final = await worker.client.read_flow_run(flow_run.id)
        meter = worker.meters.get(flow_run.id)
        outputs = await _outputs_link(worker.client, flow_run.id)
    state = final.state
    assert state is not None
    print(f"\n{final.name}: {state.name}" + (f": {state.message}" if state.message else ""))
    if outputs:
        print(f"Outputs: {outputs}")
    if meter:
        _print_meter(meter)
    return 0 if state.is_completed() else 1


class ShardsBar:
    """``e31 run``'s progress bar of a sharded job, drawn on the terminal from the run's progress artifact."""

    def __init__(self, flow_run_id: UUID):
        self.flow_run_id = flow_run_id
        self.drawn = ""
        self.read_at = 0.0

    async def show(self, client, last: bool = False) -> None:
        """Redraw the bar (the artifact is read at most every 2 s); ``last`` ends its line."""
        import time

        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

        from e31_prefect.flows.command_flow import PROGRESS_KEY
        from e31_prefect.model.shards import progress_bar

        if not last and time.monotonic() - self.read_at < 2:
            return
        self.read_at = time.monotonic()
        try:
            found = await client.read_artifacts(artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[self.flow_run_id]),
                key=ArtifactFilterKey(any_=[PROGRESS_KEY])))
        except Exception:  # a bar is a courtesy: the run goes on without it
            found = []
        if found:
            line = progress_bar(float(found[0].data or 0), found[0].description or "")
            if line != self.drawn:
                print("\r\033[K" + line, end="", flush=True)
                self.drawn = line
        if last and self.drawn:
            print()


async def _outputs_link(client, flow_run_id: UUID) -> str | None:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    artifacts = await client.read_artifacts(
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    for artifact in artifacts:
        if artifact.key and artifact.key.startswith("e31-outputs") and isinstance(artifact.data, str):
            return artifact.data.split("](", 1)[0].lstrip("[")
    return None


def _print_meter(meter: metering.Meter) -> None:
    print("Meter:")
    for row in metering.table(meter):
        at = str(row["at"])[11:23] if row["at"] else ""
        print(f"  {row['step']:<13} {at:<12} {float(row['seconds']):>10.3f} s  {row['meaning']}")


if __name__ == "__main__":
    sys.exit(main())
