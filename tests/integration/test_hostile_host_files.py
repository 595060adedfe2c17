"""A process job, as its own uid, goes after what other jobs left on the host: the staged objects in the cache,
other runs' outputs, the spool and the ledger under E31_HOME, and the host's device lock files. It reads
none of them and locks no GPU, even where E31_HOME and the lock folder sit under folders anyone may pass.
A device locked by a process that is no e31 worker's is named in the worker's log.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from e31_prefect.host.ledger import Ledger
from e31_prefect.surface import spool
from tests.integration.conftest import cli, flow_run_id
from tests.integration.test_jobs_end_to_end import mark_job, read_run, write_job
from tests.integration.test_s3_jobs import bucket

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(os.geteuid() != 0, reason="a process job has a uid of its own under a root worker")]

# Each victim file holds this mark; the hostile job builds it at run time, so its own files never hold it.
MARK = "victim-bytes-7f3a"

VICTIM = """
from prefect import flow
from e31_prefect import data_dir, output_dir

@flow
def victim():
    (output_dir() / "result.txt").write_text((data_dir() / "data.bin").read_text() + " result")
"""

HOSTILE = """
import fcntl, json, os, stat, time
from pathlib import Path
from prefect import flow
from e31_prefect import output_dir

def readable_marked(home, mark):
    found = []
    for folder, dirs, files in os.walk(home):
        for name in files:
            path = os.path.join(folder, name)
            try:
                if not stat.S_ISREG(os.lstat(path).st_mode):
                    continue  # its own run's pipe and socket
                with open(path, "rb") as handle:
                    if mark in handle.read(1 << 20):
                        found.append(path)
            except OSError:
                pass
    return found

