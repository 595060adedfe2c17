"""A real Prefect server for the integration tests, and helpers to run the real CLIs against it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from uuid import UUID, uuid4

import httpx
import pytest

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
    for task in Path("/proc").glob("[0-9]*/task/*"):
        try:
            if marker.encode() in (task / "cmdline").read_bytes() and " Z " not in (task / "stat").read_text():
                found.add(int(task.parent.parent.name))
        except OSError:
            continue
    return sorted(found)
