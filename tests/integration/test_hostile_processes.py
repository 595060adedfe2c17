"""A process job looks for the host's other processes, and leaves its own behind; what it must keep still works.

A process job has a PID namespace of its own, with its own ``/proc``: it lists only its own processes,
never another job's command line (which can hold what its team would not share), the worker or its
supervisors; and when its run ends, the namespace ends with everything in it. Its flow still gets SIGTERM
at its time limit, its subprocesses' exit codes, and the run its own exit code.

These need a worker running as root (a job's own uid and namespaces); a container has its own PID
namespace from Docker, so they run the process runtime.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.conftest import cli, flow_run_id, host_processes_with
from tests.integration.test_jobs_end_to_end import read_run, write_job

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(os.geteuid() != 0, reason="a job's own namespaces need a worker running as root")]

# What every process job's flow here uses to list the processes it sees, as `ps -e` does: /proc's numbered folders.
LISTING = """
import json, os, subprocess, sys, time
from pathlib import Path
from prefect import flow
from e31_prefect import output_dir

def listing():
    seen = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\\0", b" ").decode(errors="replace")
            except OSError:
                continue
            seen[entry] = {"state": stat[0], "ppid": int(stat[1]), "command": command}
    return seen

def wait_for(condition, seconds=120):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    return condition()
"""

LOOK = LISTING + """
@flow
def look(marker: str, go: str, done: str, host_pid: int):
    # Its own marked process, for the job beside it to look for; then what it sees once both are up. The
    # marked process lives on until the job beside it has looked too (each says so with a process of its own).
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker])
    wait_for(lambda: os.path.exists(go), 240)
    seen = {"proc": listing(), "ps": subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True,
                                                    text=True).stdout, "parent": os.getppid()}
    try:
        seen["host_environ"] = Path(f"/proc/{host_pid}/environ").read_text()
    except OSError as error:
        seen["host_environ"] = type(error).__name__
    looked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker + "-looked"])
    wait_for(lambda: os.path.exists(done), 240)
    for process in (child, looked):
        process.kill()
        process.wait()
    (output_dir() / "seen.json").write_text(json.dumps(seen))
"""

# A setsid daemon, double forked, and a process forked and left to exit at once: orphans of the job.
LEAVE = LISTING + """
DAEMON = '''
import os, sys
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", sys.argv[1]])
    os._exit(0)
os.wait()
'''

# A process whose main thread exits while another thread goes on and forks: /proc shows it as a zombie.
HALF_GONE = '''
import ctypes, subprocess, sys, threading, time
def go_on():
    while open("/proc/self/stat").read().rsplit(")", 1)[1].split()[0] != "Z":  # until its main thread is gone
        time.sleep(0.01)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", sys.argv[1] + "-under-a-zombie"])
    time.sleep(600)
threading.Thread(target=go_on).start()
ctypes.CDLL(None).pthread_exit(None)
'''

@flow
def leave(marker: str):
    subprocess.run([sys.executable, "-c", DAEMON, marker], check=True)
    subprocess.run([sys.executable, "-c", DAEMON.replace("time.sleep(600)", "pass"), "short-lived"], check=True)
    # Its daemon is its own, reparented to its namespace's init; the one that exited is reaped, no zombie.
    wait_for(lambda: any(marker in p["command"] for p in listing().values())
             and not any(p["state"] == "Z" for p in listing().values()))
    seen = {"proc": listing()}
    subprocess.Popen([sys.executable, "-c", HALF_GONE, marker], start_new_session=True)
    seen["under_a_zombie"] = wait_for(lambda: any(marker + "-under-a-zombie" in p["command"]
                                                  for p in listing().values()))
    (output_dir() / "seen.json").write_text(json.dumps(seen))
"""

TERMINATED = LISTING + """
import signal

def on_sigterm(name):
    def handle(signum, frame):
        (output_dir() / name).write_text(json.dumps(listing()))
        os._exit(0)
    return handle

CHILD = '''
import json, os, signal, sys, time
def handle(signum, frame):
    time.sleep(0.5)  # saving its work: the flow's process is gone by then, the child's grace is not
    open(sys.argv[1], "w").write("child got SIGTERM")
    os._exit(0)
signal.signal(signal.SIGTERM, handle)
open(sys.argv[1] + ".armed", "w").write("")
time.sleep(600)
'''

@flow
def terminated():
    signal.signal(signal.SIGTERM, on_sigterm("flow-got-sigterm.json"))
    child = str(output_dir() / "child-got-sigterm.txt")
    subprocess.Popen([sys.executable, "-c", CHILD, child])
    wait_for(lambda: os.path.exists(child + ".armed"))
    os.unlink(child + ".armed")
    time.sleep(600)
"""

EXIT_CODES = LISTING + """
import signal

@flow
def exits():
    # Its own child's exit status, as subprocess.run reads it; then the job's process dies of a signal.
    (output_dir() / "child-exit.txt").write_text(str(subprocess.run(["sh", "-c", "exit 7"]).returncode))
    (output_dir() / "processes.json").write_text(json.dumps(listing()))
    os.kill(os.getpid(), signal.SIGKILL)
