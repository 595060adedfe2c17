"""A job tries to move its own bill: it says its flow returned while it goes on, or leaves something running
after its flow returns. The meter ends only when its last process is gone, and a run is Completed only if its
flow returned and its process ended.

Each job writes, from its own code, the moments it was alive (``alive.txt`` in its output dir, a line every
10 ms), with its GPUs visible (``CUDA_VISIBLE_DEVICES``); the test holds them against the run's meter.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.integration.conftest import cli, flow_run_id
from tests.integration.test_jobs_end_to_end import artifacts_of, read_run, write_job

pytestmark = pytest.mark.integration

# A thread of the job's own that writes a line each 10 ms while any GPU is visible to it.
ALIVE = '''
import os, threading, time
from pathlib import Path

def keep_saying_alive(daemon=True):
    alive = Path(os.environ["E31_OUTPUT_DIR"], "alive.txt")
    def say():
        while True:
            if os.environ.get("CUDA_VISIBLE_DEVICES"):
                with alive.open("a") as out:
                    out.write(f"{time.time()!r}\\n")
            time.sleep(0.01)
    threading.Thread(target=say, daemon=daemon).start()
'''

# The three ways a job found the pipe its engine says "the flow returned" on.
FORGE = {
    "entry-global": 'path = next(f.f_globals["_pipe"][0] for f, _ in traceback.walk_stack(None) '
                    'if f.f_globals.get("_pipe"))',
    "frame-local": 'path = next(f.f_locals["path"] for f, _ in traceback.walk_stack(None) '
                   'if f.f_code.co_name == "main" and "path" in f.f_locals)',
    "ledger": 'path = str(Path(os.environ["E31_OUTPUT_DIR"], "..", "..", "..", "ledger", '
              'os.environ["PREFECT__FLOW_RUN_ID"], "work-ended"))',
}

LIAR = ALIVE + '''
import sys, traceback
from prefect import flow

@flow
def liar(seconds: float) -> str:
    keep_saying_alive()
    FORGE_HERE
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    os.write(fd, b"completed\\n")
    os.close(fd)
    time.sleep(seconds)  # working on, its GPUs visible, after it said its flow returned
    return "never"
'''

LEAVER = ALIVE + '''
import atexit, signal, subprocess, sys
from prefect import flow

@flow
def leaver() -> str:
    keep_saying_alive(daemon=False)  # a thread the interpreter would wait for
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    atexit.register(time.sleep, 600)  # an exit handler that would hold the process
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a child that would go on
    return "returned"
'''


def meter_marks(run_id) -> dict[str, datetime]:
    rows = json.loads(artifacts_of(run_id)["meter"].data)
    return {row["step"]: datetime.fromisoformat(row["at"]) for row in rows if row["at"]}


def alive_moments(output: Path) -> list[datetime]:
    """The moments the job wrote (a line cut short by its kill is no moment)."""
    lines = (output / "alive.txt").read_text().splitlines()
    return [datetime.fromtimestamp(float(line), tz=timezone.utc) for line in lines if line.count(".") == 1]


@pytest.mark.parametrize("way", sorted(FORGE))
def test_a_job_that_says_its_flow_returned_and_goes_on_is_billed_to_its_kill_and_fails(way, prefect_server,
                                                                                        tmp_path, pool):
    job = write_job(tmp_path / "liar", """
        name: liar
        work: {flow: flow.py:liar, parameters: {seconds: 600}}
        request: {gpus: 2, max_duration: 10m}
        output: {to: ./out/}
        """, flow=LIAR.replace("FORGE_HERE", FORGE[way]))
    result = cli("e31", "run", str(job), "--pool", pool, gpus="4xH100", env={"E31_REPORT_GRACE_SECONDS": "4"})
    run_id = flow_run_id(result.stdout)
    assert result.returncode != 0, result.stdout + result.stderr
    state = read_run(run_id).state
    assert state.is_failed() and state.name == "KeptRunning", (state.name, state.message)
    assert "said its flow returned" in state.message
    marks = meter_marks(run_id)
    moments = alive_moments(tmp_path / "liar" / "out")
    # Every moment it could use its GPUs is billed: it worked its report grace (4 s) after its word.
    assert max(moments) <= marks["run_ended"], (max(moments), marks["run_ended"])
    assert (max(moments) - min(moments)).total_seconds() >= 3.5
    assert min(moments) >= marks["rented"]


def test_what_a_flow_leaves_running_ends_with_it_and_is_billed(prefect_server, tmp_path, pool):
    """A non-daemon thread, an exit handler and a child that ignore SIGTERM: the run is Completed (its flow
    returned), and nothing of the job is alive past the end of its bill."""
    job = write_job(tmp_path / "leaver", """
        name: leaver
        work: {flow: flow.py:leaver}
        request: {gpus: 2, max_duration: 10m}
        output: {to: ./out/}
        """, flow=LEAVER)
    result = cli("e31", "run", str(job), "--pool", pool, gpus="4xH100")
    assert result.returncode == 0, result.stdout + result.stderr
    run_id = flow_run_id(result.stdout)
    assert read_run(run_id).state.is_completed()
    marks = meter_marks(run_id)
    assert max(alive_moments(tmp_path / "leaver" / "out")) <= marks["run_ended"]
    # Left to Python, the exit handler alone would have kept the process (and its GPUs) for 600 s.
    assert (marks["run_ended"] - marks["rented"]).total_seconds() < 300
