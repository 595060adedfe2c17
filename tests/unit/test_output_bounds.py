"""The bounds on a run's outputs (pure), and the walks that apply them on a real folder: what is counted,
sent, skipped and named, and a tree past PATH_MAX removed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from e31_prefect import disk, endings, fdtree
from e31_prefect.job import JobError, parse_job
from e31_prefect.output_bounds import MAX_OUTPUT_PATH, OutputBounds, Usage, bounds_for, overrun, stops_ending
from e31_prefect.staging import own_files

BOUNDS = OutputBounds("16m", 16 * 2**20, 10, 60.0)


def test_within_the_bounds_the_run_ends_as_its_work_did():
    assert overrun(BOUNDS, Usage(entries=10, disk_full=False)) is None


def test_more_entries_than_the_pool_allows_ends_too_many_outputs_naming_the_setting_and_the_fix():
    ending = overrun(BOUNDS, Usage(entries=11, disk_full=True))
    assert ending is not None and ending.is_(endings.TOO_MANY_OUTPUTS)
    assert "max_output_files = 10" in ending.message and "raise the pool's max_output_files" in ending.message


@pytest.mark.parametrize("usage", [Usage(3, disk_full=True), Usage(3, disk_full=False, inodes_full=True)])
def test_a_full_disk_ends_disk_limit_naming_request_disk(usage):
    ending = overrun(BOUNDS, usage)
    assert ending is not None and ending.is_(endings.DISK_LIMIT)
    assert "request.disk = 16m" in ending.message and "Raise request.disk" in ending.message


def test_a_disk_out_of_room_for_files_says_so_and_how_many_it_holds():
    ending = overrun(BOUNDS, Usage(3, disk_full=False, inodes_full=True))
    assert ending is not None and "room for files and folders" in ending.message and "one per 4 KiB" in ending.message


def test_a_disk_from_the_pool_default_says_so():
    ending = overrun(bounds_for(None, "32m", 5, 60), Usage(1, disk_full=True))
    assert ending is not None and "the pool's default_disk = 32m" in ending.message


def test_a_bound_replaces_the_works_own_end_but_not_a_time_limit_or_a_cancellation():
    assert stops_ending(None) and stops_ending(endings.PROCESS_DIED) and stops_ending(endings.CONTAINER_DIED)
    assert not any(stops_ending(e) for e in (endings.TIMED_OUT, endings.CANCELLED, endings.OUT_OF_MEMORY))


def test_bounds_come_from_the_job_first_then_the_pool():
    assert bounds_for("1g", "32m", None, None) == OutputBounds("1g", 2**30, 100_000, 3600.0, disk_from_pool=False)
    assert bounds_for(None, None, 7, 9).disk == "10g"


@pytest.mark.parametrize(("setting", "value", "named"), [
    ("default_disk", "lots", "default_disk = 'lots'"), ("default_disk", "1k", "below the 8 MiB"),
    ("max_output_files", 0, "max_output_files = 0"), ("max_output_files", "many", "max_output_files = 'many'"),
    ("output_send_seconds", -5, "output_send_seconds = -5"), ("output_send_seconds", True, "= True")])
def test_a_bad_pool_setting_is_named_with_its_value_and_fix(setting, value, named):
    pool = {"default_disk": None, "max_output_files": None, "output_send_seconds": None, setting: value}
    with pytest.raises(ValueError, match="set the pool's") as raised:
        bounds_for(None, **pool)
    assert named in str(raised.value)


@pytest.mark.parametrize("disk_value", ["1k", "lots", "-1g"])
def test_request_disk_is_checked_with_the_job(disk_value):
    with pytest.raises(JobError) as raised:
        parse_job({"name": "x", "work": {"command": ["true"]},
                   "request": {"max_duration": "1m", "disk": disk_value}})
    message = str(raised.value)
    assert "request.disk" in message and repr(disk_value) in message and "512m" in message


def test_a_disk_is_full_once_only_what_ext4_keeps_back_is_left():
    assert disk.full(available_blocks=401, blocks=16093, block_size=1024)  # seen on a full 16 MiB disk
    assert not disk.full(available_blocks=8000, blocks=16093, block_size=1024)


def test_a_small_disk_gets_the_inodes_its_size_holds():
    assert disk.inodes(OutputBounds("16m", 16 * 2**20, 100_000, 1.0)) == 4096
    assert disk.inodes(OutputBounds("10g", 10 * 2**30, 50, 1.0)) == 50 + disk.RESERVED_INODES


def test_the_walk_stops_at_the_bound_on_entries_and_names_the_rest(tmp_path):
    for n in range(30):
        (tmp_path / f"{n:02d}").write_text("x")
    files, skipped = own_files(tmp_path, max_entries=10)
    assert len(files) == 10
    assert [s.path for s in skipped] == ["..."] and "max_output_files" in skipped[0].why


def test_files_past_the_bound_on_bytes_are_not_sent_and_named(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 600)
    with open(tmp_path / "sparse.bin", "wb") as sparse:
        sparse.truncate(1 << 40)  # a terabyte that takes no room
    files, skipped = own_files(tmp_path, max_bytes=1000)
    assert files == [tmp_path / "a.bin"]
    assert [(s.path, "past the 1000 bytes" in s.why) for s in skipped] == [("sparse.bin", True)]


def deep_tree(root: Path, levels: int, name: str = "ab") -> None:
    folder = os.open(root, os.O_RDONLY)
    for _ in range(levels):
        os.mkdir(name, dir_fd=folder)
        inner = os.open(name, os.O_RDONLY, dir_fd=folder)
        os.close(folder)
        folder = inner
    os.close(os.open("bottom.txt", os.O_CREAT | os.O_WRONLY, 0o444, dir_fd=folder))
    os.fchmod(folder, 0o500)  # the job leaves it read-only
    os.close(folder)


def test_a_tree_past_path_max_is_walked_to_the_bound_and_named_once(tmp_path):
    (tmp_path / "result.txt").write_text("kept")
    deep_tree(tmp_path, 3000)
    try:
        files, skipped = own_files(tmp_path)
    finally:
        fdtree.remove_tree(tmp_path / "ab")  # pytest's own cleanup of old tmp dirs recurses: it could not
    assert files == [tmp_path / "result.txt"]
    [deep] = skipped
    assert "folders deep" in deep.why and str(MAX_OUTPUT_PATH) in deep.why and len(deep.path) < 120


def test_a_tree_past_path_max_is_removed_whole(tmp_path):
    root = tmp_path / "workspace"
    root.mkdir()
    deep_tree(root, 3000)
    fdtree.remove_tree(root)
    assert not root.exists()


def test_removing_a_tree_never_follows_a_link_out_of_it(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the run's")
    root = tmp_path / "workspace"
    (root / "output").mkdir(parents=True)
    (root / "output" / "link").symlink_to(outside)
    fdtree.remove_tree(root)
    assert not root.exists() and (outside / "keep.txt").read_text() == "not the run's"


def test_without_a_disk_of_its_own_the_bytes_counted_say_the_disk_is_full(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * 2000)
    bounds = OutputBounds("1k", 1000, 10, 1.0)
    assert disk.measure(tmp_path, bounds) == Usage(1, disk_full=True)
    assert disk.measure(tmp_path, OutputBounds("1m", 2**20, 10, 1.0)) == Usage(1, disk_full=False)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the worker's own loop


FLOOD = ("import os, time\nfor n in range(100000):\n"
         "    open(os.path.join(os.environ['OUT'], str(n)), 'w').close(); time.sleep(0.001)")


@pytest.mark.anyio
async def test_without_a_disk_of_its_own_a_run_writing_past_its_files_is_stopped(tmp_path):
    from tests.unit.test_life import life_for, run_work

    life = life_for(tmp_path)
    life.configuration.max_output_files = 20  # the pool's setting
    # No output disk here (the life's output_disk step is not entered): its watch and supervisor are the bound.
    record = await run_work(life, FLOOD)
    assert record.ending in ("stopped", "output-bound")
    assert len(os.listdir(life.workspace / "output")) < 100000
    ending = await life._bound_passed()  # what after_work ends the run with
    assert ending is not None and ending.is_(endings.TOO_MANY_OUTPUTS)


@pytest.mark.anyio
async def test_without_a_disk_of_its_own_the_supervisor_stops_it_though_no_worker_watches(tmp_path):
    from tests.unit.test_life import CommandRuntime, life_for

    life = life_for(tmp_path)
    life.configuration.max_output_files = 20
    job = life.admit()
    runtime = CommandRuntime(FLOOD)
    life._take()  # the run's ledger folder, as its life takes it first
    (life.workspace / "output").mkdir(parents=True, exist_ok=True)
    async with life.prepare(job, runtime, []) as supervisor, life.rent(job, runtime) as rental:
        await life.hand_over(job, supervisor, rental)
        record = await supervisor.wait()  # nobody watches: as if the worker had died
    assert record.ending == "output-bound"
    assert len(os.listdir(life.workspace / "output")) < 100000
