"""A run's supervisor on real processes: it owns every process of the work, bounds it, and records it.

No Prefect here: the supervisor runs any command. Each test is something a job can do to its host
(a setsid daemon, a fork bomb, eating memory, claiming to be done and going on) or that can happen
to its worker (killed mid-run), and checks what the supervisor's record and the host show after.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from uuid import uuid4

import pytest

from e31_prefect.host import cgroups
from e31_prefect.host.device_fence import DeviceFence
from e31_prefect.host.inventory import Device, Inventory
from e31_prefect.host.ledger import Holding, Record, RunFolder, Spec, now, process_running
from e31_prefect.host.supervision import Supervisor, make_hand_over_pipe, make_work_ended_pipe
from e31_prefect.surface.life_terms import meter_from
from tests.integration.conftest import host_processes_with
from tests.integration.test_device_fence import devices_table, free_major, make_nodes
from tests.unit.test_life import GATE  # what e31's job entry does first: say it is ready, wait for its devices

pytestmark = pytest.mark.integration

DAEMON = """
import os, sys, time
pid_file = sys.argv[1]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        open(pid_file, "w").write(str(os.getpid()))
        time.sleep(600)
    os._exit(0)
time.sleep(float(sys.argv[2]))
"""




def start(folder: Path, script: str, *args: str, seconds: float | None = None, lock_files: tuple[int, ...] = (),
          before: str = "", gpu_minors: tuple[int, ...] = (), **spec: object) -> subprocess.Popen:
    """A supervisor for ``script``, started as a worker starts one (its own session, its control socket),
    and handed its devices at once (the time limit counts from there); ``before`` runs while it waits."""
    folder.mkdir(parents=True, exist_ok=True)
    run = RunFolder(folder)
    run.write_spec(Spec(
        run_id=folder.name, runtime="process", stop_at=None,
        argv=[sys.executable, "-c", textwrap.dedent(before) + GATE + textwrap.dedent(script), *args],
        env={"PATH": os.environ["PATH"], "E31_WORK_ENDED": str(run.work_ended_pipe),
             "E31_HAND_OVER": str(run.hand_over_pipe)},
        cwd=str(folder), **{"grace_seconds": 1.0, **spec}))
    make_work_ended_pipe(run)
    make_hand_over_pipe(run)
    ours, theirs = socket.socketpair()
    process = subprocess.Popen([sys.executable, "-m", "e31_prefect.supervisor", str(folder)],
                               start_new_session=True, stdin=theirs)
    theirs.close()
    worker_side = Supervisor(run, None, ours)
    worker_side.hand_over({"CUDA_VISIBLE_DEVICES": "0"}, now() + timedelta(seconds=seconds) if seconds else None,
                          now(), lock_files, gpu_minors)
    return process


def finished(folder: Path, supervisor: subprocess.Popen, timeout: float = 60) -> Record:
    supervisor.wait(timeout=timeout)
    record = RunFolder(folder).record()
    assert record is not None and record.finished, record
    return record


def seconds_between(first: str, last: str) -> float:
    return (datetime.fromisoformat(last) - datetime.fromisoformat(first)).total_seconds()


def wait_for(path: Path, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


@pytest.mark.parametrize("use_cgroups", [True, False], ids=["cgroup", "subreaper"])
def test_a_setsid_daemon_dies_with_the_work_that_started_it(tmp_path, use_cgroups):
    supervisor = start(tmp_path / "run", DAEMON, str(tmp_path / "daemon.pid"), "0.5", cgroups=use_cgroups)
    daemon = int(wait_for(tmp_path / "daemon.pid"))
    record = finished(tmp_path / "run", supervisor)
    assert record.ending == "exited" and record.exit_code == 0
    assert not process_running(daemon), "the double-forked setsid daemon outlived its job"


@pytest.mark.parametrize("use_cgroups", [True, False], ids=["cgroup", "subreaper"])
def test_the_time_limit_stops_the_work_and_every_descendant(tmp_path, use_cgroups):
    supervisor = start(tmp_path / "run", DAEMON, str(tmp_path / "daemon.pid"), "600", seconds=2,
                       cgroups=use_cgroups)
    daemon = int(wait_for(tmp_path / "daemon.pid"))
    record = finished(tmp_path / "run", supervisor)
    assert record.ending == "timed-out" and record.stop_reason == "time-limit"
    assert 0 <= seconds_between(record.stop_requested, record.ended) <= 1.5  # SIGTERM ends it within its grace
    assert not process_running(daemon)


SLOW_TO_SAVE = '''
import os, signal, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", """
import signal, sys, time
def save(*_):
    time.sleep(float(sys.argv[2]))
    open(sys.argv[1], "w").write("saved")
    raise SystemExit(0)
