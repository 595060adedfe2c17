"""A job's code tries to run before its devices are handed over; none of it does, and the run still works.

Issue 31 found six ways a job ran its code in the process that waits for its hand-over, before the meter's
``rented`` mark: a logging configuration naming a factory of its own, a forged ``.pyc`` under a cache prefix,
an OpenSSL engine, a warnings filter that imports ``antigravity`` (which starts ``$BROWSER``, a shell that
reads ``$BASH_ENV``), a container image's ``ENTRYPOINT``, and ``PYTHONPATH`` in a container job. Each
hostile job below records, from its own code, each moment it ran (a line of ``time.time()`` in ``first-ran``
in its output dir); the first must come after the rent. A run whose work has not said ready holds no device.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from uuid import UUID, uuid4

import pytest

from e31_prefect.host.inventory import Device, Inventory
from tests.integration.conftest import cli, flow_run_id
from tests.integration.test_jobs_end_to_end import artifacts_of, mark_job, read_run, write_job

pytestmark = pytest.mark.integration

FIRST_RAN = "first-ran"
# Where a job's code records that it ran: its output dir, or (were its code ever to run before the hand-over,
# with none of the job's variables) the output dir beside the home the process starts with.
RECORD_PY = """import os, time
out = os.environ.get("E31_OUTPUT_DIR") or os.path.join(os.environ["HOME"], "..", "output")
with open(os.path.join(out, "first-ran"), "a") as f:
    f.write(repr(time.time()) + "\\n")
"""
RECORD_SH = 'unset BASH_ENV\ndate +%s.%N >> "${E31_OUTPUT_DIR:-$HOME/../output}/first-ran"\n'
RECORD_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
__attribute__((constructor)) static void first_ran(void) {
    const char *out = getenv("E31_OUTPUT_DIR"), *home = getenv("HOME");
    char path[4096];
    struct timespec now;
    FILE *f;
    if (out) snprintf(path, sizeof path, "%s/first-ran", out);
    else snprintf(path, sizeof path, "%s/../output/first-ran", home ? home : ".");
    clock_gettime(CLOCK_REALTIME, &now);
    if ((f = fopen(path, "a"))) { fprintf(f, "%ld.%09ld\n", (long)now.tv_sec, now.tv_nsec); fclose(f); }
}
"""
PLAIN_FLOW = """
from prefect import flow

@flow
def plain() -> int:
    return 42
"""
RESTARTED = "its entry starts again with them"  # what the entry says when a handed variable makes it restart


def rented_at(run_id: UUID) -> float:
    """The meter's ``rented`` mark of the run, as a Unix time."""
    rows = json.loads(artifacts_of(run_id)["meter"].data)
    return datetime.fromisoformat(next(row["at"] for row in rows if row["step"] == "rented")).timestamp()


def first_ran(out: Path) -> float:
    """The first moment the job's own code recorded (it records each of its starts)."""
    assert (out / FIRST_RAN).exists(), "the job's code never ran"
    return min(float(line) for line in (out / FIRST_RAN).read_text().split())


def run_hostile(folder: Path, pool: str, gpus: str = "1xH100") -> tuple[UUID, subprocess.CompletedProcess[str]]:
    """``e31 run`` the job in ``folder``; it completes, and its code first ran after the rent."""
    result = cli("e31", "run", str(folder / "job.yaml"), "--pool", pool, gpus=gpus)
    assert result.returncode == 0 and ": Completed" in result.stdout, result.stdout + result.stderr
    run_id = flow_run_id(result.stdout)
    ran, rented = first_ran(folder / "out"), rented_at(run_id)
    assert ran > rented, f"the job's code ran {rented - ran:.2f} s before its devices were handed over"
    return run_id, result


@pytest.fixture
def compiled(tmp_path: Path):
    """Compile C code into a shared library (gcc); skipped, with the reason, only where gcc is missing and
    not in CI."""

    def compile_so(source: str, path: Path) -> Path:
        if shutil.which("gcc") is None:
            if os.environ.get("CI"):
                pytest.fail("gcc is missing: the tests of a job's native code need it")
            pytest.skip("gcc is missing: a job's native library cannot be built here (apt-get install gcc)")
        path.with_suffix(".c").write_text(source)
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(path), str(path.with_suffix(".c"))], check=True)
        return path

    return compile_so


