"""Process jobs forked from the host's warm interpreter: Prefect loaded once per host, nothing else shared.

A pool's worker (running as root, so jobs run as users of their own) forks each process job's entry from
one interpreter that loaded Prefect. A job forked after another holds none of that job's memory,
environment or files, none of the worker's environment, and cannot ask the interpreter for anything.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path
from uuid import UUID

import pytest

from tests.integration.conftest import cli, cmdline, flow_run_id
from tests.integration.test_jobs_end_to_end import read_run, write_job
from tests.integration.test_worker_faults import until

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(os.geteuid() != 0, reason="a job's own user and namespaces need a worker as root")]

FLOW = """
import json, os, socket, time
from pathlib import Path
from prefect import flow
from prefect.settings import get_current_settings
from e31_prefect import output_dir

def in_memory(prefix):
    # What follows each occurrence of ``prefix`` in every readable mapping of this process (heap, stacks ...).
    found = set()
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", buffering=0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if not perms.startswith("r") or "[vvar]" in line or "[vsyscall]" in line:
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            try:
                mem.seek(start)
                data = mem.read(end - start)
            except (OSError, OverflowError, ValueError):
                continue
            at = data.find(prefix.encode())
            while at >= 0:
                found.add(data[at + len(prefix):at + len(prefix) + 32].decode(errors="replace"))
                at = data.find(prefix.encode(), at + 1)
    return sorted(found)

def attempt(action):
    try:
        action()
        return "done"
    except OSError as error:
        return type(error).__name__

@flow
def first(secret: str) -> str:
    kept = "e31-first-" + secret  # in its memory as the flow runs, and in its environment (FIRST_SECRET)
    (output_dir() / "first.txt").write_text(kept)
    Path("/tmp/first-was-here.txt").write_text(kept)
    (Path.home() / "left.txt").write_text(kept)
    return "first done"

@flow
def second(own: str, warm_socket: str, first_paths: list) -> dict:
    # It is never told the first job's secret or the worker's: it looks for what follows their prefixes.
    mine = "e31-second-" + own
    environ = Path("/proc/self/environ").read_bytes().decode(errors="replace") + json.dumps(dict(os.environ))
    seen = {"memory": {kind: in_memory(f"e31-{kind}-") for kind in ("first", "worker", "second")},
            "environ": environ,
            "files": {path: attempt(lambda path=path: Path(path).read_bytes()) for path in first_paths},
            "first_tmp": attempt(lambda: Path("/tmp/first-was-here.txt").read_bytes()),
            "uid": os.getuid(),
            "prefect": [str(get_current_settings().home), str(get_current_settings().profiles_path)],
            "home": os.environ["PREFECT_HOME"]}
    def ask_the_interpreter():
        folder, name = os.path.split(warm_socket)
        handle = os.open(folder, os.O_PATH)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(f"/proc/self/fd/{handle}/{name}")
            conn.sendall(b'{"env": {}, "cwd": "/", "uid": 0}\\n')
            if conn.recv(4096):
                raise AssertionError("the interpreter answered a job")
    seen["interpreter"] = attempt(ask_the_interpreter)
    (output_dir() / "seen.json").write_text(json.dumps(seen))
    return {"looked": len(mine)}

@flow
def waits(go: str) -> str:
    # Its process forked, it waits to be told to go on (the test kills the interpreter meanwhile).
    (output_dir() / "started.txt").write_text("started")
    while not os.path.exists(go):
        time.sleep(0.1)
    return "went on"
"""


def forked_runs(home: Path) -> dict[str, bool]:
    """Each run on the host, by id: whether its job's process was forked by the warm interpreter."""
    lines = [json.loads(line) for line in (home / "accounting.jsonl").read_text().splitlines() if line.strip()]
    return {line["run_id"]: line.get("warm", False) for line in lines}


def submit(folder: Path, pool: str, text: str) -> UUID:
    job = write_job(folder, text, flow=FLOW)
    submitted = cli("e31", "submit", str(job), "--pool", pool)
    assert submitted.returncode == 0, submitted.stderr
    return flow_run_id(submitted.stdout)


def completed(run_id: UUID) -> bool:
    state = read_run(run_id).state
    assert state is None or state.type.value not in ("FAILED", "CRASHED", "CANCELLED"), state
    return state is not None and state.is_completed()