signal.signal(signal.SIGTERM, save)
open(sys.argv[1] + ".armed", "w").write("armed")
time.sleep(600)
""", sys.argv[1], sys.argv[2]])
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
time.sleep(600)
'''


@pytest.mark.parametrize(("saving", "saved"), [(0.5, True), (600, False)], ids=["within-grace", "past-grace"])
def test_a_child_keeps_its_grace_after_the_main_process_ends_on_sigterm(tmp_path, saving, saved):
    """The main process ends at once on its SIGTERM; its child, which got the same SIGTERM, still has the rest
    of the grace to save its work, and is killed at its end."""
    save = tmp_path / "saved.txt"
    supervisor = start(tmp_path / "run", SLOW_TO_SAVE, str(save), str(saving), seconds=2, grace_seconds=3)
    wait_for(tmp_path / "saved.txt.armed")
    record = finished(tmp_path / "run", supervisor)
    assert record.ending == "timed-out" and record.exit_code == 0
    assert save.exists() is saved
    # Billed to its last process's end: after the child saved, or at the grace's end.
    held = seconds_between(record.stop_requested, record.ended)
    assert (0.5 <= held < 3) if saved else (3 <= held < 4.5), held
    assert host_processes_with(str(save)) == []


def test_a_job_that_ignores_sigterm_is_killed_after_its_grace(tmp_path):
    stubborn = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(600)"
    record = finished(tmp_path / "run", start(tmp_path / "run", stubborn, seconds=1, grace_seconds=2))
    assert record.ending == "timed-out" and record.exit_code == -signal.SIGKILL
    assert 1.8 <= seconds_between(record.stop_requested, record.ended) <= 3.5


def test_sigterm_to_the_supervisor_stops_the_work(tmp_path):
    supervisor = start(tmp_path / "run", DAEMON, str(tmp_path / "daemon.pid"), "600")
    daemon = int(wait_for(tmp_path / "daemon.pid"))
    supervisor.send_signal(signal.SIGTERM)
    record = finished(tmp_path / "run", supervisor)
    assert record.ending == "stopped" and record.stop_reason == "stop-requested"
    assert not process_running(daemon)


def test_the_work_outlives_its_worker_and_is_still_bounded(tmp_path):
    """A worker starts the supervisor and is SIGKILLed: the time limit holds, nobody waits for it."""
    folder = tmp_path / "run"
    worker = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_supervisor import start
        from pathlib import Path
        supervisor = start(Path({str(folder)!r}), "import time; time.sleep(600)", seconds=3)
        print(supervisor.pid, flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    supervisor_pid = int(worker.stdout.readline())
    worker.kill()
    worker.wait()
    assert process_running(supervisor_pid), "the supervisor dies with its worker"
    deadline = time.monotonic() + 30
    while process_running(supervisor_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    record = RunFolder(folder).record()
    assert record.ending == "timed-out"
    assert not process_running(int(record.infrastructure))


def test_the_meter_ends_when_the_last_process_is_gone_not_at_the_jobs_word(tmp_path):
    """A job's word that its flow returned is recorded with its outcome; the work ends when its processes do."""
    script = """
        import os, time
        time.sleep(0.5)
        fd = os.open(os.environ["E31_WORK_ENDED"], os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"completed\\n"); os.close(fd)
        time.sleep(3)   # still running, and so still able to use its devices
    """
    record = finished(tmp_path / "run", start(tmp_path / "run", script, report_grace_seconds=30))
    assert record.ending == "exited" and record.outcome == "completed" and not record.unreported
    assert 0.4 <= seconds_between(record.started, record.work_ended) <= 1.5
    assert seconds_between(record.work_ended, record.ended) >= 2.9