"""


def the_jobs_own(command: str, marker: str) -> bool:
    """Whether a command line is one of a job's own processes here: its namespace's init, e31's job entry,
    its marked child, the `ps` it ran."""
    return any(part in command for part in ("e31_prefect/host/job_init.py", "-m e31_prefect.job_entry", marker,
                                            "ps -eo"))


def test_a_process_job_lists_only_its_own_processes_never_the_job_beside_it(prefect_server, tmp_path, pool):
    names = ("first", "second")
    markers = {name: f"e31-marker-{name}-{uuid.uuid4().hex[:8]}" for name in names}
    program = shutil.which("e31", path=str(Path(sys.executable).parent))
    runs = {}
    for name in names:
        job = write_job(tmp_path / name, f"""
            name: {name}
            work: {{flow: "flow.py:look", parameters: {{marker: {markers[name]}, go: "{tmp_path / name / 'go'}",
                                                       done: "{tmp_path / name / 'done'}", host_pid: {os.getpid()}}}}}
            request: {{gpus: 0, max_duration: 5m}}
            output: {{to: ./out/, expect: [seen.json]}}
            """, flow=LOOK)
        runs[name] = subprocess.Popen([program, "run", str(job), "--pool", f"{pool}-{name}"], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
    try:
        # Both jobs' marked processes run at once (as the host sees them); then each looks, and both end once
        # both have looked.
        for step, said in (("go", ""), ("done", "-looked")):
            deadline = time.monotonic() + 240
            while not all(host_processes_with(marker + said) for marker in markers.values()):
                assert all(run.poll() is None for run in runs.values()), [r.communicate()[0] for r in runs.values()]
                assert time.monotonic() < deadline, f"the two jobs never got to {step!r} at the same time"
                time.sleep(0.5)
            for name in names:
                (tmp_path / name / step).write_text("")
    finally:
        outputs = {name: run.communicate(timeout=300)[0] for name, run in runs.items()}
    for name, other in zip(names, reversed(names), strict=True):
        assert runs[name].returncode == 0, outputs[name]
        seen = json.loads((tmp_path / name / "out" / "seen.json").read_text())
        commands = [process["command"] for process in seen["proc"].values()]
        assert any(markers[name] in command for command in commands), "the job lists its own processes"
        assert not any(markers[other] in command for command in commands), "it read the other job's command line"
        assert markers[other] not in seen["ps"]
        # Nothing else of the host: no worker, supervisor, Prefect server, shell of the operator's.
        assert all(the_jobs_own(command, markers[name]) for command in commands), commands
        assert all(the_jobs_own(line, markers[name]) for line in seen["ps"].splitlines()), seen["ps"]
        assert seen["proc"]["1"]["command"].split()[-1].endswith("e31_prefect/host/job_init.py")
        assert seen["parent"] == 0, "its parent (its supervisor) is outside its namespace"
        assert seen["host_environ"] == "FileNotFoundError", "a process of the host, by its host pid"


@pytest.mark.parametrize("use_cgroups", ["true", "false"], ids=["cgroup", "subreaper"])
def test_a_jobs_daemons_are_its_own_and_gone_with_its_namespace_when_the_run_ends(prefect_server, tmp_path, pool,
                                                                                 use_cgroups):
    marker = f"e31-daemon-{uuid.uuid4().hex[:8]}"
    job = write_job(tmp_path / "leave", f"""
        name: leave
        work: {{flow: "flow.py:leave", parameters: {{marker: {marker}}}}}
        request: {{gpus: 0, max_duration: 5m}}
        output: {{to: ./out/, expect: [seen.json]}}
        """, flow=LEAVE)
    result = cli("e31", "run", str(job), "--pool", pool, env={"E31_CGROUPS": use_cgroups})
    assert result.returncode == 0, result.stdout + result.stderr
    assert host_processes_with(marker) == [], "the job's daemons outlived its run"
    seen = json.loads((tmp_path / "leave" / "out" / "seen.json").read_text())
    assert seen["under_a_zombie"], "the process under the half-gone one never started"
    daemons = [process for process in seen["proc"].values() if marker in process["command"]]
    assert [daemon["ppid"] for daemon in daemons] == [1], "the daemon's new parent is the job's own init"
    assert [process for process in seen["proc"].values() if process["state"] == "Z"] == [], "an orphan unreaped"


def test_sigterm_at_the_time_limit_still_reaches_the_jobs_flow_and_its_children(prefect_server, tmp_path, pool):
    job = write_job(tmp_path / "terminated", """
        name: terminated
        work: {flow: "flow.py:terminated"}
        request: {gpus: 0, max_duration: 15s}
        output: {to: ./out/}
        """, flow=TERMINATED)
    result = cli("e31", "run", str(job), "--pool", pool, env={"E31_STOP_GRACE_SECONDS": "10"})
    assert result.returncode == 1, result.stdout + result.stderr
    run = read_run(flow_run_id(result.stdout))
    assert run.state.is_failed() and run.state.name == "TimedOut", run.state
    out = tmp_path / "terminated" / "out"
    assert (out / "child-got-sigterm.txt").read_text() == "child got SIGTERM"
    # The flow's own handler ran (Prefect's engine installs one too; the flow's replaced it), in its namespace.
    seen_then = json.loads((out / "flow-got-sigterm.json").read_text())
    assert seen_then["1"]["command"].split()[-1].endswith("e31_prefect/host/job_init.py")


def test_a_jobs_subprocess_gets_its_childs_exit_code_and_the_run_the_jobs_own(prefect_server, tmp_path, pool):
    job = write_job(tmp_path / "exits", """
        name: exits
        work: {flow: "flow.py:exits"}
        request: {gpus: 0, max_duration: 5m}
        output: {to: ./out/}
        """, flow=EXIT_CODES)
    result = cli("e31", "run", str(job), "--pool", pool)
    assert result.returncode == 1, result.stdout + result.stderr
    run = read_run(flow_run_id(result.stdout))
    assert run.state.name == "ProcessDied", run.state
    # Killed by SIGKILL: the job's own status (-9), not an init's translation of it (137).
    assert "died with exit code -9 " in run.state.message, run.state.message
    out = tmp_path / "exits" / "out"
    assert (out / "child-exit.txt").read_text() == "7"
    processes = json.loads((out / "processes.json").read_text())
    assert processes["1"]["command"].split()[-1].endswith("e31_prefect/host/job_init.py")
