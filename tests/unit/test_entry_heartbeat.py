"""A job's entry sends a flow run's first heartbeat one interval after its start, not at it: a run shorter than an
interval sends none (and starts no events client for it), a longer one beats at the interval as before."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# Prefect's own heartbeat loop for a flow run, its interval made 1 s, the events it would send recorded.
HEARTBEATS = textwrap.dedent("""
    import json, sys, time
    from uuid import uuid4
    from prefect import flow, flow_engine
    from prefect.client.schemas.objects import FlowRun
    from e31_prefect import job_entry
    if sys.argv[1] == "entry":
        job_entry.first_heartbeat_after_an_interval()
    beats = []
    flow_engine.emit_event = lambda **kw: beats.append((time.monotonic(), kw["event"]))
    flow_engine.MINIMUM_HEARTBEAT_INTERVAL = 1
    flow_engine.FlowRunEngine.heartbeat_seconds = property(lambda self: 1)

    @flow
    def noop():
        pass

    engine = flow_engine.FlowRunEngine(flow=noop, flow_run=FlowRun(id=uuid4(), name="r", flow_id=uuid4()))
    started = time.monotonic()
    with flow_engine._send_heartbeats(engine, join_on_exit=True):
        while len(beats) < 2 and time.monotonic() < started + 60:
            time.sleep(0.02)
    print(json.dumps({"first_after": beats[0][0] - started, "events": [event for _, event in beats]}))
    """)


def heartbeats(kind: str) -> dict:
    done = subprocess.run([sys.executable, "-c", HEARTBEATS, kind], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_first_heartbeat_comes_one_interval_after_the_start_and_the_next_at_the_interval():
    seen = heartbeats("entry")
    assert seen["first_after"] >= 1.0
    assert seen["events"] == ["prefect.flow-run.heartbeat"] * 2


def test_without_the_entry_prefect_beats_at_the_start():
    """What the entry changes: Prefect's engine alone sends its first beat as the flow starts."""
    assert heartbeats("prefect")["first_after"] < 1.0