def test_a_job_that_says_it_is_done_and_goes_on_is_killed_after_the_report_grace(tmp_path):
    """A forged word at its start: the job is killed at its report grace, and billed to then."""
    script = """
        import os, time
        fd = os.open(os.environ["E31_WORK_ENDED"], os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"completed\\n"); os.close(fd)
        time.sleep(600)
    """
    record = finished(tmp_path / "run", start(tmp_path / "run", script, seconds=3600, report_grace_seconds=2))
    assert record.stop_reason == "report-overdue" and record.exit_code == -signal.SIGKILL
    assert record.ending == "kept-running"
    assert 1.8 <= seconds_between(record.work_ended, record.ended) <= 4


SAY_COMPLETED = """
import os
fd = os.open(os.environ["E31_WORK_ENDED"], os.O_WRONLY | os.O_NONBLOCK)
os.write(fd, b"completed\\n"); os.close(fd)
"""
ALIVE = 'print(repr(time.time()), file=open(sys.argv[1], "a"), flush=True); time.sleep(0.01)'


@pytest.mark.parametrize("left", ["thread", "child", "atexit"])
def test_what_a_job_leaves_running_after_its_word_is_billed_until_it_is_gone(tmp_path, left):
    """The job says its flow returned (as its engine does), but something of it goes on (a non-daemon thread,
    a setsid child that ignores SIGTERM, an atexit handler that ignores SIGTERM): the bill covers every
    moment it was alive, to its kill at the report grace."""
    script = SAY_COMPLETED + {
        "thread": f"""
import sys, threading, time
def work():
    while True:
        {ALIVE}
threading.Thread(target=work).start()
""",
        "child": f"""
import signal, sys, time
if os.fork() == 0:
    os.setsid(); signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        {ALIVE}
time.sleep(0.2)
""",
        "atexit": f"""
import atexit, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
def work():
    while True:
        {ALIVE}
atexit.register(work)
""",
    }[left]
    alive = tmp_path / "alive"
    record = finished(tmp_path / "run", start(tmp_path / "run", script, str(alive), seconds=3600,
                                              report_grace_seconds=2), timeout=60)
    # Each line a moment the job was alive (a line cut short by the kill is no moment).
    moments = [float(line) for line in alive.read_text().splitlines() if line.count(".") == 1]
    last_alive = datetime.fromtimestamp(max(moments), tz=timezone.utc)
    meter = meter_from(Holding(flow_run_id="run", worker_pid=0, worker_started="", job_name="j", devices=[0],
                               workspace="/nowhere", gpus=1, marks={"rented": record.started}), record, 1.0)
    assert last_alive <= meter.marks["run_ended"], (last_alive, meter.marks["run_ended"])
    assert record.outcome == "completed"
    if left != "child":  # its main process never ended: it said its flow returned and went on
        assert record.ending == "kept-running"


@pytest.mark.parametrize("use_cgroups", [True, False], ids=["cgroup", "subreaper"])
def test_a_process_whose_main_thread_left_is_killed_and_billed_until_it_is_gone(tmp_path, use_cgroups):
    """A child whose main thread exited while another thread works on reads as a zombie in /proc, and a
    cgroup's kill misses its live thread: it is still the job's, killed at the end and billed until then."""
    script = SAY_COMPLETED + """
import ctypes, signal, sys, threading, time
if os.fork() == 0:
    os.setsid(); signal.signal(signal.SIGTERM, signal.SIG_IGN)
    def work():
        while True:
            {ALIVE}
    threading.Thread(target=work).start()
    ctypes.CDLL(None).pthread_exit(None)
time.sleep(0.5)
""".replace("{ALIVE}", ALIVE)
    alive = tmp_path / "alive"
    folder = tmp_path / f"half-gone-{uuid4().hex[:8]}"  # a cgroup name no other test shares
    record = finished(folder, start(folder, script, str(alive), seconds=3600, cgroups=use_cgroups), timeout=60)
    moments = [float(line) for line in alive.read_text().splitlines() if line.count(".") == 1]
    assert datetime.fromtimestamp(max(moments), tz=timezone.utc) <= datetime.fromisoformat(record.ended)
    time.sleep(0.5)
    assert float(alive.read_text().splitlines()[-1]) == max(moments), "it wrote on after the run ended"


