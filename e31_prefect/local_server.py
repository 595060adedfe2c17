"""The Prefect server the ``e31`` CLI talks to: ``PREFECT_API_URL`` if set, else a local one.

With no ``PREFECT_API_URL`` the CLI uses a server on 127.0.0.1:4200, starting
one in the background (``prefect server start --background``) when none
answers, so a second command reuses it and ``prefect server stop`` ends it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import httpx
from prefect.settings import PREFECT_API_URL

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


def ensure_local_server(say: Callable[[str], None] = print) -> str:
    """The API URL of a running local server, starting one in the background if needed."""
    if healthy(LOCAL_API_URL):
        return LOCAL_API_URL
    say(f"Starting a local Prefect server on http://{LOCAL_HOST}:{LOCAL_PORT} "
        "(first start takes a little while; `prefect server stop` ends it) ...")
    subprocess.run(
        [sys.executable, "-m", "prefect", "server", "start", "--background",
         "--host", LOCAL_HOST, "--port", str(LOCAL_PORT)],
        check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if healthy(LOCAL_API_URL):
            say(f"Prefect UI: http://{LOCAL_HOST}:{LOCAL_PORT}")
            return LOCAL_API_URL
        time.sleep(0.5)
    raise ServerNotReady(
        f"the local Prefect server did not answer at {LOCAL_API_URL} within {START_TIMEOUT_SECONDS} s; "
        "see `prefect server start` output, or set PREFECT_API_URL to a running server"
    )
