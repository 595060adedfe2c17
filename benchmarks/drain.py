"""A busy pool on PostgreSQL: e31 workers against Prefect's process workers, draining the same trivial runs.

    python benchmarks/drain.py [--runs 1000] [--workers 4] [--slots 8] [--backlog 10000] [--rounds 1]

One Prefect server on PostgreSQL (scripts/postgres.sh), as a pool of many workers has it. In each round,
alternating, the same number of trivial runs of a no-op flow is drained by:

- e31: ``--workers`` e31 workers, each a host of its own with ``--slots`` declared GPUs (its own E31_HOME
  and device locks), the runs asking for 1 GPU each;
- process: as many of Prefect's process workers with ``--limit`` ``--slots`` each (the same slots in all).

Printed for each: runs per minute from the workers' start to the last run's end, and the ratio (goal
e31/process >= 1.0); runs that did not complete (goal 0); CPU seconds per run spent by the worker
processes themselves (not their children), and by the whole host (server, engines, supervisors and all).

Then the cost of one poll at a backlog of ``--backlog`` due runs (made at once by Prefect's backfill route,
``POST /deployments/{id}/schedule``, with the server's late-run renaming off): an e31 worker and a process
worker in this process poll the same pool in turn, every slot of each taken (so a poll reads, ranks and
starts nothing). e31's first poll reads the whole backlog and evaluates each run once; its next polls keep
the backlog (Prefect's flow-run events followed) and read one page; the process worker reads one page of
200 runs and stops at its full limit. Goal: e31's next poll / process poll <= 1.5 (medians, first polls aside).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent))

from chaos import Server  # noqa: E402

FLOW = '''
from prefect import flow

@flow
def noop() -> int:
    return 1
'''
TICKS = os.sysconf("SC_CLK_TCK")
BIN = Path(sys.executable).parent


def host_cpu_seconds() -> float:
    """CPU seconds the whole host has spent busy (all cores), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / TICKS


def process_cpu_seconds(pid: int) -> float:
    """A live process's own CPU seconds (user and system): not its children's, which for Prefect's process
    worker are the runs themselves (the host's figure counts everything)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:13]) / TICKS  # utime, stime


def run_count(client, deployment_id, states: list[str]) -> int:
    """How many of the deployment's runs are in one of ``states`` (Prefect state types)."""
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )

    return client.count_flow_runs(flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                                      type=FlowRunFilterStateType(any_=states))),
                                  deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))


FINAL = ["COMPLETED", "FAILED", "CRASHED", "CANCELLED"]


def create_runs(deployment_id, count: int) -> None:
    """``count`` runs of the deployment, due now, created side by side through the API's own route (Prefect's
    client reads the deployment again for each run, which costs the client more than the server)."""
    import httpx
    from prefect.settings import PREFECT_API_URL

    async def create() -> None:
        url = f"{PREFECT_API_URL.value()}/deployments/{deployment_id}/create_flow_run"
        async with httpx.AsyncClient(timeout=120) as client:
            for first in range(0, count, 50):
                answers = await asyncio.gather(*(client.post(url, json={"state": {"type": "SCHEDULED"}})
                                                 for _ in range(min(50, count - first))))
                for answer in answers:
                    answer.raise_for_status()
    asyncio.run(create())


class Side:
    """One way to run the pool's runs: its pool, its deployment, and how its workers start."""

    def __init__(self, kind: str, home: Path, env: dict[str, str], folder: Path, slots: int):
        self.kind, self.home, self.env, self.folder, self.slots = kind, home, env, folder, slots
        self.backlog = 0

    def deployment(self, pool: str):
        """A deployment of the no-op flow on ``pool``: by ``e31 submit`` (its one run deleted) for e31, by
        Prefect's client for the process worker."""
        from prefect import get_client

        if self.kind == "e31":
            job = self.folder / "noop.yaml"
            job.write_text("name: noop\nwork: {flow: flow.py:noop}\nrequest: {gpus: 1, max_duration: 10m}\n"
                           "output: {to: ./out/}\n")
            submitted = subprocess.run([BIN / "e31", "submit", str(job), "--pool", pool], env=self.env,
                                       capture_output=True, text=True, check=True).stdout
            run_id = submitted.split("(", 1)[1].split(")", 1)[0]
            with get_client(sync_client=True) as client:
                deployment_id = client.read_flow_run(run_id).deployment_id
                client.delete_flow_run(run_id)
            return deployment_id
        subprocess.run([BIN / "prefect", "work-pool", "create", pool, "--type", "process"], env=self.env,
                       capture_output=True, check=True)
        with get_client(sync_client=True) as client:
            flow_id = client.create_flow_from_name("noop")
            return client.create_deployment(
                flow_id=flow_id, name=f"noop-{pool}", work_pool_name=pool, entrypoint="flow.py:noop",
                path=str(self.folder), pull_steps=[{"prefect.deployments.steps.set_working_directory": {
                    "directory": str(self.folder)}}])

    def start_worker(self, pool: str, index: int) -> subprocess.Popen:
        host = self.home / f"host-{index}"
        host.mkdir(parents=True, exist_ok=True)
        env = dict(self.env)
        command = [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", self.kind,
                   "--name", f"{self.kind}-{index}"]
        if self.kind == "e31":  # a host of its own: its home, its device locks, its declared GPUs
            env.update(E31_HOME=str(host), E31_DEVICE_LOCKS=str(host / "locks"), E31_GPUS=f"{self.slots}xH100")
        else:
            command += ["--limit", str(self.slots)]
        log = (host / f"worker-{pool}.log").open("ab")
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=host)


