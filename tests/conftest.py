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


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one test process per CPU, two at least (much of a test is waiting on a server, an engine
    or a container) and four at most (each process starts its own Prefect server)."""
    return max(2, min(4, os.cpu_count() or 1))