@flow
def hostile(home: str, lock: str, hold_s: float):
    mark = ("victim-" + "bytes-7f3a").encode()
    tried = {"uid": os.geteuid(), "read": readable_marked(home, mark),
             "listed": {name: sorted(os.listdir(os.path.join(home, name))) if os.access(os.path.join(home, name),
                        os.R_OK) else "closed" for name in ("cache", "outputs", "spool", "ledger")}}
    try:
        fd = os.open(lock, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        tried["lock"] = "locked"
    except OSError as error:
        tried["lock"] = type(error).__name__
    (output_dir() / "tried.json").write_text(json.dumps(tried))
    # Holding the lock, if it got it, until the test has seen what it wanted (it leaves "release" here), or hold_s.
    held_until = time.monotonic() + hold_s
    while time.monotonic() < held_until and not (output_dir() / "release").exists():
        time.sleep(0.2)
    try:
        (output_dir() / "release").unlink()  # not an output of its own
    except OSError:
        pass
"""


@pytest.fixture
def open_root() -> Iterator[Path]:
    """A folder anyone may pass, as /srv is, and every folder above it (pytest's own are 0700, and a job's /tmp
    may be its own): where an operator might put E31_HOME and the device locks."""
    folder = Path(tempfile.mkdtemp(prefix="e31-open-", dir="/srv" if os.path.isdir("/srv") else None))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def hostile_job(folder: Path, home: Path, lock: Path, hold_s: float) -> Path:
    """The hostile job's file: it walks ``home`` for marked files, tries ``lock``, then holds what it got."""
    return write_job(folder, f"""
        name: hostile
        work: {{flow: flow.py:hostile, parameters: {{home: "{home}", lock: "{lock}", hold_s: {hold_s}}}}}
        request: {{gpus: 0, max_duration: 5m}}
        output: {{to: ./out/}}
        """, flow=HOSTILE)


def test_a_process_job_reads_no_other_runs_files(prefect_server, s3_server, tmp_path, pool, open_root):
    home, locks = open_root / "e31", open_root / "device-locks"
    env = {**s3_server, "E31_HOME": str(home), "E31_DEVICE_LOCKS": str(locks)}
    # Another team's run: an object staged from S3 (kept in the cache), outputs in E31_HOME's outputs.
    fs = bucket(s3_server, "victim-team")
    fs.pipe({"victim-team/data.bin": MARK.encode()})
    victim = write_job(tmp_path / "victim", """
        name: victim
        work: {flow: flow.py:victim}
        data:
          - {from: "s3://victim-team/data.bin"}
        request: {gpus: 0, max_duration: 5m}
        """, flow=VICTIM)
    done = cli("e31", "run", str(victim), "--pool", pool, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    victim_id = flow_run_id(done.stdout)
    assert (home / "outputs" / str(victim_id) / "result.txt").read_text() == f"{MARK} result"
    assert any(MARK.encode() in p.read_bytes() for p in (home / "cache" / "objects").iterdir())
    # A run whose store was down (its outputs kept in the spool), and a container run's ledger folder.
    left = tmp_path / "left-output"
    left.mkdir()
    (left / "model.bin").write_text(MARK)
    spool.keep(left, home / "spool", "1b9d6bcd-bbfd-4b2d-9b5d-ab8dfbbd4bed", "s3://down/")
    kept = Ledger(home / "ledger").folder("0e2f7bd0-5c67-4c49-8a6e-3f5d0e0bfa6e")
    kept.own()
    kept.output_log.write_text(f"{MARK} printed by a container job\n")

    hostile = hostile_job(tmp_path / "hostile", home, locks / "gpu-0.lock", hold_s=0)
    result = cli("e31", "run", str(hostile), "--pool", pool, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    tried = json.loads((tmp_path / "hostile" / "out" / "tried.json").read_text())
    assert tried["uid"] >= 61000, "the job runs as a uid of its own"
    assert tried["read"] == [], "a job read another run's files"
    # Its view shows it its own ledger folder, and no other run's.
    assert tried["listed"] == {**dict.fromkeys(("cache", "outputs", "spool"), "closed"),
                               "ledger": [str(flow_run_id(result.stdout))]}


def test_a_process_job_locks_no_gpu_and_delays_no_other_run(prefect_server, tmp_path, pool, open_root):
    home, locks = open_root / "e31", open_root / "device-locks"
    env = {"E31_HOME": str(home), "E31_DEVICE_LOCKS": str(locks)}
    # The lock file exists, as a worker that rented GPU 0 once leaves it.
    assert cli("e31", "run", str(mark_job(tmp_path / "first", "first")), "--pool", pool, gpus="1xH100",
               env=env).returncode == 0
    hostile = hostile_job(tmp_path / "hostile", home, locks / "gpu-0.lock", hold_s=90)
    program = shutil.which("e31", path=str(Path(sys.executable).parent))
    attacker = subprocess.Popen([program, "run", str(hostile), "--pool", pool], env={**os.environ, **env},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (tried_at := list(home.glob("workspaces/*/output/tried.json"))):
            assert attacker.poll() is None, attacker.communicate()[0]
            assert time.monotonic() < deadline, "the hostile job never got to its attempts"
            time.sleep(0.5)
        # Another worker's run wants GPU 0 now: it runs while the hostile job still does.
        second = cli("e31", "run", str(mark_job(tmp_path / "second", "second")), "--pool", pool,
                     gpus="1xH100", env=env)
        assert second.returncode == 0, second.stdout + second.stderr
        assert attacker.poll() is None, "the second run waited for the hostile job to end"
        assert read_run(flow_run_id(second.stdout)).state.is_completed()
        (tried_at[0].parent / "release").write_text("")  # seen: the hostile job may end now, not after 90 s
    finally:
        out = attacker.communicate(timeout=300)[0]
    assert attacker.returncode == 0, out
    tried = json.loads((tmp_path / "hostile" / "out" / "tried.json").read_text())
    # Its view hides the folder (FileNotFoundError); on the host, its modes keep the job's uid out (PermissionError).
    assert tried["lock"] in ("PermissionError", "FileNotFoundError"), "a job opened a device lock file"


def test_a_device_locked_by_a_stranger_is_named_in_the_workers_log(prefect_server, tmp_path, pool, open_root):
    locks = open_root / "device-locks"
    env = {"E31_DEVICE_LOCKS": str(locks)}
    assert cli("e31", "run", str(mark_job(tmp_path / "first", "first")), "--pool", pool, gpus="1xH100",
               env=env).returncode == 0
    # Root's flock(1): what a job of a worker whose jobs run as its own user could do too.
    stranger = subprocess.Popen(["flock", "--close", str(locks / "gpu-0.lock"), "sleep", "600"],
                                start_new_session=True)
    program = shutil.which("e31", path=str(Path(sys.executable).parent))
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 30
        while f" {stranger.pid} " not in Path("/proc/locks").read_text():
            assert time.monotonic() < deadline, "flock never took the lock"
            time.sleep(0.2)
        waiting = subprocess.Popen([program, "run", str(mark_job(tmp_path / "second", "second")), "--pool", pool],
                                   env={**os.environ, **env, "E31_GPUS": "1xH100"}, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        reader = threading.Thread(target=lambda: lines.extend(waiting.stdout), daemon=True)
        reader.start()
        named = f"Device lock {locks / 'gpu-0.lock'} is held by pid {stranger.pid} (uid 0: flock"
        deadline = time.monotonic() + 180
        while not any(named in line for line in lines):
            assert waiting.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.5)
        assert waiting.poll() is None, "the run waits for the device"
        os.killpg(stranger.pid, signal.SIGKILL)
        stranger.wait()
        waiting.wait(timeout=240)
        reader.join(timeout=30)
        out = "".join(lines)
        assert waiting.returncode == 0, out
        assert out.count(named) == 1, "named once, not at every poll"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(stranger.pid, signal.SIGKILL)
        stranger.wait()