def test_the_devices_stay_rented_until_the_supervisor_ends(tmp_path):
    locks = tmp_path / "locks"
    worker, other = Inventory([Device(0, "H100")], locks), Inventory([Device(0, "H100")], locks)
    run = uuid4()
    assert worker.hold(run, worker.devices)
    folder = tmp_path / "run"
    supervisor = start(folder, "import time; time.sleep(2)", lock_files=tuple(worker.lock_files(run)))
    worker.give_back(run)  # the worker lets go at once (as a killed one would)
    assert other.free() == [], "GPU 0 could be rented again while its run's work still runs"
    finished(folder, supervisor)
    assert other.free() == other.devices


def _memory_cgroup() -> bool:
    group = cgroups.RunGroup.create(f"probe-memory-{os.getpid()}", 64 * 2**20, None)
    try:
        return group.limits["memory"]
    finally:
        group.remove()


@pytest.mark.skipif(not _memory_cgroup(), reason="this host gives no cgroup memory controller to e31")
def test_a_process_job_is_killed_at_its_memory_limit(tmp_path):
    hog = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 2**20))"
    record = finished(tmp_path / "run", start(tmp_path / "run", hog, memory_bytes=128 * 2**20, seconds=60))
    assert record.ending == "out-of-memory"


def test_a_fork_bomb_is_held_to_the_pids_limit_and_killed(tmp_path):
    bomb = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)"
    marker = f"bomb-{tmp_path.name}"
    supervisor = start(tmp_path / "run", bomb, marker, seconds=3, pids_limit=64)
    time.sleep(1.5)
    assert len(host_processes_with(marker)) <= 64
    record = finished(tmp_path / "run", supervisor, timeout=60)
    assert record.ending == "timed-out" and record.limits["pids"]
    assert host_processes_with(marker) == []


