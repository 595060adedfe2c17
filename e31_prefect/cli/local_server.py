"""The Prefect server the ``e31`` CLI talks to: ``PREFECT_API_URL`` if set, else a local one.

With no ``PREFECT_API_URL`` the CLI uses a server on 127.0.0.1:4200, starting
``prefect server start`` in its own session when none answers, so a second
command reuses it; ``e31 server stop`` ends it. Its log and pid live in E31's home.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prefect.settings import PREFECT_API_URL

from e31_prefect.host.settings import DURABLE_LEASES, E31Settings

LOCAL_HOST = "127.0.0.1"
LOCAL_PORT = 4200
LOCAL_API_URL = f"http://{LOCAL_HOST}:{LOCAL_PORT}/api"
START_TIMEOUT_SECONDS = 180


class ServerNotReady(RuntimeError):
    """A local Prefect server was started but never answered."""


def healthy(api_url: str) -> bool:
    """Whether a Prefect API answers its health check at ``api_url``."""
    try:
        return httpx.get(f"{api_url.rstrip('/')}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def configured_api_url() -> str | None:
    """The API URL from Prefect's settings (environment or profile), if any."""
    return PREFECT_API_URL.value() or None


def _files() -> tuple[Path, Path]:
    home = E31Settings().home.expanduser()
    home.mkdir(parents=True, exist_ok=True)
    return home / "prefect-server.pid", home / "prefect-server.log"


def ensure_local_server(say: Callable[[str], None] = print) -> str:
    """The API URL of a running local server, starting one in the background if needed."""
    if healthy(LOCAL_API_URL):
        return LOCAL_API_URL
    pid_file, log_file = _files()
    say(f"Starting a local Prefect server on http://{LOCAL_HOST}:{LOCAL_PORT} "
        f"(the first start takes a while; log: {log_file}; `e31 server stop` ends it) ...")
    with log_file.open("ab") as log:
        # Its own session and no pipes to us: the server outlives this command.
        process = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", LOCAL_HOST, "--port", str(LOCAL_PORT)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **DURABLE_LEASES},
        )
    pid_file.write_text(str(process.pid))
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if healthy(LOCAL_API_URL):
            say(f"Prefect UI: http://{LOCAL_HOST}:{LOCAL_PORT}")
            return LOCAL_API_URL
        if process.poll() is not None:
            break
        time.sleep(0.5)
    raise ServerNotReady(
        f"the local Prefect server did not answer at {LOCAL_API_URL}; see {log_file}, "
        "or set PREFECT_API_URL to a running server"
    )


def stop_local_server() -> bool:
    """Stop the local server this CLI started; False when none was running."""
    pid_file, _ = _files()
    if not pid_file.exists():
        return False
    pid = int(pid_file.read_text())
    pid_file.unlink()
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True
