"""The Prefect API goes down: a run is billed its work, not the outage, and a worker still stops on SIGTERM.

Each test has a Prefect server of its own (the session's stays up for the others): one stops it while a job
is finishing its work and starts it again 20 s later on the same database; one pauses it while a worker stops.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from uuid import UUID

import httpx
import pytest

from e31_prefect.host.ledger import Record, RunFolder
from e31_prefect.model.meter import work_end
from tests.integration.conftest import flow_run_id
from tests.integration.test_jobs_end_to_end import write_job
from tests.integration.test_worker_faults import Worker, until

pytestmark = pytest.mark.integration

FLOW = """
import time
from prefect import flow
from e31_prefect import output_dir

@flow
def work(seconds: float) -> str:
    time.sleep(seconds)
    (output_dir() / "done.txt").write_text("done")
    return "done"
"""


class OwnServer:
    """A Prefect server on its own port and database, that a test may stop and start again."""

    def __init__(self, home: Path):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.home = home
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": self.api_url}
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        log = (self.home / "server.log").open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        until(self.healthy, 180, "the Prefect server answering", every=0.5)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.api_url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def pause(self) -> None:
        """The server stops answering, as behind a network partition: connections open, nothing comes back."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGTERM)
            os.killpg(self.process.pid, signal.SIGCONT)  # where a test paused it
            self.process.wait(timeout=60)
            self.process = None


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[OwnServer]:
    home = tmp_path / "prefect"
    home.mkdir()
    server = OwnServer(home)
    server.start()
    yield server
    server.stop()


def run_cli(server: OwnServer, *args: str) -> subprocess.CompletedProcess[str]:
    program = str(Path(sys.executable).parent / args[0])
    return subprocess.run([program, *args[1:]], env=server.env, capture_output=True, text=True, timeout=240)


def submit_work(server: OwnServer, folder: Path, name: str, seconds: float, pool: str) -> UUID:
    """``e31 submit`` a job of ``seconds`` of work (then done.txt in its ./out/) to ``pool``; its run's id."""
    job = write_job(folder, f"""
        name: {name}
        work: {{flow: flow.py:work, parameters: {{seconds: {seconds}}}}}
        request: {{gpus: 1, max_duration: 10m}}
        output: {{to: ./out/}}
        """, flow=FLOW)
    submitted = run_cli(server, "e31", "submit", str(job), "--pool", pool)
    assert submitted.returncode == 0, submitted.stderr
    return flow_run_id(submitted.stdout)


def test_an_api_outage_at_the_end_of_a_run_is_billed_to_nobody(own_server, tmp_path):
    run_id = submit_work(own_server, tmp_path / "job", "outage", seconds=6, pool="outage")
    home = tmp_path / "host"
    # The engine cannot report while the API is down: it gives up after E31_REPORT_SECONDS (5 s by default) and
    # leaves, well within its report grace.
    worker = Worker("outage", home, "1xH100", PREFECT_API_URL=own_server.api_url, PREFECT_HOME=str(own_server.home))
    folder = RunFolder(home / "ledger" / str(run_id))
    try:
        record = until(lambda: (r := folder.record()) is not None and r.started and r, 120, "the work starting")
        time.sleep(max(0.0, 4 - (datetime.now().astimezone() - datetime.fromisoformat(record.started))
                       .total_seconds()))
        own_server.stop()  # two seconds before the work ends: the engine cannot report it
        final: Record = until(lambda: (r := folder.record()) is not None and r.finished and r, 120,
                              "the work ending while the API is down")
        holding = folder.holding()
        time.sleep(20)
        api_back = datetime.now().astimezone()
        own_server.start()
        until(lambda: not folder.path.exists(), 180, "the worker closing the run once the API is back")
    finally:
        worker.stop(timeout=30)
    assert final.work_ended is not None and final.outcome == "completed", "the job never said its flow returned"
    assert final.unreported and final.ending == "exited", final
    true_end = work_end(datetime.fromisoformat(final.ended))
    true_bill = (true_end - datetime.fromisoformat(holding.marks["rented"])).total_seconds()
    # The bill holds the 6 s of work and ends when its process left, having tried to report for at most
    # E31_REPORT_SECONDS: a whole outage (20 s) before the API came back, not at the moment the worker could
    # report it. (Not a bound on the engine's start, which load stretches.)
    assert true_bill >= 6
    reported_for = (datetime.fromisoformat(final.ended) - datetime.fromisoformat(final.work_ended)).total_seconds()
    assert reported_for <= 5 + 2, reported_for  # E31_REPORT_SECONDS (5), and the entry leaving
    assert (api_back - true_end).total_seconds() >= 19, (true_end, api_back)
    with httpx.Client(base_url=own_server.api_url) as api:
        run = api.get(f"/flow_runs/{run_id}").json()
        artifacts = api.post("/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [str(run_id)]}}}).json()
    assert run["state"]["type"] == "COMPLETED", run["state"]
    meter = next(json.loads(a["data"]) for a in artifacts if a["key"].startswith("e31-meter"))
    billed = next(row["seconds"] for row in meter if row["step"] == "total billed")
    assert abs(billed - true_bill) <= 1.0, (billed, true_bill)
    assert (tmp_path / "job" / "out" / "done.txt").read_text() == "done"



def test_a_worker_stopped_while_its_api_does_not_answer_exits_and_loses_no_run(own_server, tmp_path):
    """A service manager stops a worker while its Prefect server does not answer (paused, as behind a
    network partition) and a run is going: the worker exits within the grace a container platform gives
    (Kubernetes' 30 s), leaving unsent the logs and events the API could not take, and says so (Prefect's
    client would wait out its requests' timeouts and retries first: minutes). The run stays with its
    supervisor; once the API answers again, the next worker closes it."""
    run_id = submit_work(own_server, tmp_path / "job", "stopped-in-outage", seconds=8, pool="stopped")
    home = tmp_path / "host"
    env = {"PREFECT_API_URL": own_server.api_url, "PREFECT_HOME": str(own_server.home)}
    worker = Worker("stopped", home, "1xH100", **env)
    folder = RunFolder(home / "ledger" / str(run_id))
    try:
        until(lambda: (r := folder.record()) is not None and r.started, 120, "the work starting")
        own_server.pause()
        seconds = worker.stop(timeout=120)
    finally:
        if worker.process.poll() is None:
            worker.kill()
    said = worker.output()
    assert worker.process.returncode == 0, said
    assert seconds < 30, said
    assert "left without sending" in said, (seconds, said)
    own_server.resume()
    successor = Worker("stopped", home, "1xH100", **env)
    try:
        until(lambda: not folder.path.exists(), 180, "the next worker closing the run")
    finally:
        successor.stop(timeout=60)
    with httpx.Client(base_url=own_server.api_url) as api:
        run = api.get(f"/flow_runs/{run_id}").json()
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert (tmp_path / "job" / "out" / "done.txt").read_text() == "done"