def test_a_job_forked_after_another_holds_nothing_of_it_nor_of_the_worker_and_cannot_ask_the_interpreter(
        prefect_server, tmp_path, pool, hosts):
    first_secret, second_secret, worker_secret = (uuid.uuid4().hex for _ in range(3))
    host = hosts("warm", E31_TEST_WORKER_SECRET=f"e31-worker-{worker_secret}").start()
    try:
        first = submit(tmp_path / "first", pool, f"""
            name: first
            work: {{flow: "flow.py:first", parameters: {{secret: "{first_secret}"}},
                    env: {{FIRST_SECRET: "e31-first-{first_secret}"}}}}
            request: {{gpus: 1, max_duration: 5m}}
            output: {{to: ./out/}}
            """)
        until(lambda: completed(first), 240, "the first job's run completing")
        first_output = tmp_path / "first" / "out" / "first.txt"
        until(first_output.exists, 60, "the first job's output coming back")
        assert first_output.read_text() == f"e31-first-{first_secret}"
        second = submit(tmp_path / "second", pool, f"""
            name: second
            work: {{flow: "flow.py:second", parameters: {{
                    own: "{second_secret}", warm_socket: "{host.home / 'warm' / f'{host.worker.pid}.sock'}",
                    first_paths: ["{first_output}", "{host.home}/workspaces/{first}/home/left.txt"]}}}}
            request: {{gpus: 1, max_duration: 5m}}
            output: {{to: ./out/}}
            """)
        until(lambda: completed(second), 240, "the second job's run completing")
        until((tmp_path / "second" / "out" / "seen.json").exists, 60, "the second job's output coming back")
    finally:
        host.stop()
    forked = forked_runs(host.home)
    assert forked.get(str(first)) and forked.get(str(second)), f"both jobs forked by the warm interpreter: {forked}"
    seen = json.loads((tmp_path / "second" / "out" / "seen.json").read_text())
    assert second_secret in seen["memory"]["second"], "the scan finds what the job itself holds"
    assert first_secret not in seen["memory"]["first"], "the first job's bytes in the second's memory"
    assert worker_secret not in seen["memory"]["worker"], "the worker's environment in the job's memory"
    assert first_secret not in seen["environ"] and worker_secret not in seen["environ"]
    assert seen["uid"] != 0
    # Prefect's settings are the run's, read from its environment, not those the interpreter loaded Prefect with.
    assert seen["prefect"] == [seen["home"], f"{seen['home']}/profiles.toml"]
    assert all(result != "done" for result in seen["files"].values()), seen["files"]
    assert seen["first_tmp"] == "FileNotFoundError"  # its /tmp is its own
    assert seen["interpreter"] in ("FileNotFoundError", "PermissionError", "ConnectionRefusedError",
                                   "ConnectionResetError", "BrokenPipeError"), seen["interpreter"]


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def interpreters_of(host) -> list[int]:
    """The host's warm interpreter processes (not their launchers: children of the interpreter)."""
    found = [pid for pid in host.processes() if b"e31_prefect.host.warm_interpreter" in cmdline(pid)]
    return [pid for pid in found if parent_of(pid) not in found]


def test_a_killed_warm_interpreter_loses_no_run_it_forked_and_is_started_again(prefect_server, tmp_path, pool,
                                                                               hosts):
    worker_secret = uuid.uuid4().hex
    host = hosts("killed", E31_TEST_WORKER_SECRET=f"e31-worker-{worker_secret}").start()
    go = tmp_path / "running" / "go"  # in its job's folder: the rest of /tmp is not in a job's view
    try:
        running = submit(tmp_path / "running", pool, f"""
            name: running
            work: {{flow: "flow.py:waits", parameters: {{go: "{go}"}}}}
            request: {{gpus: 0, max_duration: 5m}}
            output: {{to: ./out/}}
            """)
        until(lambda: read_run(running).state.is_running(), 240, "the first job running")
        killed = until(lambda: interpreters_of(host), 30, "the warm interpreter running")
        # The run's supervisor was forked by it too, with none of the worker's environment; it outlives it.
        supervisors = host.supervisors()
        assert supervisors and {parent_of(pid) for pid in supervisors} <= set(killed), supervisors
        assert all(worker_secret not in Path(f"/proc/{pid}/environ").read_text(errors="replace")
                   for pid in supervisors)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        go.write_text("")
        until(lambda: completed(running), 120, "the run forked by the killed interpreter completing")
        (tmp_path / "after").mkdir()
        (tmp_path / "after" / "go").write_text("")  # it goes on at once
        after = submit(tmp_path / "after", pool, f"""
            name: after
            work: {{flow: "flow.py:waits", parameters: {{go: "{tmp_path / 'after' / 'go'}"}}}}
            request: {{gpus: 0, max_duration: 5m}}
            output: {{to: ./out/}}
            """)
        until(lambda: completed(after), 240, "a run after the interpreter was killed completing")
        assert not set(interpreters_of(host)) & set(killed)
    finally:
        host.stop()
    forked = forked_runs(host.home)
    assert forked.get(str(running)) and forked.get(str(after)), forked
    assert read_run(running).state.is_completed() and read_run(after).state.is_completed()
