"""A real Prefect server for the integration tests, and helpers to run the real CLIs against it."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from uuid import UUID, uuid4

import httpx
import pytest

from e31_prefect.host.disk import unmount_under
from e31_prefect.host.ledger import process_running

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "deployments" / "jobs"


@pytest.fixture(autouse=True)
def project_folder_readable(tmp_path: Path) -> None:
    """A test's folder is its jobs' project folder: readable to others, as a project checked out with the
    usual umask is (pytest makes it 0700), so a job's own user can read its code."""
    tmp_path.chmod(0o755)


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[str]:
    """Start ``prefect server start`` once for the session; yields its API URL."""
    api_url = os.environ["PREFECT_API_URL"]
    port = api_url.rsplit(":", 1)[1].split("/")[0]
    log = Path(os.environ["PREFECT_HOME"]).parent / "server.log"
    # CI (E31_TEST_DATABASE=postgres) runs the server on PostgreSQL, as a pool of many workers has it.
    database = f"e31_tests_{uuid4().hex[:12]}" if os.environ.get("E31_TEST_DATABASE") == "postgres" else ""
    log.parent.mkdir(parents=True, exist_ok=True)
    # Expired quota leases are taken back every 2 s, not every 15 s: a test of a dead worker's slots coming back
    # within a lease waits for the lease, not for the server's next look.
    services = {"PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS": "2"}
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", port],
            env={**os.environ, **database_url(database), **services}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{api_url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            pytest.fail(f"the Prefect server exited: {log.read_text()[-3000:]}")
        time.sleep(0.5)
    else:
        server.kill()
        pytest.fail("the Prefect server did not start within 180 s")
    yield api_url
    os.killpg(server.pid, 15)
    server.wait(timeout=30)
    if database:
        subprocess.run([str(REPO / "scripts" / "postgres.sh"), database, "drop"], capture_output=True)


def database_url(database: str) -> dict[str, str]:
    """The server's setting for a fresh PostgreSQL database of this name (scripts/postgres.sh); none for ""
    (SQLite in its PREFECT_HOME)."""
    if not database:
        return {}
    printed = subprocess.run([str(REPO / "scripts" / "postgres.sh"), database], capture_output=True, text=True)
    if printed.returncode != 0:
        pytest.fail(f"scripts/postgres.sh failed:\n{printed.stderr[-3000:]}")
    name, _, url = printed.stdout.strip().removeprefix("export ").partition("=")
    return {name: url}


@pytest.fixture
def jobs(tmp_path: Path) -> Path:
    """A private copy of the example jobs' folder (in a copy of deployments/: some data sits beside it), so
    outputs land in the test's own tmp dir."""
    shutil.copytree(EXAMPLES.parent, tmp_path / "deployments", ignore=shutil.ignore_patterns("outputs", "__pycache__"))
    return tmp_path / "deployments" / "jobs"


@pytest.fixture
def pool(request: pytest.FixtureRequest) -> str:
    """A work pool name of this test's own, so tests never take each other's runs."""
    return "t-" + request.node.name.replace("_", "-").replace("[", "-").replace("]", "")[:40]


def cli(*args: str, gpus: str | None = None, env: dict[str, str] | None = None,
        timeout: float = 240, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a console command (``e31 ...`` or ``prefect ...``) the way a user would, from ``cwd``."""
    full_env = {**os.environ, **(env or {})}
    if gpus is not None:
        full_env["E31_GPUS"] = gpus
    program = shutil.which(args[0], path=str(Path(sys.executable).parent)) or args[0]
    return subprocess.run([program, *args[1:]], env=full_env, capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)


def flow_run_id(output: str) -> UUID:
    """The flow run id printed by ``e31 submit`` / ``e31 run`` (``... (<uuid>) ...``)."""
    for line in output.splitlines():
        if line.startswith("Submitted flow run"):
            return UUID(line.split("(", 1)[1].split(")", 1)[0])
    raise AssertionError(f"no flow run id in output:\n{output}")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, str]]:
    """moto's S3 server on loopback; yields the environment that points s3fs at it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "e31-test-key",
        "AWS_SECRET_ACCESS_KEY": "e31-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    server.stop()


@pytest.fixture(scope="session")
def job_image() -> str:
    """A local image with Python, Prefect and e31-prefect, on a Docker engine that answers.

    Skipped (with the reason) where no engine answers, unless E31_REQUIRE_DOCKER=1, as in CI,
    where a missing engine fails the tests instead.
    """
    probe = subprocess.run(["docker", "info"], capture_output=True, text=True)
    if probe.returncode != 0:
        reason = f"no Docker engine answers (DOCKER_HOST={os.environ.get('DOCKER_HOST', 'unset')})"
        if os.environ.get("E31_REQUIRE_DOCKER") == "1":
            pytest.fail(reason + "; E31_REQUIRE_DOCKER=1 makes the Docker tests required")
        pytest.skip(reason + "; start one with `eval \"$(scripts/docker-engine.sh)\"`")
    built = subprocess.run([str(REPO / "scripts" / "e31-image.sh")], capture_output=True, text=True)
    if built.returncode != 0:
        pytest.fail(f"building the job image failed:\n{built.stderr[-3000:]}")
    return built.stdout.strip().splitlines()[-1]


def containers_labelled(job_name: str) -> list[str]:
    """Ids of containers (running or not) that e31 labelled with this job's name."""
    listed = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=e31.job={job_name}"],
                            capture_output=True, text=True, check=True)
    return listed.stdout.split()


def host_processes_with(marker: str) -> list[int]:
    """Live processes (any thread's command line) of the host that carry ``marker``, as the host sees them.

    A process job has a PID namespace of its own, so the pids it writes down are not the host's: a test
    finds the job's processes by a marker in their command line instead."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:  # a process may end at any point of the walk (pathlib's glob raises where its folder went)
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                path = Path("/proc", pid, "task", task)
                if marker.encode() in (path / "cmdline").read_bytes() and " Z " not in (path / "stat").read_text():
                    found.add(int(pid))
            except OSError:
                continue
    return sorted(found)


LOST_SECONDS = "6"  # a test host silent this long is lost; its supervisors fence at three quarters of it


class Host:
    """An e31 host on this machine: its own name, home and device locks, and its worker."""

    def __init__(self, root: Path, name: str, pool: str, **env: str):
        self.name, self.pool, self.env = name, pool, env
        self.home = root / name
        self.worker: subprocess.Popen | None = None

    def start(self) -> Host:
        self.home.mkdir(parents=True, exist_ok=True)
        log = (self.home / f"worker-{time.monotonic_ns()}.log").open("wb")
        self.worker = subprocess.Popen(
            [str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", self.pool, "--type", "e31",
             "--name", f"{self.pool}-{self.name}"],
            env={**os.environ, "E31_HOST_NAME": self.name, "E31_HOME": str(self.home),
                 "E31_DEVICE_LOCKS": str(self.home / "locks"), "E31_GPUS": "1xH100", "E31_WATCH_SECONDS": "0.5",
                 "E31_PLAN_ARTIFACT_SECONDS": "1",
                 "E31_STOP_GRACE_SECONDS": "1", "E31_HOST_LOST_SECONDS": LOST_SECONDS,
                 "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_HEARTBEAT_SECONDS": "2", **self.env},
            stdout=log, stderr=subprocess.STDOUT)
        return self

    def processes(self) -> list[int]:
        """The worker and everything below it: supervisors, fence keepers, the jobs' processes."""
        assert self.worker is not None
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                except (OSError, IndexError):
                    continue
                children.setdefault(int(stat[1]), []).append(int(entry))
        found, stack = [self.worker.pid], [self.worker.pid]
        while stack:
            for child in children.get(stack.pop(), []):
                found.append(child)
                stack.append(child)
        return found

    def supervisors(self) -> list[int]:
        return [pid for pid in self.processes() if b"e31_prefect.supervisor" in cmdline(pid)]

    def lose(self) -> None:
        """A power cut: every process of the host SIGKILLed at once."""
        for pid in self.processes():
            os.kill(pid, signal.SIGKILL)
        assert self.worker is not None
        self.worker.wait(timeout=30)

    def stop(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            self.worker.send_signal(signal.SIGTERM)
            self.worker.wait(timeout=60)

    def output(self) -> str:
        return "\n".join(log.read_text(errors="replace")[-3000:] for log in sorted(self.home.glob("worker-*.log")))


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.fixture
def hosts(tmp_path, pool):
    made: list[Host] = []

    def make(name: str, **env: str) -> Host:
        # A host's name is the pool's own (its drains and heartbeat are kept by name, server-wide).
        made.append(Host(tmp_path / "hosts", f"{name}-{hashlib.sha256(pool.encode()).hexdigest()[:6]}", pool, **env))
        return made[-1]

    yield make
    for host in made:
        for pid in host.processes() if host.worker is not None and host.worker.poll() is None else []:
            if process_running(pid):
                os.kill(pid, signal.SIGCONT)
        host.stop()
        unmount_under(host.home)  # a lost host's output disks: its own business, once it starts again