def plain_job(folder: Path, env: dict[str, str], image: str | None = None) -> Path:
    work = {"flow": "flow.py:plain", "env": env, **({"image": image} if image else {})}
    return write_job(folder, f"""
        name: {folder.name}
        work: {json.dumps(work)}
        request: {{gpus: 1, max_duration: 5m}}
        output: {{to: ./out/}}
        """, flow=PLAIN_FLOW)


# -- the process runtime ----------------------------------------------------------------------------------


def test_a_logging_configuration_naming_a_factory_of_the_jobs_own_runs_it_only_after_the_rent(
        prefect_server, tmp_path, pool):
    import prefect.logging

    folder = tmp_path / "logging-factory"
    folder.mkdir()
    (folder / "record.py").write_text(RECORD_PY)
    # Prefect's own configuration, and a filter whose factory runs a file of the job's as Prefect sets up logging.
    default = (Path(prefect.logging.__file__).parent / "logging.yml").read_text()
    (folder / "logging.yml").write_text(
        default + f"\nfilters:\n  hostile:\n    (): runpy.run_path\n    path_name: {folder / 'record.py'}\n")
    plain_job(folder, {"PREFECT_LOGGING_SETTINGS_PATH": str(folder / "logging.yml")})
    run_hostile(folder, pool)


WHERE_FLOW = """
import os
from pathlib import Path
from prefect import flow

@flow
def where() -> str:
    Path(os.environ["E31_OUTPUT_DIR"], "cwd").write_text(os.getcwd())
    return Path("data.txt").read_text()
"""


def test_settings_files_in_the_jobs_folder_act_only_after_the_rent_and_the_flow_runs_there(
        prefect_server, tmp_path, pool):
    # The flow runs in its folder (where its deployment's pull step moves), yet the process that waits for the
    # hand-over starts elsewhere: Prefect reads settings files (.env, prefect.toml) from where it starts.
    import prefect.logging

    folder = tmp_path / "settings-files"
    folder.mkdir()
    (folder / "record.py").write_text(RECORD_PY)
    (folder / "data.txt").write_text("read from the job's folder")
    default = (Path(prefect.logging.__file__).parent / "logging.yml").read_text()
    (folder / "logging.yml").write_text(
        default + f"\nfilters:\n  hostile:\n    (): runpy.run_path\n    path_name: {folder / 'record.py'}\n")
    (folder / ".env").write_text(f"PREFECT_LOGGING_CONFIG_PATH={folder / 'logging.yml'}\n")
    (folder / "prefect.toml").write_text(f'[logging]\nconfig_path = "{folder / "logging.yml"}"\n')
    write_job(folder, f"""
        name: {folder.name}
        work: {{flow: "flow.py:where"}}
        request: {{gpus: 1, max_duration: 5m}}
        output: {{to: ./out/}}
        """, flow=WHERE_FLOW)
    result = cli("e31", "run", str(folder / "job.yaml"), "--pool", pool, gpus="1xH100")
    assert result.returncode == 0 and ": Completed" in result.stdout, result.stdout + result.stderr
    assert (folder / "out" / "cwd").read_text() == str(folder)
    if (folder / "out" / FIRST_RAN).exists():  # Prefect may read them once the job is the job's
        rented = rented_at(flow_run_id(result.stdout))
        assert first_ran(folder / "out") > rented, "a settings file of the job's acted before the hand-over"


