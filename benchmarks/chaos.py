"""60 jobs over three e31 hosts while everything around them fails, hosts and GPUs included.

    python benchmarks/chaos.py [--jobs 60] [--hosts 3] [--gpus 4] [--host-lost-seconds 60]
    python benchmarks/chaos.py --small   # 12 jobs, faults at half pace, a 60 s cut: about 5 minutes

Three hosts on this machine, each its own E31_HOST_NAME, E31_HOME, device locks and declared GPUs, with a
worker each, on one pool of a Prefect server on PostgreSQL. Jobs write their outputs to S3; some leave a
setsid daemon behind. While they run:

- a worker is SIGKILLed, another SIGTERMed (each started again a few seconds later);
- the Prefect server is restarted once (its outage must stop nothing: it is shorter than the fence);
- a host is lost: every process of it SIGKILLed at once, its E31_HOME kept; it starts again once the pool
  requeued its runs (what it says then must change nothing); later it is lost again, its E31_HOME wiped,
  and it starts again at once (its own worker ends what its wiped ledger forgot);
- a GPU fails: the host's health command says so from then on;
- a host is cut off: its worker and supervisors SIGSTOPped for 3 minutes (``--partition-seconds``; its jobs'
  processes go on until its fence stops them), then SIGCONTed;
- the S3 server is unreachable for 30 s (a proxy in front of moto refuses connections).

Printed at the end, goal 0 for each but the requeue times:
- runs not Completed before their deadline;
- runs that ran twice at once (a job's processes alive on two hosts in one look, every half second);
- outputs lost (after `e31 outputs retry` for runs whose store was down);
- lost attempts whose meter did not close within 5 s of their host's last heartbeat (the GPU's failure);
- the time from each fault to the requeue of each attempt it lost: median and max;
- GPUs rented twice, concurrency slots leaked, processes and ledger entries left, meters off by more than
  1 s from the supervisors' own accounting (attempts that ended on their own host).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from overhead import free_port  # noqa: E402

from e31_prefect.host.disk import unmount_under  # noqa: E402
from e31_prefect.host.heartbeat import host_variable  # noqa: E402
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
        "devices": os.environ["CUDA_VISIBLE_DEVICES"], "home": os.environ["E31_OUTPUT_DIR"].split("/workspaces/")[0],
        "started": started, "ended": datetime.now(timezone.utc).isoformat()}))
    return "ok"
'''


def now() -> datetime:
    return datetime.now(timezone.utc)


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


def _proc(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def _cwd(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""


def live_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and process_running(int(entry))]


class Host:
    """One e31 host on this machine: its name, home, device locks, declared GPUs, and its worker."""

    def __init__(self, root: Path, name: str, gpus: int, pool: str, env: dict[str, str], bin_dir: Path):
        self.name, self.pool, self.bin_dir = name, pool, bin_dir
        self.home = root / name
        self.env = {**env, "E31_HOST_NAME": name, "E31_HOME": str(self.home),
                    "E31_DEVICE_LOCKS": str(root / f"{name}-locks"), "E31_GPUS": f"{gpus}xH100",
                    "E31_GPU_HEALTH_COMMAND": f"test ! -e {root}/{name}-bad-gpu-{{index}}"}
        self.bad = root / f"{name}-bad-gpu-"
        self.worker: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        log = (self.home.parent / f"worker-{self.name}-{self.starts}.log").open("ab")
        self.worker = subprocess.Popen([self.bin_dir / "prefect", "worker", "start", "--pool", self.pool,
                                        "--type", "e31", "--name", f"chaos-{self.name}"],
                                       env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def processes(self) -> list[int]:
        """Every process of this host: its workers, supervisors, fence keepers and jobs (by home or workspace)."""
        home = str(self.home).encode()
        found = []
        for pid in live_pids():
            if home in _proc(pid, "cmdline") or b"E31_HOME=" + home + b"\0" in _proc(pid, "environ") \
                    or _cwd(pid).startswith(str(self.home) + "/"):
                found.append(pid)
        return found

    def supervisors(self) -> list[int]:
        home = str(self.home).encode()
        return [pid for pid in live_pids() if b"e31_prefect.supervisor" in _proc(pid, "cmdline")
                and home in _proc(pid, "cmdline")]

    def lose(self) -> None:
        """A power cut: every process of the host SIGKILLed at once."""
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.worker is not None:
            self.worker.wait()
        unmount_under(self.home)  # a host that starts again mounts nothing of what it had

    def partition(self) -> list[int]:
        """Its worker and supervisors stop answering (SIGSTOP); their pids, to SIGCONT."""
        stopped = [self.worker.pid] if self.worker is not None else []
        stopped += self.supervisors()
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        return stopped


class Watch:
    """Looks at the hosts every half second: which runs' job processes are alive on which host (a run alive on
    two at once ran twice), and each host's heartbeat as Prefect has it."""

    def __init__(self, hosts: list[Host], api: str):
        self.hosts, self.api = hosts, api
        self.twice: set[str] = set()
        self.beats: dict[str, list[datetime]] = {host.name: [] for host in hosts}
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client = httpx.Client(timeout=5)
        homes = {str(host.home) + "/": host.name for host in self.hosts}
        while not self.stop.is_set():
            alive: dict[str, set[str]] = {}
            for pid in live_pids():
                environ = _proc(pid, "environ")
                if b"PREFECT__FLOW_RUN_ID=" not in environ or _proc(pid, "stat").split(b")")[-1][:3] == b" T ":
                    continue
                run = environ.split(b"PREFECT__FLOW_RUN_ID=")[1].split(b"\0")[0].decode()
                cwd = _cwd(pid)
                host = next((name for home, name in homes.items() if cwd.startswith(home)), None)
                if host is not None:
                    alive.setdefault(run, set()).add(host)
            self.twice |= {run for run, seen in alive.items() if len(seen) > 1}
            for host in self.hosts:
                with contextlib.suppress(Exception):
                    value = client.get(f"{self.api}/variables/name/{host_variable(host.name)}").json()["value"]
                    at = datetime.fromisoformat(value["at"])
                    if not self.beats[host.name] or self.beats[host.name][-1] != at:
                        self.beats[host.name].append(at)
            self.stop.wait(0.5)

    def last_beat(self, host: str, before: datetime) -> datetime | None:
        """The host's last heartbeat at or before a fault."""
        return max((at for at in self.beats[host] if at <= before), default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=60)
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--gpus", type=int, default=4, help="GPUs of each host")
    parser.add_argument("--seconds", type=float, nargs=2, default=(20, 60), help="each job's work, at random")
    parser.add_argument("--host-lost-seconds", type=float, default=60)
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--window", type=float, default=900, help="seconds after the chaos for every run to end")
    parser.add_argument("--database", choices=["postgres", "sqlite"], default="postgres",
                        help="the Prefect server's database (postgres: scripts/postgres.sh)")
    parser.add_argument("--partition-seconds", type=float, default=180, help="how long the cut-off host is stopped")
    parser.add_argument("--pace", type=float, default=1.0, help="the faults' times (but the lost and cut times) "
                        "multiplied by this")
    parser.add_argument("--small", action="store_true", help="a short run for a small machine: 12 jobs of 20-40 s on "
                        "3 hosts of 2 GPUs, E31_HOST_LOST_SECONDS=30, a 60 s cut, faults at half pace")
    args = parser.parse_args()
    if args.small:
        args.jobs, args.gpus, args.seconds, args.host_lost_seconds = 12, 2, (20, 40), 30
        args.partition_seconds, args.pace, args.window = 60, 0.5, 300
    assert args.hosts >= 3, "the faults need three hosts"
    lost_seconds = args.host_lost_seconds
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="e31-chaos-"))
    root.chmod(0o755)  # jobs run as users of their own: their code folder must be readable to them
    print(f"working in {root}", flush=True)

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

    server = Server(root, args.database)
    server.start()
    env = {**os.environ, **s3, "E31_WATCH_SECONDS": "1", "E31_STOP_GRACE_SECONDS": "2",
           "E31_HOST_LOST_SECONDS": str(lost_seconds), "E31_GPU_HEALTH_SECONDS": "2",
           # Four faults here can each cost one run an attempt (lost, GPU, cut off, lost again): the pool allows
           # one more, so that every run can meet its deadline whatever it is hit by.
           "E31_HOST_ATTEMPTS": "5",
           "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_HEARTBEAT_SECONDS": "5"}
    bin_dir = Path(sys.executable).parent
    folder = root / "job"
    folder.mkdir()
    (folder / "flow.py").write_text(FLOW)
    pool = "chaos"
    subprocess.run([bin_dir / "e31", "quota", "set", "--pool", pool, str(args.gpus * args.hosts)], env=env,
                   check=True, capture_output=True)
    hosts = [Host(root / "hosts", f"host-{chr(ord('a') + i)}", args.gpus, pool, env, bin_dir)
             for i in range(args.hosts)]
    (root / "hosts").mkdir()
    a, b, c = hosts[:3]

    print(f"submitting {args.jobs} jobs ...", flush=True)
    (folder / "chaos.yaml").write_text(
        "name: chaos\nwork: {flow: flow.py:chaos, parameters: {seconds: 1, daemon: false, extra_kib: 0}}\n"
        "request: {gpus: 1, max_duration: 10m, deadline: +1h}\noutput: {to: 's3://chaos/{flow_run.id}/'}\n")
    first = subprocess.run([bin_dir / "e31", "submit", str(folder / "chaos.yaml"), "--pool", pool], env=env,
                           capture_output=True, text=True, check=True)
    from prefect import get_client

    runs: dict[str, dict] = {}
    first_id = first.stdout.split("(", 1)[1].split(")", 1)[0]
    with get_client(sync_client=True) as client:
        deployment = client.read_flow_run(first_id).deployment_id
        client.delete_flow_run(first_id)
        for _ in range(args.jobs):  # one deployment, a run per job with its own parameters, as Prefect users do
            parameters = {"seconds": round(rng.uniform(*args.seconds), 1), "daemon": rng.random() < 0.25,
                          "extra_kib": rng.choice([0, 0, 64, 1024])}
            run = client.create_flow_run_from_deployment(deployment, parameters=parameters)
            runs[str(run.id)] = parameters
    deadline = now().timestamp() + 3600  # the runs' deadline: +1h from their scheduled start (about now)
    for host in hosts:
        host.start()
    watch = Watch(hosts, server.url)
    started = time.monotonic()
    faults: list[tuple[str, str, datetime]] = []  # (what, host, when)

    def at(second: float) -> None:
        time.sleep(max(0.0, started + second - time.monotonic()))

    def say(text: str) -> None:
        print(f"{time.monotonic() - started:6.0f} s  {text}", flush=True)

    pace, cut = args.pace, args.partition_seconds
    at(20 * pace)
    say(f"SIGKILL the worker of {c.name}")
    c.worker.kill()
    c.worker.wait()
    at(25 * pace)
    c.start()
    at(35 * pace)
    say(f"SIGTERM the worker of {b.name}")
    asked = time.monotonic()
    b.worker.send_signal(signal.SIGTERM)
    try:
        b.worker.wait(timeout=60)
        say(f"  it exited {time.monotonic() - asked:.1f} s after SIGTERM")
    except subprocess.TimeoutExpired:
        say("  it did not exit within 60 s of SIGTERM")
    at(40 * pace)
    b.start()
    at(50 * pace)
    say("restarting the Prefect server")
    down = time.monotonic()
    server.stop()
    server.start()
    say(f"  it answered again after {time.monotonic() - down:.1f} s")
    lost_at = 80 * pace
    at(lost_at)
    say(f"{a.name} lost: every process of it SIGKILLed (its E31_HOME kept)")
    faults.append(("host lost", a.name, now()))
    a.lose()
    at(95 * pace)
    say(f"GPU 0 of {c.name} fails: its health command says so from now on")
    Path(f"{c.bad}0").write_text("")
    faults.append(("gpu failed", c.name, now()))
    cut_at = 120 * pace
    at(cut_at)
    say(f"{b.name} cut off: its worker and supervisors SIGSTOPped for {cut:.0f} s")
    faults.append(("cut off", b.name, now()))
    stopped = b.partition()
    events = [(lost_at + lost_seconds + 30 * pace, "back"), (lost_at + lost_seconds + 60 * pace, "wiped"),
              (cut_at + cut, "cont")]
    for when, what in sorted(events):
        at(when)
        if what == "back":
            say(f"{a.name} starts again with its E31_HOME")
            a.start()
        elif what == "wiped":
            say(f"{a.name} lost again; it starts again at once, its E31_HOME wiped")
            faults.append(("host lost, wiped", a.name, now()))
            a.lose()
            shutil.rmtree(a.home)
            a.start()
        else:
            say(f"{b.name} answers again (SIGCONT)")
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
    at(cut_at + cut + 10 * pace)
    say(f"S3 unreachable for {30 * pace:.0f} s")
    switch.down()
    time.sleep(30 * pace)
    switch.up()
    say("S3 back")
    chaos_over = time.monotonic()

    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    def closed(run) -> bool:
        return bool(run.state and run.state.is_final() and any(t.startswith("e31:billed-s=") for t in run.tags)
                    and (not run.state.is_completed() or not any(
                        (h.home / "ledger" / str(run.id)).exists() for h in hosts)))

    pending = set(runs)
    with get_client(sync_client=True) as client:
        while pending and time.monotonic() - chaos_over < args.window:
            for run_id in list(pending):
                if closed(client.read_flow_run(run_id)):
                    pending.discard(run_id)
            if pending:
                time.sleep(2)
        say(f"all closed ({len(pending)} not closed)")
        watch.stop.set()
        for host in hosts:
            if host.worker is not None and host.worker.poll() is None:
                host.worker.send_signal(signal.SIGTERM)
        for host in hosts:
            with contextlib.suppress(subprocess.TimeoutExpired):
                if host.worker is not None:
                    host.worker.wait(timeout=30)
        kept = [(h, r) for h in hosts for r in runs if (h.home / "spool" / r).exists()]
        for host, run_id in kept:
            subprocess.run([bin_dir / "e31", "outputs", "retry", run_id], env=host.env, capture_output=True)
        states: dict[str, int] = {}
        late, losses, billed, meters_by_run = [], [], {}, {}
        for run_id in runs:
            run = client.read_flow_run(run_id)
            name = run.state.name if run.state else "None"
            states[name] = states.get(name, 0) + 1
            history = client.read_flow_run_states(run.id)
            done = next((s for s in reversed(history) if s.is_completed()), None)
            if done is None or done.timestamp.timestamp() > deadline:
                late.append(run_id)
            tables = {}
            for artifact in sorted(client.read_artifacts(artifact_filter=ArtifactFilter(
                    flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))), key=lambda a: a.created):
                if artifact.key and artifact.key.startswith("e31-meter"):
                    tables[artifact.key] = json.loads(artifact.data)
            meters_by_run[run_id] = tables
            for attempt, state in enumerate((s for s in history if s.name in ("HostLost", "DeviceFailed")), 1):
                key = "e31-meter-chaos" if attempt == 1 else f"e31-meter-chaos-attempt-{attempt}"
                rows = {row["step"]: row for row in tables.get(key, [])}
                losses.append((run_id, state, rows))
            last = max(tables, key=lambda k: (len(k), k), default=None)
            if last is not None:
                billed[run_id] = (next(row["seconds"] for row in tables[last] if row["step"] == "total billed"),
                                  str(run.labels.get("e31.host", "")))
        slots = client.read_global_concurrency_limit_by_name(f"e31-pool-{pool}").active_slots

    lost_outputs = 0
    spans: dict[tuple[str, str], list[tuple[datetime, datetime]]] = {}
    for run_id in runs:
        try:
            ran = json.loads(bucket.get_object(Bucket="chaos", Key=f"{run_id}/ran.json")["Body"].read())
        except bucket.exceptions.NoSuchKey:
            lost_outputs += 1
            continue
        spans.setdefault((ran["home"], ran["devices"]), []).append(
            (datetime.fromisoformat(ran["started"]), datetime.fromisoformat(ran["ended"])))
    rented_twice = sum(1 for ordered in (sorted(s) for s in spans.values())
                       for (_, end), (start, _) in zip(ordered, ordered[1:], strict=False) if start < end)

    # Each lost attempt: the fault that lost it, its meter's end against the host's last heartbeat (the GPU's
    # failure), and the time from the fault to its requeue.
    off_heartbeat, to_requeue, unmatched = [], [], 0
    for _, state, rows in losses:
        fault = next((f for f in reversed(faults) if f[1] in (state.message or "") and f[2] <= state.timestamp),
                     None)
        if fault is None or "run_ended" not in rows:
            unmatched += 1
            continue
        what, host, when = fault
        heard = when if what == "gpu failed" else watch.last_beat(host, when)
        ended = datetime.fromisoformat(rows["run_ended"]["at"])
        off_heartbeat.append(abs((ended - heard).total_seconds()) if heard else float("inf"))
        to_requeue.append((state.timestamp - when).total_seconds())

    accounted: dict[tuple[str, str], float] = {}
    for host in hosts:
        accounting = host.home / "accounting.jsonl"
        for line in accounting.read_text().splitlines() if accounting.exists() else []:
            entry = json.loads(line)
            if entry.get("rented") and entry.get("ended") and entry.get("ending") != "fenced":
                end = work_end(datetime.fromisoformat(entry["ended"]),
                               datetime.fromisoformat(entry["stop_requested"]) if entry.get("stop_requested")
                               else None, entry.get("grace_seconds", 0.0))
                accounted[(entry["run_id"], host.name)] = (end - datetime.fromisoformat(entry["rented"])
                                                           ).total_seconds()
    off = sorted((abs(seconds - accounted[(run_id, host)]), run_id) for run_id, (seconds, host) in billed.items()
                 if (run_id, host) in accounted)

    time.sleep(2)
    daemons = [pid for pid in live_pids() if b"chaos-daemon" in _proc(pid, "cmdline")]
    left = [pid for host in hosts for pid in host.processes()]
    ledger_left = [p for host in hosts if (host.home / "ledger").exists() for p in (host.home / "ledger").iterdir()]
    moto.stop()
    server.stop()
    for host in hosts:
        unmount_under(host.home)

    print(f"\nfinal states: {dict(sorted(states.items()))}")
    print(f"faults: {', '.join(f'{what} ({host})' for what, host, _ in faults)}; attempts lost: {len(losses)}")
    print(f"runs sent to the spool and retried: {len(kept)}")
    if off:
        print(f"largest difference between Prefect's meter and the supervisor's accounting: {off[-1][0]:.3f} s")
    print(f"\nruns not Completed before their deadline: {len(late)}")
    print(f"runs that ran twice at once:              {len(watch.twice)}")
    print(f"outputs lost:                             {lost_outputs}")
    print(f"lost attempts whose meter did not close within 5 s of their last heartbeat: "
          f"{sum(1 for seconds in off_heartbeat if seconds > 5) + unmatched} of {len(losses)} "
          f"(largest gap {max(off_heartbeat, default=0):.3f} s)")
    if to_requeue:
        print(f"fault to requeue:                         median {statistics.median(to_requeue):.1f} s, "
              f"max {max(to_requeue):.1f} s (E31_HOST_LOST_SECONDS={lost_seconds:.0f})")
    print(f"GPUs rented twice:                        {rented_twice}")
    print(f"concurrency slots leaked:                 {slots}")
    print(f"processes left (daemons/hosts'):          {len(daemons)}/{len(left)}")
    print(f"ledger entries left:                      {len(ledger_left)}")
    print(f"meters off by more than 1 s:              {sum(1 for d, _ in off if d > 1.0)}")
    print("goal: all 0 (but the requeue times)")


if __name__ == "__main__":
    main()