def drain(side: Side, pool: str, runs: int, workers: int) -> dict[str, float]:
    """Drain ``runs`` runs of a fresh pool with ``workers`` workers; the figures of that drain."""
    from prefect import get_client

    deployment_id = side.deployment(pool)
    create_runs(deployment_id, runs)
    host_before = host_cpu_seconds()
    started = time.monotonic()
    procs = [side.start_worker(pool, i) for i in range(workers)]
    worker_cpu: dict[int, float] = {}
    try:
        with get_client(sync_client=True) as client:
            while run_count(client, deployment_id, FINAL) < runs and time.monotonic() - started < 3600:
                for proc in procs:
                    with contextlib.suppress(OSError):
                        worker_cpu[proc.pid] = process_cpu_seconds(proc.pid)
                time.sleep(1)
            elapsed = time.monotonic() - started
            host = host_cpu_seconds() - host_before
            done = run_count(client, deployment_id, ["COMPLETED"])
        for proc in procs:
            with contextlib.suppress(OSError):
                worker_cpu[proc.pid] = process_cpu_seconds(proc.pid)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:  # Prefect's process worker may not stop on SIGTERM: it is killed
                proc.kill()
                proc.wait()
    return {"runs_per_min": runs / elapsed * 60, "not_completed": runs - done, "seconds": elapsed,
            "worker_cpu_per_run": sum(worker_cpu.values()) / runs, "host_cpu_per_run": host / runs}


def backfill_runs(deployment_id, count: int) -> None:
    """``count`` runs of the deployment, all due, one a second over the past, made by Prefect's backfill route
    (the scheduler's own bulk insert) from a schedule of exactly ``count`` past dates added for it (an open one
    lets Prefect's scheduler add runs due seconds later) and paused after (deleting it deletes the runs it
    made)."""
    from datetime import datetime, timedelta, timezone

    from prefect import get_client
    from prefect.client.schemas.schedules import RRuleSchedule

    now = datetime.now(timezone.utc)
    start = (now - timedelta(seconds=count + 60)).replace(microsecond=0)  # the rrule counts whole seconds
    with get_client(sync_client=True) as client:
        schedule, = client.create_deployment_schedules(
            deployment_id, [(RRuleSchedule(
            rrule=f"DTSTART:{start:%Y%m%dT%H%M%SZ}\nRRULE:FREQ=SECONDLY;COUNT={count}"), True)])
        try:
            for first in range(0, count, 1000):  # a schedule gives at most 1,000 dates a call
                client.request("POST", "/deployments/{id}/schedule", path_params={"id": deployment_id}, json={
                    "start_time": (start + timedelta(seconds=first)).isoformat(), "end_time": now.isoformat(),
                    "max_runs": min(1000, count - first)})
        finally:
            client.update_deployment_schedule(deployment_id, schedule.id, active=False)
        made = run_count(client, deployment_id, ["SCHEDULED"])
        if made < count:
            raise SystemExit(f"the backfill made {made} runs, not {count}")


