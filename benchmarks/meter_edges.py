"""The meter's edges, seen from the job: how long any process of a job could use its GPUs beyond its bill,
and how soon its GPUs are free again once its flow returned.

    python benchmarks/meter_edges.py [--runs 20]

Two jobs, each run ``--runs`` times by one e31 worker (a declared inventory of 4 GPUs, a Prefect server
started here unless PREFECT_API_URL is set):

- ``readme``: the README's example (``deployments/jobs/retrain.yaml``, 1 GPU), its flow wrapped so that the
  job writes, from its own code, when its module was first imported and, every 5 ms from a thread of its own,
  that it is alive with its GPUs visible;
- ``2-gpu``: the same flow on 2 GPUs, leaving behind what a careless or hostile job leaves (a non-daemon thread
  still writing, an exit handler and a child that ignore SIGTERM).

For each run, against the run's meter (its ``e31-meter`` artifact): **device-visible beyond the bill** =
the last moment the job wrote minus ``run_ended`` (and its first moment minus ``rented``: negative would be
job code before the rent), and **devices back minus work end** = the first moment the run's GPU lock files
can be taken again by another process (polled every 2 ms here) minus the moment the flow function returned
(written by the job).
Median and max of each. Every time is this host's clock.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from uuid import UUID

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import meter_marks, start_server  # noqa: E402  (the same server and meter reading)

REPO = Path(__file__).resolve().parents[1]

TIMED = '''
import atexit, os, signal, subprocess, sys, threading, time
from pathlib import Path

FIRST = time.time()  # the job's own code runs from here: its flow's module is imported
import importlib.util
from prefect import flow

_spec = importlib.util.spec_from_file_location("retrain", Path(__file__).with_name("retrain.py"))
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
retrain = _module.retrain  # the README's example flow, unchanged


def alive(path, every=0.005):
    while True:
        if os.environ.get("CUDA_VISIBLE_DEVICES"):
            with open(path, "a") as out:
                out.write(f"{time.time()!r}\\n")
        time.sleep(every)


@flow
def timed(epochs: int = 3, leave_behind: bool = False):
    out = Path(os.environ["E31_OUTPUT_DIR"])
    (out / "first.txt").write_text(repr(FIRST))
    threading.Thread(target=alive, args=(out / "alive.txt",), daemon=not leave_behind).start()
    if leave_behind:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        atexit.register(time.sleep, 600)
        subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "time.sleep(600)"])
    result = retrain.fn(epochs=epochs)
    (out / "returned.txt").write_text(repr(time.time()))
    return result
'''


def moments(path: Path) -> list[float]:
    """The timestamps a job wrote, one a line (a line cut short by a kill is no moment)."""
    if not path.exists():
        return []
    return [float(line) for line in path.read_text().splitlines() if line.count(".") == 1]


class LockWatch:
    """Polls the declared GPUs' lock files: when each could last be taken by another process."""

    def __init__(self, folder: Path, gpus: int):
        self.paths = [folder / f"gpu-{index}.lock" for index in range(gpus)]
        self.free_since: dict[Path, float | None] = dict.fromkeys(self.paths)
        self.stop = threading.Event()
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        while not self.stop.is_set():
            for path in self.paths:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    self.free_since[path] = self.free_since[path] or time.time()
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    self.free_since[path] = self.free_since[path] or time.time()
                except BlockingIOError:
                    self.free_since[path] = None
                finally:
                    os.close(fd)
            time.sleep(0.002)

    def all_free_since(self) -> float | None:
        """Since when every GPU has been free (None: one is held now)."""
        since = list(self.free_since.values())
        return None if None in since else max(since)  # type: ignore[type-var]


