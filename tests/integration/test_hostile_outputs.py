"""A job's outputs try what a hostile job would: fill the host's disk, leave a flood of files, nest
folders past PATH_MAX. Each is bounded, ends the run in a named state with the fix, keeps the outputs
within the bound, and leaves no workspace or mount behind, in either runtime."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prefect import get_client

from e31_prefect.data.staging import UploadError, remove_workspace, upload_outputs
from e31_prefect.host import disk
from e31_prefect.host.output_bounds import OutputBounds
from tests.integration.conftest import cli, flow_run_id
from tests.integration.test_jobs_end_to_end import read_run, write_job

pytestmark = pytest.mark.integration

ROOT = os.geteuid() == 0

FILLS_DISK = """
import os
from prefect import flow
from e31_prefect import output_dir

@flow
def fill():
    (output_dir() / "first.txt").write_text("written before the disk filled")
    with open(output_dir() / "sparse.bin", "wb") as sparse:
        sparse.truncate(8 << 30)  # 8 GiB that take no room: sending them would read 8 GiB of zeros
    with open(output_dir() / "big.bin", "wb") as big:
        for _ in range(200):  # 200 MiB, far past its 16m disk
            big.write(os.urandom(1 << 20))
    return "never"
"""

MANY_FILES = """
from prefect import flow
from e31_prefect import output_dir

@flow
def flood():
    for n in range(400):
        (output_dir() / f"{n:04d}.txt").write_text(str(n))
    return "flooded"
"""

DEEP_TREE = """
import os
from prefect import flow
from e31_prefect import output_dir

@flow
def deep():
    (output_dir() / "result.txt").write_text("the expected output")
    folder = os.open(output_dir(), os.O_RDONLY)
    for _ in range(3000):  # 3000 levels of 'ab/': 9000 bytes of path, past PATH_MAX (4096)
        os.mkdir("ab", dir_fd=folder)
        inner = os.open("ab", os.O_RDONLY, dir_fd=folder)
        os.close(folder)
        folder = inner
    bottom = os.open("bottom.txt", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=folder)
    os.write(bottom, b"too deep to send")
    os.close(bottom)
    return "deep"
"""


def image_line(runtime: str, request: pytest.FixtureRequest) -> str:
    return f", image: {request.getfixturevalue('job_image')}" if runtime == "container" else ""


def workspace(run_id: object) -> Path:
    return Path(os.environ["E31_HOME"]) / "workspaces" / str(run_id)


def set_pool_default(pool: str, **defaults: object) -> None:
    """The operator sets the pool's defaults in its base job template (the pool's form in the UI)."""
    from prefect.client.schemas.actions import WorkPoolUpdate

    created = cli("prefect", "work-pool", "create", pool, "--type", "e31", "--overwrite")
    assert created.returncode == 0, created.stdout + created.stderr
    with get_client(sync_client=True) as client:
        template = client.read_work_pool(pool).base_job_template
        for name, value in defaults.items():
            template["variables"]["properties"][name]["default"] = value
        client.update_work_pool(pool, WorkPoolUpdate(base_job_template=template))


@pytest.mark.skipif(not ROOT, reason="a disk of the run's own needs a root worker (loop mount)")
@pytest.mark.parametrize("runtime", ["process", "container"])
def test_a_job_filling_its_disk_ends_disk_limit_keeping_what_it_wrote(runtime, prefect_server, tmp_path, pool,
                                                                      request):
    job = write_job(tmp_path / "job", f"""
        name: fills-disk
        work: {{flow: flow.py:fill{image_line(runtime, request)}}}
        request: {{gpus: 0, max_duration: 10m, disk: 16m}}
        output: {{to: ./out/}}
        """, flow=FILLS_DISK)
    result = cli("e31", "run", str(job), "--pool", pool)
    run_id = flow_run_id(result.stdout)
    state = read_run(run_id).state
    assert state.name == "DiskLimit", (state, result.stdout[-3000:], result.stderr[-3000:])
    assert "request.disk = 16m" in state.message and "Raise request.disk" in state.message
    out = tmp_path / "job" / "out"
    assert (out / "first.txt").read_text() == "written before the disk filled"
    assert 0 < (out / "big.bin").stat().st_size <= 16 * 2**20  # what fitted was sent, nothing past it
    assert not (out / "sparse.bin").exists() and "sparse.bin (past the 16777216 bytes" in state.message
    assert not workspace(run_id).exists()
    assert disk.mounts_under(workspace(run_id).parent) == []


@pytest.mark.parametrize("runtime", ["process", "container"])
def test_a_job_leaving_more_files_than_the_pool_allows_ends_too_many_outputs(runtime, prefect_server, tmp_path,
                                                                            pool, request):
    set_pool_default(pool, max_output_files=50)
    job = write_job(tmp_path / "job", f"""
        name: many-files
        work: {{flow: flow.py:flood{image_line(runtime, request)}}}
        request: {{gpus: 0, max_duration: 10m}}
        output: {{to: ./out/}}
        """, flow=MANY_FILES)
    result = cli("e31", "run", str(job), "--pool", pool)
    run_id = flow_run_id(result.stdout)
    state = read_run(run_id).state
    assert state.name == "TooManyOutputs", (state, result.stdout[-3000:], result.stderr[-3000:])
    assert "max_output_files = 50" in state.message and "raise the pool's max_output_files" in state.message
    sent = [p for p in (tmp_path / "job" / "out").rglob("*") if p.is_file()]
    assert 0 < len(sent) <= 50
    assert all(p.read_text() == str(int(p.stem)) for p in sent if p.suffix == ".txt")
    assert not workspace(run_id).exists()


@pytest.mark.parametrize("runtime", ["process", "container"])
def test_a_job_nesting_folders_past_path_max_sends_the_rest_and_leaves_no_workspace(runtime, prefect_server,
                                                                                   tmp_path, pool, request):
    job = write_job(tmp_path / "job", f"""
        name: deep-tree
        work: {{flow: flow.py:deep{image_line(runtime, request)}}}
        request: {{gpus: 0, max_duration: 10m}}
        output: {{to: ./out/, expect: [result.txt]}}
        """, flow=DEEP_TREE)
    result = cli("e31", "run", str(job), "--pool", pool)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_id = flow_run_id(result.stdout)
    state = read_run(run_id).state
    assert state.is_completed(), state
    assert "folders deep" in state.message and "not sent" in state.message, state.message
    assert (tmp_path / "job" / "out" / "result.txt").read_text() == "the expected output"
    assert not workspace(run_id).exists()


def test_sending_outputs_stops_at_its_time_limit_naming_the_pool_setting(tmp_path):
    output = tmp_path / "output"
    output.mkdir()
    for n in range(20):
        (output / f"{n}.bin").write_bytes(b"x" * 1000)
    with pytest.raises(UploadError, match="output_send_seconds"):
        upload_outputs(output, f"file://{tmp_path / 'dest'}/", time_limit=0.0)
    assert not (tmp_path / "dest").exists() or len(list((tmp_path / "dest").iterdir())) < 20


@pytest.mark.skipif(not ROOT, reason="a disk of the run's own needs a root worker (loop mount)")
def test_removing_a_workspace_unmounts_its_disk_and_frees_its_loop_device(tmp_path):
    workspace_dir = tmp_path / "run"
    (workspace_dir / "output").mkdir(parents=True)
    disk.mount(workspace_dir, workspace_dir / "output", OutputBounds("16m", 16 * 2**20, 100, 60.0))
    assert disk.mounts_under(workspace_dir) == [str(workspace_dir / "output")]
    image = str(workspace_dir / disk.IMAGE_NAME)
    try:
        remove_workspace(workspace_dir, cache=False)
    finally:
        leftover = disk.mounts_under(workspace_dir)
        disk.unmount_under(workspace_dir)  # a failing test leaves no mount behind
    assert leftover == [] and not workspace_dir.exists()
    attached = Path("/sys/block")
    backing = [p.read_text().strip() for p in attached.glob("loop*/loop/backing_file")]
    assert image not in backing and f"{image} (deleted)" not in backing


FILLS_LATER = """
import os, time
from prefect import flow
from e31_prefect import output_dir

