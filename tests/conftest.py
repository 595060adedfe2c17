"""Test settings for the whole suite, applied before Prefect is imported.

Every test run gets its own PREFECT_HOME and E31_HOME, and the API URL of the
Prefect server that the integration tests start (once per session), so
nothing touches a developer's own Prefect or E31 files.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_HOME = Path(tempfile.mkdtemp(prefix="e31-tests-"))
os.environ["PREFECT_HOME"] = str(_HOME / "prefect")
os.environ["E31_HOME"] = str(_HOME / "e31")
# The tests' workers share this host's device locks, apart from any real e31 worker on it.
os.environ["E31_DEVICE_LOCKS"] = str(_HOME / "device-locks")
os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{_free_port()}/api"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_LOGGING_LEVEL"] = "INFO"
os.environ.pop("E31_GPUS", None)


# The slowest test files, slowest first (per-file sums of `python -m pytest tests/integration -n 2
# --junitxml=...` on the 2-core CI machine). Test files run one per process (--dist loadfile): started first,
# the long ones end together and the many short files fill the gaps after them, instead of one long file
# starting last and running alone. A file missing here only starts later; order never changes what runs.
SLOWEST_FILES = (
    "test_many_workers.py", "test_jobs_end_to_end.py", "test_docker_jobs.py", "test_worker_faults.py",
    "test_outputs_spool.py", "test_learned_times.py", "test_docker_conformance.py", "test_hostile_host_files.py",
    "test_hostile_gateway.py", "test_api_outage.py", "test_shards.py", "test_backlog.py",
    "test_hostile_outputs.py", "test_prefect_deploy.py", "test_hostile_temp.py", "test_hostile_jobs.py",
)


def pytest_collection_modifyitems(items: list) -> None:
    """Put the slowest files first (:data:`SLOWEST_FILES`), then the other integration files, then the unit
    tests; each file's tests keep their order (a stable sort on a key of the file)."""

    def rank(item) -> tuple[int, int]:
        if "integration" not in item.path.parts:
            return (2, 0)
        if item.path.name in SLOWEST_FILES:
            return (0, SLOWEST_FILES.index(item.path.name))
        return (1, 0)

    items.sort(key=rank)


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one test process more than the CPUs, two at least, four at most (each process starts its
    own Prefect server). Much of an integration test is waiting on a server, an engine, a container or a time
    limit: the integration tests' own processes took ~1,100 CPU-seconds (`/usr/bin/time -v python -m pytest
    tests/integration -n 2`), where two processes on CI's 2 CPUs had ~1,900 to give in its 972 s run."""
    return max(2, min(4, (os.cpu_count() or 1) + 1))
