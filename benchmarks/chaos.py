"""200 short jobs over three e31 workers on one host while everything around them fails.

    python benchmarks/chaos.py [--jobs 200] [--gpus 4]

One host: three workers share its declared GPUs (E31_GPUS, one device-lock
folder) and its ledger (E31_HOME). While the jobs run, one worker is SIGKILLed
and another SIGTERMed (each replaced a few seconds later), the Prefect server
is restarted once, and the S3 server is unreachable for 30 s (a proxy in
front of moto refuses connections; moto keeps what it stored). Jobs write
their outputs to S3; some leave a setsid daemon behind.

Printed at the end, goal 0 for each:
- runs not terminal (state final and meter closed) 10 minutes after the chaos;
- outputs lost (after `e31 outputs retry` for runs whose store was down);
- GPUs rented twice (two runs' work overlapping on one device);
- concurrency slots leaked (the pool's limit still held after the end);
- processes left (job daemons, supervisors) and ledger entries left;
- meters off by more than 1 s from the supervisors' own accounting.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from overhead import free_port  # noqa: E402

from e31_prefect.host.ledger import process_running  # noqa: E402
from e31_prefect.host.settings import DURABLE_LEASES  # noqa: E402
from e31_prefect.model.meter import work_end  # noqa: E402

FLOW = '''
import json, os, subprocess, sys, time
from datetime import datetime, timezone
from prefect import flow
from e31_prefect import output_dir

@flow
def chaos(seconds: float, daemon: bool, extra_kib: int) -> str:
    started = datetime.now(timezone.utc).isoformat()
    if daemon:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "chaos-daemon"],
                         start_new_session=True)
    time.sleep(seconds)
    if extra_kib:
        (output_dir() / "extra.bin").write_bytes(os.urandom(extra_kib * 1024))
    (output_dir() / "ran.json").write_text(json.dumps({
        "devices": os.environ["CUDA_VISIBLE_DEVICES"], "started": started,
        "ended": datetime.now(timezone.utc).isoformat()}))
    return "ok"
'''


class Switch:
    """A TCP proxy in front of the S3 server that can be made unreachable (connections refused)."""

    def __init__(self, target_port: int):
        self.port = free_port()
        self.target_port = target_port
        self.loop = asyncio.new_event_loop()
        self.server: asyncio.AbstractServer | None = None
        self.connections: set[asyncio.StreamWriter] = set()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.up()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self.connections |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self.connections -= {writer, up_writer}

    def up(self) -> None:
        async def start() -> None:
            self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)
        asyncio.run_coroutine_threadsafe(start(), self.loop).result()

    def down(self) -> None:
        async def stop() -> None:
            assert self.server is not None
            self.server.close()
            for writer in list(self.connections):
                writer.transport.abort()
            await self.server.wait_closed()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result()


class Server:
    """The Prefect server, on one port and one database across a restart (PostgreSQL, or SQLite)."""

    def __init__(self, home: Path, database: str):
        self.port = free_port()
        self.home = home
        self.url = f"http://127.0.0.1:{self.port}/api"
        os.environ.update(PREFECT_API_URL=self.url, PREFECT_HOME=str(home / "prefect"),
                          PREFECT_SERVER_ANALYTICS_ENABLED="false", **DURABLE_LEASES)
        if database == "postgres":
            # Prefect past one machine: many workers share the server (scripts/postgres.sh).
            printed = subprocess.run([str(Path(__file__).parents[1] / "scripts" / "postgres.sh"),
                                      f"e31_chaos_{self.port}"], capture_output=True, text=True, check=True).stdout
            os.environ["PREFECT_API_DATABASE_CONNECTION_URL"] = printed.strip().split("=", 1)[1]
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        log = (self.home / "server.log").open("ab")
        self.process = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                         "--port", str(self.port)], stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        for _ in range(360):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise SystemExit("the Prefect server did not start")

    def stop(self) -> None:
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=60)
            self.process = None


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and process_running(int(entry)):
            with contextlib.suppress(OSError):
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--gpus", type=int, default=4, help="GPUs of the one host the three workers share")
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--window", type=float, default=600, help="seconds after the chaos for every run to end")
    parser.add_argument("--database", choices=["postgres", "sqlite"], default="postgres",
                        help="the Prefect server's database (postgres: scripts/postgres.sh)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    home = Path(tempfile.mkdtemp(prefix="e31-chaos-"))
    print(f"working in {home}", flush=True)

    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    switch = Switch(moto.get_host_and_port()[1])
    s3 = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{switch.port}", "AWS_ACCESS_KEY_ID": "chaos",
          "AWS_SECRET_ACCESS_KEY": "chaos", "AWS_DEFAULT_REGION": "us-east-1"}
    import boto3

    bucket = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{moto.get_host_and_port()[1]}",
                          aws_access_key_id="chaos", aws_secret_access_key="chaos", region_name="us-east-1")
    bucket.create_bucket(Bucket="chaos")

    server = Server(home, args.database)
    server.start()
    e31_home = home / "host"
    env = {**os.environ, **s3, "E31_HOME": str(e31_home), "E31_DEVICE_LOCKS": str(home / "locks"),
           "E31_GPUS": f"{args.gpus}xH100", "E31_WATCH_SECONDS": "1", "E31_STOP_GRACE_SECONDS": "2",
           "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_HEARTBEAT_SECONDS": "5"}
    bin_dir = Path(sys.executable).parent
    folder = home / "job"
    folder.mkdir()
    (folder / "flow.py").write_text(FLOW)
    pool = "chaos"
    subprocess.run([bin_dir / "e31", "quota", "set", "--pool", pool, str(args.gpus)], env=env, check=True,
                   capture_output=True)

    workers: dict[str, subprocess.Popen] = {}

    def start_worker(name: str) -> None:
        log = (home / f"worker-{name}.log").open("ab")
        workers[name] = subprocess.Popen([bin_dir / "prefect", "worker", "start", "--pool", pool, "--type", "e31",
                                          "--name", f"chaos-{name}"], env=env, stdout=log, stderr=subprocess.STDOUT)

    print(f"submitting {args.jobs} jobs ...", flush=True)
    submitting = time.monotonic()
    (folder / "chaos.yaml").write_text(
        "name: chaos\nwork: {flow: flow.py:chaos, parameters: {seconds: 1, daemon: false, extra_kib: 0}}\n"
        "request: {gpus: 1, max_duration: 2m}\noutput: {to: 's3://chaos/{flow_run.id}/'}\n")
    first = subprocess.run([bin_dir / "e31", "submit", str(folder / "chaos.yaml"), "--pool", pool], env=env,
                           capture_output=True, text=True, check=True)
    from prefect import get_client

    runs: dict[str, dict] = {}
    with get_client(sync_client=True) as client:
        deployment = client.read_flow_run(first.stdout.split("(", 1)[1].split(")", 1)[0]).deployment_id
        client.delete_flow_run(first.stdout.split("(", 1)[1].split(")", 1)[0])
        for _ in range(args.jobs):  # one deployment, a run per job with its own parameters, as Prefect users do
            parameters = {"seconds": round(rng.uniform(0.5, 4.0), 2), "daemon": rng.random() < 0.25,
                          "extra_kib": rng.choice([0, 0, 64, 1024])}
            run = client.create_flow_run_from_deployment(deployment, parameters=parameters)
            runs[str(run.id)] = parameters
    print(f"  submitted in {time.monotonic() - submitting:.0f} s", flush=True)
    for name in ("a", "b", "c"):
        start_worker(name)
    started = time.monotonic()

    def at(second: float) -> None:
        time.sleep(max(0.0, started + second - time.monotonic()))

    at(20)
    print("SIGKILL worker a", flush=True)
    workers["a"].kill()
    workers["a"].wait()
    at(25)
    start_worker("a2")
    at(40)
    print("SIGTERM worker b", flush=True)
    asked = time.monotonic()
    workers["b"].send_signal(signal.SIGTERM)
    try:
        workers["b"].wait(timeout=60)
        print(f"  worker b exited {time.monotonic() - asked:.1f} s after SIGTERM", flush=True)
    except subprocess.TimeoutExpired:
        print("  worker b did not exit within 60 s of SIGTERM", flush=True)
    at(45)
    start_worker("b2")
    at(60)
    print("restarting the Prefect server", flush=True)
    server.stop()
    server.start()
    print(f"  back after {time.monotonic() - started - 60:.1f} s", flush=True)
    at(100)
    print("S3 unreachable for 30 s", flush=True)
    switch.down()
    time.sleep(30)
    switch.up()
    print("S3 back", flush=True)
    chaos_over = time.monotonic()

    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    def closed(run) -> bool:
        return bool(run.state and run.state.is_final() and any(t.startswith("e31:billed-s=") for t in run.tags))

    pending = set(runs)
    with get_client(sync_client=True) as client:
        while pending and time.monotonic() - chaos_over < args.window:
            for run_id in list(pending):
                if closed(client.read_flow_run(run_id)):
                    pending.discard(run_id)
            if pending:
                time.sleep(2)
        print(f"all closed {time.monotonic() - started:.0f} s after the workers started "
              f"({len(pending)} not closed)", flush=True)
        for worker in workers.values():
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
        for worker in workers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.wait(timeout=30)
        kept = [r for r in runs if (e31_home / "spool" / r).exists()]
        for run_id in kept:
            subprocess.run([bin_dir / "e31", "outputs", "retry", run_id], env=env, capture_output=True)
        states: dict[str, int] = {}
        billed: dict[str, float] = {}
        completed: dict[str, bool] = {}
        for run_id in runs:
            run = client.read_flow_run(run_id)
            completed[run_id] = bool(run.state and run.state.is_completed())
            name = run.state.name if run.state else "None"
            states[name] = states.get(name, 0) + 1
            for artifact in client.read_artifacts(artifact_filter=ArtifactFilter(
                    flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))):
                if artifact.key and artifact.key.startswith("e31-meter"):
                    billed[run_id] = next(row["seconds"] for row in json.loads(artifact.data)
                                          if row["step"] == "total billed")
        slots = client.read_global_concurrency_limit_by_name(f"e31-pool-{pool}").active_slots

    lost, spans = 0, []
    for run_id in runs:
        try:
            ran = json.loads(bucket.get_object(Bucket="chaos", Key=f"{run_id}/ran.json")["Body"].read())
        except bucket.exceptions.NoSuchKey:
            # Lost: the run completed (its flow wrote ran.json) or never ended, yet ran.json is not there.
            lost += int(run_id in pending or completed.get(run_id, False))
            continue
        spans.append((ran["devices"], datetime.fromisoformat(ran["started"]), datetime.fromisoformat(ran["ended"])))
    twice = 0
    for device in {d for d, _, _ in spans}:
        ordered = sorted((s, e) for d, s, e in spans if d == device)
        twice += sum(1 for (_, end), (start, _) in zip(ordered, ordered[1:], strict=False) if start < end)

    accounted: dict[str, float] = {}
    accounting = e31_home / "accounting.jsonl"
    for line in accounting.read_text().splitlines() if accounting.exists() else []:
        entry = json.loads(line)
        if entry.get("rented") and entry.get("ended"):
            end = work_end(datetime.fromisoformat(entry["ended"]),
                           datetime.fromisoformat(entry["stop_requested"]) if entry.get("stop_requested") else None,
                           entry.get("grace_seconds", 0.0))
            accounted[entry["run_id"]] = (end - datetime.fromisoformat(entry["rented"])).total_seconds()
    off = sorted((abs(billed[r] - accounted[r]), r) for r in accounted if r in billed)
    off_by_more = [r for difference, r in off if difference > 1.0]
    unaccounted = [r for r in billed if r not in accounted and billed[r] > 0]

    time.sleep(2)
    daemons = processes_with("chaos-daemon")
    supervisors = processes_with("e31_prefect.supervisor")
    ledger_left = list((e31_home / "ledger").iterdir()) if (e31_home / "ledger").exists() else []
    moto.stop()
    server.stop()

    print(f"\nfinal states: {dict(sorted(states.items()))}")
    print(f"runs sent to the spool and retried: {len(kept)}")
    if off:
        print(f"largest difference between Prefect's meter and the supervisor's accounting: {off[-1][0]:.3f} s")
    print(f"\nruns not terminal {args.window:.0f} s after the chaos: {len(pending)}")
    print(f"outputs lost:                         {lost}")
    print(f"GPUs rented twice:                    {twice}")
    print(f"concurrency slots leaked:             {slots}")
    print(f"processes left (daemons/supervisors): {len(daemons)}/{len(supervisors)}")
    print(f"ledger entries left:                  {len(ledger_left)}")
    print(f"meters off by more than 1 s:          {len(off_by_more)} (and {len(unaccounted)} billed runs with no "
          "accounting line)")
    print("goal: all 0")


if __name__ == "__main__":
    main()
