"""Submit-to-Completed of a no-op flow: e31's runtimes against Prefect's own workers.

    python benchmarks/overhead.py [--runs 20] [--docker] [--load 0]

Pairs, each in the same run on one Prefect server (started here unless
PREFECT_API_URL is set), both workers polling every second, runs alternating
so machine noise falls on both:

- process: the e31 worker's process runtime vs Prefect's process worker;
- docker (--docker, needs an engine: eval "$(scripts/docker-engine.sh)"): the e31
  worker's docker runtime vs prefect-docker's DockerWorker, same image.

Times come from the server's timestamps: flow run created -> Completed state.
For e31 it also reports created -> meter closed (tags set), which includes the
output and release steps that follow Completed, and what a team pays for that
is not its flow: billed seconds (the meter's rented -> run_ended) minus the
flow run's own time (Prefect's start_time -> end_time), median and max. The e31
worker declares 8 GPUs and each run rents one. With --docker it also measures
how long after its time limit a sleeping job's container is gone. With --load N,
N processes that only spin keep the machine's CPUs busy while the runs are
measured (a host whose other jobs load it), the same for both workers.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NOOP = '''
from prefect import flow


@flow
def noop():
    return 1
'''


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(home: Path) -> tuple[subprocess.Popen | None, str]:
    if os.environ.get("PREFECT_API_URL"):
        return None, os.environ["PREFECT_API_URL"]
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    os.environ.update(PREFECT_API_URL=url, PREFECT_HOME=str(home / "prefect"),
                      PREFECT_SERVER_ANALYTICS_ENABLED="false")
    log = (home / "server.log").open("wb")
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                               "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    import httpx

    for _ in range(360):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the Prefect server did not start")


def deploy(client, folder: Path, pool: str, kind: str, job_variables: dict, name: str) -> object:
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.base import BaseWorker

    worker_class = BaseWorker.get_worker_class_from_type(kind)
    client.create_work_pool(WorkPoolCreate(name=pool, type=kind,
                                           base_job_template=worker_class.get_default_base_job_template()),
                            overwrite=True)
    flow_id = client.create_flow_from_name("noop")
    return client.create_deployment(
        flow_id=flow_id, name=name, work_pool_name=pool, entrypoint="noop.py:noop",
        path=str(folder),
        pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(folder)}}],
        job_variables=job_variables,
    )


def measure(client, deployment_id, metered: bool) -> tuple[float, float, float | None]:
    """Seconds from creation to Completed, to the meter being closed, and billed beyond the flow's own
    time (the last two e31 only)."""
    run = client.create_flow_run_from_deployment(deployment_id)
    completed_at = None
    for _ in range(1200):
        current = client.read_flow_run(run.id)
        if current.state and current.state.is_final():
            if not current.state.is_completed():
                raise SystemExit(f"run {run.id} ended {current.state.name}: {current.state.message}")
            completed_at = completed_at or current.state.timestamp
            if not metered or any(t.startswith("e31:billed-s=") for t in current.tags):
                closed = time.time()
                beyond = billed_beyond_flow(client, current) if metered else None
                return ((completed_at - current.created).total_seconds(),
                        closed - current.created.timestamp(), beyond)
        time.sleep(0.1)
    raise SystemExit(f"run {run.id} did not finish")


def meter_marks(client, flow_run_id) -> dict[str, float]:
    """The run's meter (its e31-meter artifact): each step's time, as a timestamp."""
    import json
    from datetime import datetime

    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    for _ in range(200):
        rows = [a for a in client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))) if a.key and a.key.startswith("e31-meter")]
        if rows:
            return {r["step"]: datetime.fromisoformat(r["at"]).timestamp() for r in json.loads(rows[0].data) if r["at"]}
        time.sleep(0.1)
    raise SystemExit(f"run {flow_run_id} has no meter")


def billed_beyond_flow(client, flow_run) -> float:
    """Billed seconds (rented -> run_ended) minus the flow run's own (start_time -> end_time)."""
    marks = meter_marks(client, flow_run.id)
    billed = marks["run_ended"] - marks["rented"]
    return billed - (flow_run.end_time - flow_run.start_time).total_seconds()


SLEEPER = '''
import time
from prefect import flow


@flow
def sleeper():
    time.sleep(600)
'''


def limit_to_gone(client, deployment_id, job_name: str, max_duration: float) -> float:
    """Seconds from a run's time limit (rent + max_duration, from its meter) to its container being gone."""
    run = client.create_flow_run_from_deployment(deployment_id)
    seen, gone_at = False, None
    for _ in range(6000):  # at most ~5 minutes
        listed = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=e31.job={job_name}"],
                                capture_output=True, text=True).stdout.split()
        if listed:
            seen = True
        elif seen:
            gone_at = time.time()
            break
        time.sleep(0.05)
    if gone_at is None:
        raise SystemExit(f"the container of run {run.id} never came and went")
    return gone_at - (meter_marks(client, run.id)["rented"] + max_duration)