def test_a_forged_pyc_under_the_jobs_pycache_prefix_runs_only_after_the_rent(prefect_server, tmp_path, pool):
    import importlib._bootstrap_external as bootstrap
    import importlib.util
    import json.decoder

    folder = tmp_path / "forged-pyc"
    prefix = folder / "pycache"
    # json.decoder, as every Python program that reads JSON imports it: the job's code first, then the module.
    source = json.decoder.__file__
    sys.pycache_prefix, before = str(prefix), sys.pycache_prefix
    try:
        forged = Path(importlib.util.cache_from_source(source))
    finally:
        sys.pycache_prefix = before
    code = compile(RECORD_PY + f"exec(compile(open({source!r}).read(), {source!r}, 'exec'))\n", source, "exec")
    forged.parent.mkdir(parents=True)
    stat = os.stat(source)
    forged.write_bytes(bootstrap._code_to_timestamp_pyc(code, stat.st_mtime, stat.st_size))
    plain_job(folder, {"PYTHONPYCACHEPREFIX": str(prefix)})
    run_hostile(folder, pool)


def test_an_openssl_engine_of_the_jobs_own_loads_only_after_the_rent(prefect_server, tmp_path, pool, compiled):
    folder = tmp_path / "openssl-engine"
    folder.mkdir()
    engine = compiled(RECORD_C, folder / "engine.so")
    (folder / "openssl.cnf").write_text(
        "openssl_conf = openssl_init\n[openssl_init]\nengines = engine_section\n[engine_section]\n"
        f"hostile = hostile_section\n[hostile_section]\ndynamic_path = {engine}\ninit = 1\n")
    plain_job(folder, {"OPENSSL_CONF": str(folder / "openssl.cnf")})
    run_hostile(folder, pool)


def test_a_warnings_filter_that_starts_the_jobs_browser_runs_it_only_after_the_rent(prefect_server, tmp_path, pool):
    folder = tmp_path / "antigravity"
    folder.mkdir()
    (folder / "record.sh").write_text(RECORD_SH)
    # A command job: Python imports antigravity to read the filter, which opens $BROWSER (bash), which reads
    # $BASH_ENV first.
    write_job(folder, f"""
        name: antigravity
        work:
          command: ["true"]
          env: {{PYTHONWARNINGS: "ignore::antigravity.Warning", BROWSER: bash, BASH_ENV: "{folder / 'record.sh'}"}}
        request: {{gpus: 1, max_duration: 5m}}
        output: {{to: ./out/}}
        """)
    run_hostile(folder, pool)


def test_a_jobs_interpreter_variables_still_act_after_the_hand_over_and_ordinary_ones_cost_no_restart(
        prefect_server, tmp_path, pool, compiled):
    folder = tmp_path / "acting"
    lib = folder / "lib"
    lib.mkdir(parents=True)
    (lib / "helper.py").write_text("def answer():\n    return 42\n")
    preload = compiled(RECORD_C, folder / "preload.so")
    write_job(folder, f"""
        name: acting
        work:
          flow: flow.py:acting
          env: {{PYTHONPATH: "{lib}", LD_PRELOAD: "{preload}", PREFECT_LOGGING_LEVEL: DEBUG, SEED: "7"}}
        request: {{gpus: 1, max_duration: 5m}}
        output: {{to: ./out/, expect: [seen.json]}}
        """, flow="""
        import json, os
        from prefect import flow
        from prefect.settings import get_current_settings
        from e31_prefect import output_dir

        @flow
        def acting():
            import helper
            maps = open("/proc/self/maps").read()
            seen = {"helper": helper.answer(), "preloaded": "preload.so" in maps,
                    "level": get_current_settings().logging.level, "seed": os.environ["SEED"]}
            (output_dir() / "seen.json").write_text(json.dumps(seen))
        """)
    _, result = run_hostile(folder, pool)
    seen = json.loads((folder / "out" / "seen.json").read_text())
    assert seen == {"helper": 42, "preloaded": True, "level": "DEBUG", "seed": "7"}
    assert RESTARTED in result.stdout + result.stderr
    assert "LD_PRELOAD, PREFECT_LOGGING_LEVEL, PYTHONPATH" in result.stdout + result.stderr

    # Ordinary variables, more of them than a pipe holds at once (64 KiB): all given at the hand-over, no restart.
    ordinary = tmp_path / "ordinary"
    bulk = {f"BULK_{index}": str(index % 10) * 4096 for index in range(20)}
    write_job(ordinary, f"""
        name: ordinary
        work: {{flow: flow.py:seeded, env: {json.dumps({"SEED": "7", **bulk})}}}
        request: {{gpus: 1, max_duration: 5m}}
        output: {{to: ./out/, expect: [seed.txt]}}
        """, flow="""
        import os
        from prefect import flow
        from e31_prefect import output_dir

        @flow
        def seeded():
            bulk = sum(len(value) for name, value in os.environ.items() if name.startswith("BULK_"))
            (output_dir() / "seed.txt").write_text(f"{os.environ['SEED']} {bulk}")
        """)
    result = cli("e31", "run", str(ordinary / "job.yaml"), "--pool", pool, gpus="1xH100")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (ordinary / "out" / "seed.txt").read_text() == f"7 {sum(map(len, bulk.values()))}"
    assert RESTARTED not in result.stdout + result.stderr, "a job with only ordinary variables was restarted"


