"""Kill an e31 worker with SIGKILL mid-run, again and again: does anything stay held or billing?

    python benchmarks/crash_recovery.py [--rounds 20]

Each round: a 2-GPU job starts on a worker (pool capacity 4 as a global
concurrency limit), the worker is SIGKILLed while the job runs, a new worker
starts on the same host. Counted after each round: quota slots still held,
devices still used by the orphan (its process alive), and meters left open
(the flow run not final, or its meter tags missing). All must be 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from overhead import start_server  # noqa: E402

from e31_prefect.ledger import process_running  # noqa: E402

FLOW = '''
import time
from prefect import flow


@flow
def hold():
    time.sleep(600)
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="e31-crash-"))
    server, url = start_server(home)
    e31_home = home / "host"
    folder = home / "job"
    folder.mkdir()
    (folder / "flow.py").write_text(FLOW)
    (folder / "job.yaml").write_text("name: crash-me\nwork: {flow: flow.py:hold}\n"
                                     "request: {gpus: 2, max_duration: 1h}\n")
    env = {**os.environ, "E31_HOME": str(e31_home), "E31_GPUS": "2xH100", "E31_WATCH_SECONDS": "0.5",
           "PREFECT_WORKER_QUERY_SECONDS": "1"}
    bin_dir = Path(sys.executable).parent
    leaks = {"slots": 0, "devices": 0, "meters": 0}
    try:
        subprocess.run([bin_dir / "e31", "quota", "set", "--pool", "crash", "4"], env=env, check=True,
                       capture_output=True)
        from prefect import get_client

        for round_number in range(1, args.rounds + 1):
            submitted = subprocess.run([bin_dir / "e31", "submit", str(folder / "job.yaml"), "--pool", "crash"],
                                       env=env, capture_output=True, text=True, check=True)
            run_id = submitted.stdout.split("(", 1)[1].split(")", 1)[0]
            worker = subprocess.Popen([bin_dir / "prefect", "worker", "start", "--pool", "crash", "--type", "e31"],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            entry = e31_home / "ledger" / f"{run_id}.json"
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if entry.exists() and json.loads(entry.read_text()).get("infrastructure"):
                    break
                time.sleep(0.2)
            time.sleep(1)
            orphan = int(json.loads(entry.read_text())["infrastructure"])
            worker.send_signal(signal.SIGKILL)
            worker.wait()
            subprocess.run([bin_dir / "prefect", "worker", "start", "--pool", "crash", "--type", "e31",
                            "--run-once"], env=env, capture_output=True, check=True)
            with get_client(sync_client=True) as client:
                slots = client.read_global_concurrency_limit_by_name("e31-pool-crash").active_slots
                run = client.read_flow_run(run_id)
            open_meter = not (run.state and run.state.is_final() and any(t.startswith("e31:billed-s=")
                                                                         for t in run.tags))
            leaks["slots"] += slots
            leaks["devices"] += int(process_running(orphan))
            leaks["meters"] += int(open_meter)
            print(f"round {round_number:>2}: state {run.state.name if run.state else None}, slots held {slots}, "
                  f"orphan alive {process_running(orphan)}, meter open {open_meter}", flush=True)
    finally:
        if server:
            os.killpg(server.pid, 15)
    print(f"after {args.rounds} SIGKILLed workers: slots leaked {leaks['slots']}, devices leaked "
          f"{leaks['devices']}, meters left open {leaks['meters']}  (goal: 0, 0, 0)")


if __name__ == "__main__":
    main()