async def poll_costs(side: Side, pool: str, polls: int) -> dict[str, list[float]]:
    """Seconds of each of ``polls`` polls of ``pool`` (its backlog made beforehand) by an e31 worker and by a
    process worker, polling in turn (so the machine's noise falls on both alike), every slot of each taken."""
    from uuid import uuid4

    from prefect.workers.process import ProcessWorker

    from e31_prefect.surface.worker import E31Worker

    os.environ["E31_GPUS"] = f"{side.slots}xH100"
    os.environ["E31_DEVICE_LOCKS"] = str(side.home / "poll-locks")
    times: dict[str, list[float]] = {"e31": [], "process": []}
    async with E31Worker(work_pool_name=pool) as e31, ProcessWorker(work_pool_name=pool, limit=side.slots) as process:
        await e31.sync_with_backend()
        await process.sync_with_backend()
        assert e31.inventory.hold(uuid4(), e31.inventory.free())  # every GPU busy elsewhere
        for _ in range(side.slots):  # every slot busy elsewhere
            process._limiter.acquire_on_behalf_of_nowait(object())
        await e31.follow_backlog()  # as a pool's worker does on its first poll
        assert e31.backlog_watch is not None and e31.backlog_watch.following
        for _ in range(polls):
            for kind, worker in (("e31", e31), ("process", process)):
                began = time.perf_counter()
                assert await worker.get_and_submit_flow_runs() == []
                times[kind].append(time.perf_counter() - began)
        assert len(e31.backlog_watch.kept) >= side.backlog
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000, help="runs drained by each side in each round (0: skip)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--slots", type=int, default=8, help="declared GPUs of each e31 worker, --limit of each "
                        "process worker")
    parser.add_argument("--backlog", type=int, default=10000, help="due runs for the poll measurement (0: skip)")
    parser.add_argument("--polls", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--sides", default="e31,process", help="which sides drain (e31 alone: to profile it)")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="e31-drain-"))
    home.chmod(0o755)  # a job's own user reads its code here, as in a checked-out project
    print(f"working in {home}", flush=True)
    # The server's late-runs service renames a waiting run Late some seconds after it is due, 10,000 of them in
    # as many minutes, each an event: off here, so the polls are measured at a backlog that stays as it is,
    # not beside that one-time renaming.
    os.environ["PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED"] = "false"
    server = Server(home, "postgres")
    server.start()
    folder = home / "job"
    folder.mkdir()
    (folder / "flow.py").write_text(FLOW)
    env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_WORKER_HEARTBEAT_SECONDS": "10",
           "E31_WATCH_SECONDS": "2"}
    os.environ.update(PREFECT_WORKER_QUERY_SECONDS="2")
    # chaos.py imported Prefect before the server's settings were set: its settings are read again.
    from prefect.context import refresh_global_settings_context

    refresh_global_settings_context()
    sides = {kind: Side(kind, home / kind, env, folder, args.slots) for kind in ("e31", "process")}
    results: dict[str, list[dict[str, float]]] = {"e31": [], "process": []} if args.runs else {}
    try:
        for round_ in range(args.rounds if args.runs else 0):
            for kind in [k for k in (("e31", "process") if round_ % 2 == 0 else ("process", "e31"))
                         if k in args.sides.split(",")]:
                print(f"round {round_ + 1}: {kind} draining {args.runs} runs ...", flush=True)
                figures = drain(sides[kind], f"drain-{kind}-{round_}", args.runs, args.workers)
                results[kind].append(figures)
                print("  " + ", ".join(f"{name} {value:.2f}" for name, value in figures.items()), flush=True)
        polls: dict[str, list[float]] = {}
        if args.backlog:
            # One backlog for both: Prefect's process worker reads an e31 pool's page as its own (it warns of
            # the pool's type), and reading is what a poll at a backlog costs.
            side = sides["e31"]
            side.backlog = args.backlog
            print(f"making {args.backlog} due runs ...", flush=True)
            backfill_runs(side.deployment("poll"), args.backlog)
            print(f"polls at {args.backlog} due runs, e31 and process in turn ...", flush=True)
            polls = asyncio.run(poll_costs(side, "poll", args.polls))
            for kind, times in polls.items():
                print(f"  {kind}: " + ", ".join(f"{t:.2f} s" for t in times), flush=True)
    finally:
        server.stop()

    def mid(kind: str, name: str) -> float:
        return median(r[name] for r in results[kind])

    if results and all(results.values()):
        print(f"\n{args.runs} runs x {args.rounds} round(s), {args.workers} workers x {args.slots} slots, PostgreSQL")
        print(f"{'':28}{'e31':>10}{'process':>10}")
        for name, label in (("runs_per_min", "runs/min"), ("not_completed", "runs not completed"),
                            ("worker_cpu_per_run", "worker CPU-s per run"),
                            ("host_cpu_per_run", "host CPU-s per run")):
            print(f"{label:28}{mid('e31', name):>10.2f}{mid('process', name):>10.2f}")
        print(f"runs/min ratio e31/process: {mid('e31', 'runs_per_min') / mid('process', 'runs_per_min'):.2f} "
              "(goal >= 1.0); runs not completed goal 0")
    if polls:
        first, steady = polls["e31"][0], median(polls["e31"][1:] or polls["e31"])
        process = median(polls["process"][1:] or polls["process"])
        print(f"poll at {args.backlog} due runs: e31 first {first:.2f} s, next {steady:.2f} s; process "
              f"{process:.2f} s (reads 200); ratio e31 next/process {steady / process:.2f} (goal <= 1.5)")


if __name__ == "__main__":
    main()
