"""The job entry's work before the hand-over, against a real Prefect server: what Prefect's engine does first
with its API (its client opened, the server's version checked, a TLS context built) is done before the rent,
so none of it is billed.

Each case runs in a process of its own, as the entry does: what it prepares is the process's own Prefect.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

# Counts what the engine's first steps build and call, before and after the entry's preparation.
PROBE = textwrap.dedent("""
    import asyncio, contextlib, json, ssl, httpx
    from e31_prefect import job_entry

    built, calls = [], []
    create_default_context = ssl.create_default_context
    ssl.create_default_context = lambda *a, **k: built.append(1) or create_default_context(*a, **k)
    send, send_async = httpx.HTTPTransport.handle_request, httpx.AsyncHTTPTransport.handle_async_request
    httpx.HTTPTransport.handle_request = lambda self, r: calls.append(r.url.path) or send(self, r)
    async def handle_async_request(self, r):
        calls.append(r.url.path)
        return await send_async(self, r)
    httpx.AsyncHTTPTransport.handle_async_request = handle_async_request

    def engine_start():
        '''What Prefect's engine does first with its API after the hand-over.'''
        from prefect import get_client
        from prefect.context import SyncClientContext
        from prefect.events.clients import get_events_client
        with SyncClientContext.get_or_create() as context:
            reused = get_client(sync_client=True) is context.client
            context.client.read_flows(limit=1)
        async def asynchronous():
            async with get_client() as client:
                await client.read_flows(limit=1)
            with contextlib.suppress(Exception):  # the events websocket: its version check is what counts
                async with get_events_client():
                    pass
        asyncio.run(asynchronous())
        return reused

    with contextlib.ExitStack() as stack:
        if PREPARED:
            job_entry.prepare_api(stack)
        built.clear(); calls.clear()
        reused = engine_start()
    print(json.dumps({"tls_contexts": len(built), "version_checks": calls.count("/api/admin/version"),
                      "reused": reused, "calls": calls}))
""")


def engine_start(prepared: bool) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", f"PREPARED = {prepared}\n{PROBE}"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_engine_starts_on_an_api_client_opened_and_checked_before_the_hand_over(prefect_server):
    unprepared = engine_start(prepared=False)
    prepared = engine_start(prepared=True)

    # Without the entry's preparation the engine builds a CA store per client and checks the version after
    # the rent; with it, neither is left for after the hand-over.
    assert unprepared["tls_contexts"] >= 2 and unprepared["version_checks"] >= 1, unprepared
    assert prepared["tls_contexts"] == 0, prepared
    assert prepared["version_checks"] == 0, prepared
    assert prepared["reused"] is True
    assert "/api/flows/filter" in prepared["calls"]  # the clients still reach the API


def test_a_client_given_its_own_tls_context_keeps_it(prefect_server):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import ssl
        from e31_prefect import job_entry
        from prefect.client.orchestration import SyncPrefectClient
        from prefect.settings import PREFECT_API_URL
        job_entry.share_tls_context()
        own = ssl.create_default_context()
        given = []
        import httpx
        original = httpx.Client.__init__
        def record(self, *a, verify=True, **k):
            given.append(verify)
            original(self, *a, verify=verify, **k)
        httpx.Client.__init__ = record
        SyncPrefectClient(PREFECT_API_URL.value(), httpx_settings={"verify": own})
        SyncPrefectClient(PREFECT_API_URL.value())
        SyncPrefectClient(PREFECT_API_URL.value())
        print(given[0] is own, given[1] is given[2], given[1] is not own)
        """)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "True"], done.stdout
