"""What a process job's own PID namespace costs the host per run: CPU and wall time of its work's start and end.

    git archive <commit before it> e31_prefect | tar -x -C /tmp/e31-before     # the code without it
    sudo python benchmarks/pid_namespace.py --runs 20 --before /tmp/e31-before

As root (a job's own uid and namespaces), no Prefect: each run is what a run's supervisor does with a
process job's work (:class:`e31_prefect.host.supervised_work.ProcessWork`), its view, uid, network and
cgroup as a root worker gives them, the job itself a no-op (``python -S -c pass``): start it, wait for
its end, stop all of it (the meter's end), clean up. The sweep of the uid's world-writable folders and
the scan for them (the same with or without the namespace, about a second) are left out.

Per run, for this checkout's code and for ``--before``'s, alternately: the wall time from the start to
the work's process being started (``start``), from its exit to its last process gone (``end``), and the
CPU time of the supervisor's side and every process of the work (``cpu``: user + system, of this process
and its reaped children). Prints the median of each, and what this checkout adds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MEASURE = r"""
import json, os, resource, selectors, sys, time
from pathlib import Path
from e31_prefect.host import leftovers
from e31_prefect.host.ledger import Record, RunFolder, Spec
from e31_prefect.host.supervised_work import ProcessWork
import e31_prefect

leftovers.sweep = lambda uid, folders: []  # the same with or without a PID namespace, and slow: left out
leftovers.world_writable = lambda *args, **kwargs: []
folder, index = Path(sys.argv[1]), sys.argv[2]
run = folder / f"run-{index}"
run.mkdir(mode=0o755)
view = [sys.prefix, sys.base_prefix, str(Path(e31_prefect.__file__).parent.parent), str(folder)]
spec = Spec(run_id=f"pid-bench-{os.getpid()}", runtime="process", stop_at=None,
            argv=[sys.executable, "-S", "-c", "pass"], env={"PATH": os.environ["PATH"]}, cwd=str(run),
            private_network=True, job_user_locks=str(folder / "job-users"), job_view=view,
            job_uids=[61940, 61949])

def cpu():
    return sum(getattr(resource.getrusage(who), field) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for field in ("ru_utime", "ru_stime"))

cpu_0, wall_0 = cpu(), time.perf_counter()
work = ProcessWork(spec, RunFolder(run), Record(supervisor_pid=os.getpid(), supervisor_started="0"))
work.start()
started = time.perf_counter()
selector = selectors.DefaultSelector()
selector.register(work.fileno(), selectors.EVENT_READ)
while work.ended() is None:
    selector.select(1)
exited = time.perf_counter()
work.stop_all()
gone = time.perf_counter()
work.clean_up()
print(json.dumps({"start": started - wall_0, "end": gone - exited, "cpu": cpu() - cpu_0,
                  "code": e31_prefect.__file__}))
"""


def one_run(code: Path, folder: Path, index: int) -> dict[str, float]:
    """One run's figures, in a fresh process importing e31_prefect from ``code`` (its figures its own)."""
    done = subprocess.run([sys.executable, "-c", MEASURE, str(folder), str(index)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(code)}, cwd=folder, check=False)
    if done.returncode != 0:
        raise SystemExit(f"a run failed:\n{done.stdout}{done.stderr}")
    figures = json.loads(done.stdout.splitlines()[-1])
    assert Path(figures.pop("code")).is_relative_to(code), "the run imported another e31_prefect"
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--before", type=Path, required=True, help="a folder holding e31_prefect without it")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: a job's own uid and namespaces need it")
    here = Path(__file__).resolve().parents[1]
    folder = Path(tempfile.mkdtemp(prefix="e31-pid-bench-", dir="/var/tmp"))
    folder.chmod(0o755)
    figures: dict[str, list[dict[str, float]]] = {"before": [], "now": []}
    for index in range(args.runs):
        figures["before"].append(one_run(args.before.resolve(), folder, 2 * index))
        figures["now"].append(one_run(here, folder, 2 * index + 1))
    medians = {name: {key: statistics.median(run[key] for run in runs) for key in ("start", "end", "cpu")}
               for name, runs in figures.items()}
    print(f"{args.runs} runs each, medians (ms)      start     end     cpu")
    for name in ("before", "now"):
        print(f"  {name:<30} {medians[name]['start'] * 1e3:7.1f} {medians[name]['end'] * 1e3:7.1f}"
              f" {medians[name]['cpu'] * 1e3:7.1f}")
    added = {key: (medians["now"][key] - medians["before"][key]) * 1e3 for key in ("start", "end", "cpu")}
    print(f"  {'added by this checkout':<30} {added['start']:7.1f} {added['end']:7.1f} {added['cpu']:7.1f}")
    subprocess.run(["rm", "-rf", str(folder)], check=False)


if __name__ == "__main__":
    main()