def test_work_that_cannot_start_is_recorded_not_started(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    RunFolder(folder).write_spec(Spec(run_id="run", runtime="process", stop_at=None, argv=["/no/such/program"],
                                      env={}, cwd=str(folder)))
    record = finished(folder, subprocess.Popen([sys.executable, "-m", "e31_prefect.supervisor", str(folder)]))
    assert record.ending == "not-started" and "/no/such/program" in record.message


# What a job that ignores CUDA_VISIBLE_DEVICES does: open every GPU node of the host itself (here, nodes made
# with mknod: no driver serves them, so a node the run may open fails with ENXIO, one it may not with EPERM).
OPENS = """
import errno, json, os, sys
def opens(folder):
    seen = {}
    for name in sorted(os.listdir(folder)):
        try:
            os.close(os.open(os.path.join(folder, name), os.O_RDWR))
            seen[name] = "opened"
        except OSError as error:
            seen[name] = errno.errorcode[error.errno]
    return seen
"""


def _device_rules() -> bool:
    group = cgroups.RunGroup.create(f"probe-devices-{os.getpid()}", None, None)
    try:
        fence = DeviceFence.create(group.v2, group.v1.get("devices"))
        fence.close()
        return fence.enforced
    finally:
        group.remove()


@pytest.mark.skipif(not _device_rules(), reason="this host gives e31 no device rules (cgroup v1 devices, v2 BPF)")
def test_the_work_opens_no_gpu_while_it_waits_and_only_its_rented_ones_after_the_hand_over(tmp_path):
    uvm = free_major()
    make_nodes(tmp_path / "dev", uvm)
    folder = tmp_path / f"run-{uuid4().hex}"  # its cgroup's name: no other run's, whoever runs tests beside it
    supervisor = start(folder, "json.dump({'waiting': waiting, 'running': opens(sys.argv[1])}, "
                       "open(sys.argv[2], 'w'))", str(tmp_path / "dev"), str(tmp_path / "seen.json"),
                       before=OPENS + "waiting = opens(sys.argv[1])\n", gpu_minors=(1, 2),
                       device_table=str(devices_table(tmp_path / "devices", uvm)))
    record = finished(folder, supervisor)
    assert record.ending == "exited" and record.exit_code == 0, record
    assert record.limits["devices"] is True
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert set(seen["waiting"].values()) == {"EPERM"}, f"a GPU node opened before the hand-over: {seen['waiting']}"
    assert seen["running"] == {"elsewhere-nvidia3": "EPERM", "nvidia-uvm": "ENXIO", "nvidia-uvm-tools": "ENXIO",
                               "nvidia0": "EPERM", "nvidia1": "ENXIO", "nvidia2": "ENXIO", "nvidia3": "EPERM",
                               "nvidiactl": "ENXIO"}


def test_a_host_without_device_rules_runs_the_work_and_says_so(tmp_path):
    record = finished(tmp_path / "run", start(tmp_path / "run", "pass", gpu_minors=(0,), cgroups=False))
    assert record.ending == "exited" and record.limits["devices"] is False
    assert any("device isolation is not enforced" in note for note in record.notes), record.notes


def test_a_hand_over_of_a_device_that_is_no_gpu_starts_nothing(tmp_path):
    """nvidiactl's minor (255) handed over as a GPU's: the supervisor opens nothing and ends the run unbilled."""
    record = finished(tmp_path / "run", start(tmp_path / "run", "raise SystemExit(3)", gpu_minors=(0, 255)))
    assert record.ending == "not-started" and record.started is None
    assert "could not be opened" in record.message and "255" in record.message


class PrefectStandIn:
    """Prefect's variables endpoint as a run's supervisor writes its host's heartbeat to it: answering, or not."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.beats: list[dict] = []
        self.answering = True
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                return

            def do_PATCH(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not stand_in.answering:
                    self.connection.close()  # as a cut-off host finds it: no answer
                    return
                stand_in.beats.append(body["value"])
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


LOST = 4.0  # E31_HOST_LOST_SECONDS: a supervisor cut off for three quarters of it (3 s) stops its work


def test_a_supervisor_cut_off_from_the_api_stops_its_work_at_its_fence(tmp_path):
    stand_in = PrefectStandIn()
    try:
        supervisor = start(tmp_path / "run", DAEMON, str(tmp_path / "daemon.pid"), "600", host="host-a",
                           host_lost_seconds=LOST, api_upstream=stand_in.url)
        daemon = int(wait_for(tmp_path / "daemon.pid"))
        while not stand_in.beats:
            time.sleep(0.05)
        assert stand_in.beats[0]["host"] == "host-a" and stand_in.beats[0]["lost_seconds"] == LOST
        stand_in.answering = False  # the host is cut off from the Prefect API from here
        record = finished(tmp_path / "run", supervisor)
    finally:
        stand_in.close()
    assert record.ending == "fenced" and record.stop_reason == "fenced", record
    assert not process_running(daemon), "the fenced work's daemon went on"
    lease = json.loads((tmp_path / "run" / "fence.json").read_text())
    # Stopped at its fence, counted from the last heartbeat the API took: never after the pool's lost time.
    assert 0 <= seconds_between(lease["reached"], record.stop_requested) - LOST * 0.75 <= 1.5
    assert seconds_between(lease["reached"], record.ended) < LOST


def test_a_prefect_api_down_for_less_than_the_margin_stops_nothing(tmp_path):
    stand_in = PrefectStandIn()
    try:
        supervisor = start(tmp_path / "run", "import time; time.sleep(6)", host="host-a", host_lost_seconds=LOST,
                           api_upstream=stand_in.url)
        while not stand_in.beats:
            time.sleep(0.05)
        stand_in.answering = False
        time.sleep(1.5)  # the outage itself: half the fence time
        stand_in.answering = True
        record = finished(tmp_path / "run", supervisor)
    finally:
        stand_in.close()
    assert record.ending == "exited" and record.exit_code == 0, record


def test_a_stopped_supervisors_keeper_stops_its_work(tmp_path):
    """A host whose supervisor no longer runs (stopped, hung) extends its fence no more: its keeper, a process
    of its own, stops the work at the lease's end, so the pool can run it elsewhere."""
    supervisor = start(tmp_path / "run", DAEMON, str(tmp_path / "daemon.pid"), "600", host="host-a",
                       host_lost_seconds=LOST, api_upstream="http://127.0.0.1:9/api")  # nothing answers there
    daemon = int(wait_for(tmp_path / "daemon.pid"))
    os.kill(supervisor.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while process_running(daemon) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not process_running(daemon), "the work outlived its fence while its supervisor was stopped"
        assert (tmp_path / "run" / "fenced.json").exists()
    finally:
        os.kill(supervisor.pid, signal.SIGCONT)
    record = finished(tmp_path / "run", supervisor)
    assert record.ending == "fenced", record
