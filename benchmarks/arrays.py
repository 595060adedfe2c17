"""Ten thousand pieces of work three ways: an e31 job array, the process floor, and one flow run each.

    python benchmarks/arrays.py [--shards 10000] [--gpus 8] [--flow-runs 1000]

In one run, on declared GPUs (E31_GPUS=<gpus>xH100, no GPU needed), on one Prefect
server (started here unless PREFECT_API_URL is set):

- e31: ``e31 run`` of a job of ``--shards`` no-op shards (``true``) over ``--gpus``
  GPUs, one at a time per GPU. Its time is the work's (the meter's running ->
  run_ended: the flow's engine, every shard, the end), and, for reference, the
  whole ``e31 run`` (submit, worker, staging, output, release).
- floor: the same commands started by ``xargs -P <gpus>`` (starting N processes on
  G slots, nothing else), measured before and after e31; the faster counts.
- flow runs: ``--flow-runs`` runs of a no-op flow through Prefect's process worker
  with ``--gpus`` slots (``--limit``), from the worker's start to the last Completed,
  scaled to ``--shards``.

Prints each wall time, e31's ratio to the floor (goal <= 1.2) and how many times faster
than the flow-run way it is (goal >= 50x), and e31's overhead per shard in ms.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import NOOP, deploy, start_server  # noqa: E402  (a sibling script, not a package)

JOB = """\
name: bench-array
work:
  command: ["true"]
  shards: {shards}
request: {{gpus: {gpus}, max_duration: 2h}}
"""


def e31_array(folder: Path, shards: int, gpus: int) -> tuple[float, float]:
    """Seconds of the job's work (running -> run_ended on its meter) and of the whole ``e31 run``."""
    job = folder / "array.yaml"
    job.write_text(JOB.format(shards=shards, gpus=gpus))
    e31 = shutil.which("e31", path=str(Path(sys.executable).parent)) or "e31"
    started = time.monotonic()
    result = subprocess.run([e31, "run", str(job), "--now", "--pool", "bench-arrays"], capture_output=True,
                            text=True, env={**os.environ, "E31_GPUS": f"{gpus}xH100"})
    whole = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(f"e31 run failed:\n{result.stdout}\n{result.stderr}")
    work = re.search(r"^\s+run_ended\s+\S+\s+([\d.]+) s", result.stdout, re.MULTILINE)
    if work is None:
        raise SystemExit(f"no meter in the output of e31 run:\n{result.stdout}")
    return float(work.group(1)), whole


def floor(shards: int, slots: int) -> float:
    """Seconds for ``xargs -P slots`` to start ``true`` once per shard."""
    started = time.monotonic()
    subprocess.run(["xargs", "-P", str(slots), "-n", "1", "true"], input="".join(f"{i}\n" for i in range(shards)),
                   text=True, check=True)
    return time.monotonic() - started


def flow_runs(folder: Path, runs: int, slots: int) -> float:
    """Seconds from a process worker's start to the last of ``runs`` no-op flow runs Completed."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterDeploymentId,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    (folder / "noop.py").write_text(NOOP)
    with get_client(sync_client=True) as client:
        deployment = deploy(client, folder, "bench-flow-runs", "process", {}, name="bench-flow-runs")
        for _ in range(runs):
            client.create_flow_run_from_deployment(deployment)
        env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "10"}
        started = time.monotonic()
        worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", "bench-flow-runs",
                                   "--type", "process", "--limit", str(slots)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        try:
            final = FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment]),
                                  state=FlowRunFilterState(type=FlowRunFilterStateType(
                                      any_=[StateType.COMPLETED, StateType.FAILED, StateType.CRASHED])))
            while (done := client.count_flow_runs(flow_run_filter=final)) < runs:
                if worker.poll() is not None:
                    raise SystemExit(f"the process worker exited after {done} of {runs} runs")
                time.sleep(0.5)
            return time.monotonic() - started
        finally:
            if worker.poll() is None:
                os.killpg(worker.pid, 15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--flow-runs", type=int, default=1_000)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="e31-bench-arrays-"))
    os.environ.setdefault("E31_HOME", str(home / "e31"))
    server, url = start_server(home)
    folder = home / "jobs"
    folder.mkdir()
    folder.chmod(0o755)  # a job's own user (where the worker is root) reads its folder
    try:
        # The floor before and after e31, the faster counted: the machine (a server settling down, say)
        # must not make the floor look slow and e31 look good.
        floors = [floor(args.shards, args.gpus)]
        work_s, whole_s = e31_array(folder, args.shards, args.gpus)
        floors.append(floor(args.shards, args.gpus))
        floor_s = min(floors)
        runs_s = flow_runs(folder, args.flow_runs, args.gpus) if args.flow_runs else None
    finally:
        if server:
            os.killpg(server.pid, 15)

    n = args.shards
    print(f"{n} no-op pieces over {args.gpus} declared GPUs / slots (server {url}; {os.cpu_count()} CPUs):")
    print(f"  {'floor: xargs -P ' + str(args.gpus):<36} {floor_s:9.2f} s   (before and after e31: "
          f"{floors[0]:.2f} s, {floors[1]:.2f} s)")
    print(f"  {'e31 job array (meter: the work)':<36} {work_s:9.2f} s   (whole `e31 run`: {whole_s:.2f} s)")
    if runs_s is not None:
        scaled = runs_s * n / args.flow_runs
        print(f"  {f'flow runs: {args.flow_runs} via process worker':<36} {runs_s:9.2f} s   "
              f"(scaled to {n}: {scaled:.1f} s)")
    print(f"ratio e31 / floor: {work_s / floor_s:.2f}  (goal <= 1.2)")
    if runs_s is not None:
        print(f"e31 faster than flow runs: {scaled / work_s:.0f}x  (goal >= 50x)")
    print(f"e31 overhead per shard over the floor: {1000 * (work_s - floor_s) / n:.3f} ms")


if __name__ == "__main__":
    main()
