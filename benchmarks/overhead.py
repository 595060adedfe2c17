"""Submit-to-Completed of a no-op flow: the e31 worker against Prefect's own process worker.

    python benchmarks/overhead.py [--runs 20]

Both workers poll one Prefect server (started here unless PREFECT_API_URL is
set) every second; runs alternate between them so machine noise falls on
both. Times come from the server's own timestamps: flow run created ->
Completed state. For e31 it also reports created -> meter closed (tags set),
which includes the output and release steps that follow Completed.
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


def deploy(client, folder: Path, pool: str, kind: str, job_variables: dict) -> object:
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.base import BaseWorker

    worker_class = BaseWorker.get_worker_class_from_type(kind)
    client.create_work_pool(WorkPoolCreate(name=pool, type=kind,
                                           base_job_template=worker_class.get_default_base_job_template()),
                            overwrite=True)
    flow_id = client.create_flow_from_name("noop")
    return client.create_deployment(
        flow_id=flow_id, name=f"noop-{kind}", work_pool_name=pool, entrypoint="noop.py:noop",
        path=str(folder),
        pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(folder)}}],
        job_variables=job_variables,
    )


def measure(client, deployment_id, metered: bool) -> tuple[float, float]:
    """Seconds from creation to Completed, and to the meter being closed (e31 only)."""
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
                return ((completed_at - current.created).total_seconds(),
                        closed - current.created.timestamp())
        time.sleep(0.1)
    raise SystemExit(f"run {run.id} did not finish")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="e31-bench-"))
    os.environ.setdefault("E31_HOME", str(home / "e31"))
    server, url = start_server(home)
    folder = home / "flow"
    folder.mkdir()
    (folder / "noop.py").write_text(NOOP)
    workers = []
    try:
        from prefect import get_client

        with get_client(sync_client=True) as client:
            deployments = {
                "process": deploy(client, folder, "bench-process", "process", {}),
                "e31": deploy(client, folder, "bench-e31", "e31",
                              {"request": {"gpus": 0, "max_duration": "5m"}}),
            }
            env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "10"}
            for kind in deployments:
                workers.append(subprocess.Popen(
                    [sys.executable, "-m", "prefect", "worker", "start", "--pool", f"bench-{kind}", "--type", kind],
                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
            time.sleep(8)
            for kind, deployment_id in deployments.items():  # warm-up, not counted
                measure(client, deployment_id, kind == "e31")
            completed: dict[str, list[float]] = {"process": [], "e31": []}
            closed: list[float] = []
            for _ in range(args.runs):
                for kind, deployment_id in deployments.items():
                    to_completed, to_closed = measure(client, deployment_id, kind == "e31")
                    completed[kind].append(to_completed)
                    if kind == "e31":
                        closed.append(to_closed)
    finally:
        for worker in workers:
            os.killpg(worker.pid, 15)
        if server:
            os.killpg(server.pid, 15)

    process_median = statistics.median(completed["process"])
    e31_median = statistics.median(completed["e31"])
    print(f"runs per worker:                        {args.runs} (server {url}, workers poll every 1 s)")
    print(f"process worker, created -> Completed:   median {process_median:.3f} s")
    print(f"e31 worker, created -> Completed:       median {e31_median:.3f} s")
    print(f"e31 worker, created -> meter closed:    median {statistics.median(closed):.3f} s")
    print(f"ratio e31 / process (Completed):        {e31_median / process_median:.3f}  (goal <= 1.10)")


if __name__ == "__main__":
    main()
