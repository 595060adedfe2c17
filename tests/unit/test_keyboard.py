"""`e31 run`'s rule for file:// inputs: what the user at the keyboard may read is staged, from its real path."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from e31_prefect.data import keyboard


def test_inputs_beside_the_job_folder_that_the_user_may_read_are_added(tmp_path: Path):
    job = tmp_path / "jobs"
    job.mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "people.csv").write_text("name\nada\n")
    sources = [f"file://{job}/../data/people.csv", f"file://{tmp_path}/data/", "s3://bucket/key",
               f"file://{job}/inside.csv"]
    asked: list[str] = []
    found = keyboard.readable_inputs(sources, [job], lambda path: asked.append(path) or True)
    assert found == [tmp_path / "data" / "people.csv", tmp_path / "data"]  # resolved, once each
    assert asked == [str(tmp_path / "data" / "people.csv"), str(tmp_path / "data")]  # never the S3 one


def test_what_the_user_may_not_read_stays_refused_and_a_link_is_judged_by_its_target(tmp_path: Path):
    job = tmp_path / "jobs"
    job.mkdir()
    (tmp_path / "private").write_text("secret")
    (tmp_path / "looks-harmless.csv").symlink_to(tmp_path / "private")
    asked: list[str] = []

    def may_read(path: str) -> bool:
        asked.append(path)
        return not path.endswith("private")

    assert keyboard.readable_inputs([f"file://{tmp_path}/looks-harmless.csv"], [job], may_read) == []
    assert asked == [str(tmp_path / "private")]


def test_the_kernels_pseudo_files_are_never_added(tmp_path: Path):
    """/proc/self/environ is readable by its own process: it would stage `e31 run`'s credentials for the job."""
    (tmp_path / "environ").symlink_to("/proc/self/environ")
    sources = ["file:///proc/self/environ", f"file://{tmp_path}/environ", "file:///sys/kernel", "file:///dev/null",
               f"file://{tmp_path}/{'../' * 40}proc/self/status"]
    assert keyboard.readable_inputs(sources, [tmp_path / "job"], lambda path: True) == []


def test_the_user_running_the_command_decides(tmp_path: Path):
    readable = tmp_path / "mine.csv"
    readable.write_text("x")
    assert keyboard.user_may_read(str(readable))
    assert keyboard.user_may_read(str(tmp_path))
    assert not keyboard.user_may_read(str(tmp_path / "missing.csv"))
    if os.geteuid() != 0:  # root may read anything: it is the host's operator
        readable.chmod(0)
        assert not keyboard.user_may_read(str(readable))


def test_each_added_input_is_said_in_the_runs_log(tmp_path: Path, caplog):
    (tmp_path / "data.csv").write_text("x")
    job = tmp_path / "job"
    job.mkdir()
    with caplog.at_level(logging.INFO, logger="e31.test"):
        roots = keyboard.widened_roots([f"file://{tmp_path}/data.csv"], [job], logging.getLogger("e31.test"))
    assert roots == [job, tmp_path / "data.csv"]
    assert f"e31 run: staging {tmp_path / 'data.csv'} from outside the job's folder" in caplog.text
    assert "E31_FILE_ROOTS" in caplog.text