@flow
def fill_later():
    (output_dir() / "first.txt").write_text("written before the worker died")
    # Its worker is killed meanwhile (the test leaves "go" here once it is): the disk bounds it still.
    until = time.monotonic() + 120
    while not (output_dir() / "go").exists() and time.monotonic() < until:
        time.sleep(0.2)
    try:
        (output_dir() / "go").unlink()  # not an output of its own
    except OSError:
        pass
    with open(output_dir() / "big.bin", "wb") as big:
        for _ in range(200):
            big.write(os.urandom(1 << 20))
"""


@pytest.mark.skipif(not ROOT, reason="a disk of the run's own needs a root worker (loop mount)")
def test_a_run_whose_worker_died_is_bounded_by_its_disk_and_the_adopter_unmounts_it(prefect_server, tmp_path,
                                                                                    pool):
    from tests.integration.test_worker_faults import Worker, running_under_supervisor, until

    job = write_job(tmp_path / "job", """
        name: fills-later
        work: {flow: flow.py:fill_later}
        request: {gpus: 0, max_duration: 10m, disk: 16m}
        output: {to: ./out/}
        """, flow=FILLS_LATER)
    submitted = cli("e31", "submit", str(job), "--pool", pool)
    assert submitted.returncode == 0, submitted.stderr
    run_id = flow_run_id(submitted.stdout)
    home = tmp_path / "host"
    first = Worker(pool, home)
    until(lambda: running_under_supervisor(home, run_id), 120, "the run starting")
    assert disk.mounts_under(home / "workspaces" / str(run_id)) != []
    first.kill()
    (home / "workspaces" / str(run_id) / "output" / "go").write_text("")  # the job fills its disk now
    second = Worker(pool, home, "1xH100", "--run-once")
    assert second.wait(180) == 0, second.output()
    state = read_run(run_id).state
    assert state.name == "DiskLimit", (state, second.output())
    out = tmp_path / "job" / "out"
    assert (out / "first.txt").read_text() == "written before the worker died"
    assert (out / "big.bin").stat().st_size <= 16 * 2**20
    assert disk.mounts_under(home) == [] and not (home / "workspaces" / str(run_id)).exists()