def image_tag() -> str:
    built = subprocess.run([str(Path(__file__).resolve().parents[1] / "scripts" / "e31-image.sh")],
                           capture_output=True, text=True, check=True)
    return built.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--docker", action="store_true", help="also the docker pair (needs a Docker engine)")
    parser.add_argument("--load", type=int, default=0, help="processes spinning on the CPUs while runs are measured")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="e31-bench-"))
    os.environ.setdefault("E31_HOME", str(home / "e31"))
    server, url = start_server(home)
    folder = home / "flow"
    folder.mkdir()
    (folder / "noop.py").write_text(NOOP)
    workers, spinners = [], []
    try:
        from prefect import get_client

        with get_client(sync_client=True) as client:
            request = {"gpus": 1, "max_duration": "5m"}
            # (label, pool type, job variables); pairs are compared within one run.
            contenders = [("process", "process", {}), ("e31 process", "e31", {"request": request})]
            if args.docker:
                image = image_tag()
                contenders += [
                    ("docker", "docker", {"image": image, "image_pull_policy": "Never", "network_mode": "host",
                                          "volumes": [f"{folder}:{folder}:ro"]}),
                    ("e31 docker", "e31", {"request": request, "work": {"image": image}}),
                ]
            deployments = {}
            env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "10",
                   "E31_GPUS": "8xH100"}  # a declared inventory: each e31 run rents one (no GPU here)
            for label, kind, variables in contenders:
                pool = "bench-" + label.replace(" ", "-")
                deployments[label] = deploy(client, folder, pool, kind, variables, name=pool)
                workers.append(subprocess.Popen(
                    [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", kind],
                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
            time.sleep(8)
            for label, deployment_id in deployments.items():  # warm-up, not counted
                measure(client, deployment_id, label.startswith("e31"))
            spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
            completed: dict[str, list[float]] = {label: [] for label in deployments}
            closed: dict[str, list[float]] = {label: [] for label in deployments}
            beyond: dict[str, list[float]] = {label: [] for label in deployments}
            for _ in range(args.runs):
                for label, deployment_id in deployments.items():
                    to_completed, to_closed, billed_beyond = measure(client, deployment_id, label.startswith("e31"))
                    completed[label].append(to_completed)
                    closed[label].append(to_closed)
                    if billed_beyond is not None:
                        beyond[label].append(billed_beyond)
            gone = []
            if args.docker:
                (folder / "sleeper.py").write_text(SLEEPER)
                flow_id = client.create_flow_from_name("sleeper")
                sleeper = client.create_deployment(
                    flow_id=flow_id, name="limit", work_pool_name="bench-e31-docker", entrypoint="sleeper.py:sleeper",
                    path=str(folder),
                    pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(folder)}}],
                    job_variables={"request": {"gpus": 1, "max_duration": "6s"}, "work": {"image": image}})
                gone = [limit_to_gone(client, sleeper, "limit", 6.0) for _ in range(3)]
    finally:
        for spinner in spinners:
            spinner.kill()
        for worker in workers:
            os.killpg(worker.pid, 15)
        if server:
            os.killpg(server.pid, 15)

    loaded = f", {args.load} processes spinning on {os.cpu_count()} CPUs" if args.load else ""
    print(f"runs per worker: {args.runs} (server {url}, workers poll every 1 s{loaded}); medians:")
    for label in deployments:
        extra = f"   (meter closed: {statistics.median(closed[label]):.3f} s)" if label.startswith("e31") else ""
        print(f"  {label:<12} created -> Completed  {statistics.median(completed[label]):.3f} s{extra}")
    for baseline in ("process", "docker"):
        if baseline in completed:
            ratio = statistics.median(completed[f"e31 {baseline}"]) / statistics.median(completed[baseline])
            print(f"ratio e31 {baseline} / {baseline} worker: {ratio:.3f}  "
                  f"(goal <= {0.5 if baseline == 'process' else 1.1})")
    goals = {"e31 process": 0.3, "e31 docker": 0.5}
    for label, figures in beyond.items():
        if figures:
            print(f"billed beyond the flow's own time ({label}, {len(figures)} runs): median "
                  f"{statistics.median(figures):.3f} s, max {max(figures):.3f} s  (goal: median <= {goals[label]} s)")
    if gone:
        print(f"time limit -> container gone (e31 docker, {len(gone)} runs): median {statistics.median(gone):.3f} s, "
              f"max {max(gone):.3f} s  (goal <= 2 s)")


if __name__ == "__main__":
    main()