@pytest.mark.parametrize("python", ["3.11 and later", "3.10"])
def test_no_file_in_the_runs_workspace_or_a_user_site_stands_in_for_a_module_before_the_hand_over(
        prefect_server, tmp_path, python, monkeypatch):
    """The waiting entry's working folder is the run's workspace: neither it nor a user's site folder is on
    its ``sys.path``, where a file named like a module Prefect imports would be imported instead."""
    from e31_prefect import job_entry
    from e31_prefect.host.ledger import RunFolder
    from e31_prefect.host.settings import E31Settings
    from e31_prefect.model.job import parse_job
    from e31_prefect.runtimes import Placement
    from e31_prefect.runtimes.process import ProcessRuntime

    workspace = tmp_path / "workspace"
    (workspace / "output").mkdir(parents=True)
    planted = f"open({str(tmp_path / 'planted-ran')!r}, 'a').write(__name__)\n"
    (workspace / "json.py").write_text(planted)  # the standard library's json, which e31's entry imports first
    site = workspace / "home" / ".local" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / \
        "site-packages"
    site.mkdir(parents=True)
    (site / "usercustomize.py").write_text(planted)
    configuration = SimpleNamespace(env={}, run_environment={}, given_environment={}, shards_start=None,
                                    flow_folder=None, entrypoint=None, _code_folder=None, code_mount=lambda: None)
    job = parse_job({"name": "j", "work": {"command": ["true"]}, "request": {"gpus": 0, "max_duration": "1m"}})
    folder = RunFolder(tmp_path / "ledger")
    folder.path.mkdir()
    placement = Placement(str(uuid4()), job, [], workspace, folder, configuration, E31Settings(job_users="worker"))
    if python == "3.10":  # no -P there: the entry's arguments as a Python 3.10 worker gives them, run here
        monkeypatch.setattr(job_entry, "sys", SimpleNamespace(**{**vars(sys), "version_info": (3, 10, 13)}))
    spec = ProcessRuntime(placement.settings, configuration).spec(placement)
    assert ("-c" in spec.argv) == (python == "3.10") and "-s" in spec.argv
    for pipe in (folder.work_ended_pipe, folder.hand_over_pipe):
        os.mkfifo(pipe)
    said = os.open(folder.work_ended_pipe, os.O_RDWR | os.O_NONBLOCK)
    gate = os.open(folder.hand_over_pipe, os.O_RDWR | os.O_NONBLOCK)  # never written: it waits there
    env = {name: value for name, value in spec.env.items() if name != "E31_API_SOCKET"}  # no gateway: the API
    entry = subprocess.Popen(spec.argv, env={**env, "PREFECT_API_URL": prefect_server}, cwd=spec.cwd,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while entry.poll() is None and time.monotonic() < deadline:  # until it is ready for its hand-over
            try:
                if b"ready" in os.read(said, 64):
                    break
            except BlockingIOError:
                time.sleep(0.05)
        else:
            assert entry.poll() is not None, "the entry never said it was ready"
    finally:
        entry.kill()
        entry.wait()
        os.close(said)
        os.close(gate)
    assert not (tmp_path / "planted-ran").exists(), "imported: " + (tmp_path / "planted-ran").read_text()


# -- containers ---------------------------------------------------------------------------------------------


def test_an_images_entrypoint_runs_only_after_the_rent(prefect_server, tmp_path, pool, job_image):
    context = tmp_path / "image"
    context.mkdir()
    (context / "first-ran.sh").write_text(RECORD_SH.replace("unset BASH_ENV\n", "") + 'exec "$@"\n')
    (context / "Dockerfile").write_text(f"FROM {job_image}\nCOPY first-ran.sh /usr/local/bin/first-ran.sh\n"
                                        'ENTRYPOINT ["/bin/sh", "/usr/local/bin/first-ran.sh"]\n')
    tag = f"e31-test-entrypoint:{uuid4().hex[:12]}"
    built = subprocess.run(["docker", "build", "-q", "-t", tag, str(context)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    try:
        folder = tmp_path / "entrypoint"
        plain_job(folder, {}, image=tag)
        run_hostile(folder, pool)
    finally:
        subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True)


def test_pythonpath_in_a_container_jobs_env_acts_only_after_the_rent(prefect_server, tmp_path, pool, job_image):
    folder = tmp_path / "container-path"
    lib = folder / "lib"
    lib.mkdir(parents=True)
    (lib / "sitecustomize.py").write_text(RECORD_PY)
    plain_job(folder, {"PYTHONPATH": str(lib)}, image=job_image)
    run_hostile(folder, pool)


# -- devices ------------------------------------------------------------------------------------------------


def _not_ready_yet(run_id: UUID, deadline: float) -> int:
    """The pid of the run's job process once it started, stopped (SIGSTOP) before it said it is ready."""
    folder = Path(os.environ["E31_HOME"]) / "ledger" / str(run_id)
    while time.monotonic() < deadline:
        try:
            record = json.loads((folder / "record.json").read_text())
        except (OSError, ValueError):
            record = {}
        if record.get("infrastructure"):
            pid = int(record["infrastructure"])
            os.kill(pid, signal.SIGSTOP)
            # It opens its gate only to say it is ready, and keeps it open until it is handed its devices.
            opened = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            record = json.loads((folder / "record.json").read_text())
            assert str(folder / "hand-over") not in opened and record.get("ready") is None, \
                "it said it was ready before it could be stopped"
            return pid
        time.sleep(0.01)
    raise AssertionError("the run's work never started")


def test_a_run_whose_work_has_not_said_ready_holds_no_device_and_delays_no_one(prefect_server, tmp_path, pool):
    loading = mark_job(tmp_path / "loading", "loading")
    submitted = cli("e31", "submit", str(loading), "--now", "--pool", pool)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    run_id = flow_run_id(submitted.stdout)
    program = shutil.which("prefect", path=str(Path(sys.executable).parent))
    log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen([program, "worker", "start", "--pool", pool, "--type", "e31", "--run-once"],
                              env={**os.environ, "E31_GPUS": "1xH100"}, stdout=log, stderr=subprocess.STDOUT)
    pid = None
    try:
        pid = _not_ready_yet(run_id, time.monotonic() + 180)
        # Its work loads (stopped here, as slow as it may be): the host's one GPU is nobody's.
        assert Inventory([Device(0, "H100")], Path(os.environ["E31_DEVICE_LOCKS"])).free() == [Device(0, "H100")]
        # Another team's job, on another pool's worker on this host, rents it and runs at once.
        other = mark_job(tmp_path / "other", "other-team")
        elsewhere = f"{pool}-b"
        done = cli("e31", "submit", str(other), "--now", "--pool", elsewhere)
        assert done.returncode == 0, done.stdout + done.stderr
        ran = cli("prefect", "worker", "start", "--pool", elsewhere, "--type", "e31", "--run-once", gpus="1xH100")
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert read_run(flow_run_id(done.stdout)).state.is_completed()
        assert (tmp_path / "other" / "out" / "ran").exists()
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
    # Ready at last, it rents the GPU, free again, from then.
    worker.wait(timeout=240)
    log.close()
    output = (tmp_path / "worker.log").read_text()
    assert worker.returncode == 0, output
    assert read_run(run_id).state.is_completed(), output
    assert (tmp_path / "loading" / "out" / "ran").exists()