def run_once(client, deployment_id, output_root: Path, watch: LockWatch) -> dict[str, float]:
    run = client.create_flow_run_from_deployment(deployment_id)
    for _ in range(6000):
        current = client.read_flow_run(run.id)
        if current.state and current.state.is_final() and any(t.startswith("e31:billed-s=") for t in current.tags):
            break
        time.sleep(0.05)
    else:
        raise SystemExit(f"run {run.id} did not finish")
    if not current.state.is_completed():
        raise SystemExit(f"run {run.id} ended {current.state.name}: {current.state.message}")
    marks = meter_marks(client, run.id)
    output = next(output_root.glob(f"*/{current.name}"))
    alive, first = moments(output / "alive.txt"), moments(output / "first.txt")
    returned = moments(output / "returned.txt")[0]
    back = watch.all_free_since()
    return {"beyond_bill": max(alive) - marks["run_ended"], "after_rent": first[0] - marks["rented"],
            "devices_back": (back - returned) if back else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="e31-edges-"))
    locks = home / "locks"
    os.environ.update(E31_HOME=str(home / "e31"), E31_DEVICE_LOCKS=str(locks))
    server, url = start_server(home)
    jobs = home / "jobs"
    shutil.copytree(REPO / "deployments" / "jobs" / "flows", jobs / "flows")
    shutil.copytree(REPO / "deployments" / "data", jobs / "data")  # inside the job's folder: a pool stages it
    (jobs / "flows" / "timed.py").write_text(TIMED)
    worker = None
    figures: dict[str, list[dict[str, float]]] = {}
    try:
        from prefect import get_client

        watch = LockWatch(locks, 4)
        env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "1", "E31_GPUS": "4xH100",
               "E31_REPORT_GRACE_SECONDS": "5"}
        worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", "edges", "--type",
                                   "e31"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        with get_client(sync_client=True) as client:
            deployments = {}
            for label, gpus, leave in (("readme", 1, False), ("2-gpu", 2, True)):
                text = (REPO / "deployments" / "jobs" / "retrain.yaml").read_text()
                text = text.replace("name: retrain-tonight", f"name: edges-{label}")
                text = text.replace("flows/retrain.py:retrain", "flows/timed.py:timed")
                text = text.replace("parameters: {epochs: 3}", f"parameters: {{epochs: 3, leave_behind: {leave}}}")
                text = text.replace("from: ../data/train.csv", "from: data/train.csv")
                text = text.replace("gpus: 1", f"gpus: {gpus}")
                text = text.replace('start: "22:00"', "").replace('deadline: "07:00"', "")
                (jobs / f"{label}.yaml").write_text(text)
                submitted = subprocess.run([str(Path(sys.executable).parent / "e31"), "submit",
                                            str(jobs / f"{label}.yaml"), "--pool", "edges"], capture_output=True,
                                           text=True, env=os.environ)
                if submitted.returncode != 0:
                    raise SystemExit(submitted.stdout + submitted.stderr)
                # The submitted run is a warm-up, not counted: its deployment is what later runs start from.
                first = UUID(re.search(r"\(([0-9a-f-]{36})\)", submitted.stdout).group(1))
                while not client.read_flow_run(first).state.is_final():
                    time.sleep(0.2)
                deployments[label] = client.read_flow_run(first).deployment_id
                figures[label] = []
            for _ in range(args.runs):
                for label, deployment_id in deployments.items():
                    figures[label].append(run_once(client, deployment_id, jobs / "outputs", watch))
    finally:
        if worker is not None:
            os.killpg(worker.pid, 15)
        if server:
            os.killpg(server.pid, 15)
    print(f"{args.runs} runs of each job, one e31 worker (server {url}); seconds, median (max):")
    for label, rows in figures.items():
        for key, meaning, goal in (
                ("beyond_bill", "device-visible beyond the bill (last job moment - run_ended)", "<= 0.3"),
                ("after_rent", "first job code after the rent (first job moment - rented)", ">= 0"),
                ("devices_back", "devices back - flow returned", "median <= 0.5")):
            values = [row[key] for row in rows]
            print(f"  {label:<7} {meaning:<62} {statistics.median(values):7.3f} ({max(values):7.3f})  goal {goal}")


if __name__ == "__main__":
    main()
