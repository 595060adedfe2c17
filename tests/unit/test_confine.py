"""The path rules a job cannot get round: template values, allowed roots, which outputs are the job's own."""

from __future__ import annotations

import itertools
import os
import posixpath
import socket
import stat
from pathlib import Path

import pytest

from e31_prefect.data import confine
from e31_prefect.data.confine import PathRefused, Skipped

# -- template values ------------------------------------------------------------------------------

HOSTILE_NAMES = ["../../x", "..", ".", "", "/etc/cron.d/x", "a/../../b", "\x00", "x\x00/..", "..\\..\\x", "....//",
                 "/", "a/b/c", "~root", ".hidden"]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_template_value_fills_exactly_one_folder_under_the_destination(name):
    url = confine.format_destination("file:///results/{job}/{flow_run.name}/", "id", name, "2026-01-01", "train")
    path = url.removeprefix("file://")
    assert posixpath.dirname(posixpath.normpath(path)) == "/results/train", url
    assert "\x00" not in url


def test_every_short_string_of_path_characters_is_one_harmless_segment():
    # Exhaustive over the characters that make path segments: no value of up to 4 of them escapes.
    for length in range(5):
        for chars in itertools.product("./\\\x00a", repeat=length):
            value = confine.segment("".join(chars))
            assert value and value not in (".", "..")
            assert not {"/", "\\", "\x00"} & set(value) and ".." not in value
            assert posixpath.normpath(f"/dest/{value}") == f"/dest/{value}"


def test_ordinary_values_are_kept_as_they_are():
    for value in ("brave-otter", "retrain-tonight", "2026-12-01", "3f2c1a9e-0000-4000-8000-000000000000", "v1.2_x",
                  "a.b.c", "~tilde", "spaced name"):
        assert confine.segment(value) == value


def test_every_placeholder_is_made_safe():
    url = confine.format_destination("s3://b/{job}/{date}/{flow_run.id}/{flow_run.name}/", "../i", "../n", "../d",
                                     "../j")
    assert url == "s3://b/__j/__d/__i/__n/"


# -- roots ----------------------------------------------------------------------------------------


def test_a_team_gets_the_roots_for_every_team_and_its_own():
    configured = {"*": [Path("/datasets")], "vision": [Path("/results/vision")], "audio": [Path("/results/audio")]}
    assert confine.team_roots(configured, "vision") == [Path("/datasets"), Path("/results/vision")]
    assert confine.team_roots(configured, None) == [Path("/datasets")]
    assert confine.team_roots(configured, "*") == [Path("/datasets")], "a team named * gets no more than any"
    assert confine.team_roots({}, "vision") == []


def test_a_run_may_use_its_teams_roots_its_job_folder_and_what_the_worker_adds():
    configured = {"vision": [Path("/results/vision")]}
    assert confine.run_roots(configured, "vision", Path("/jobs/a"), Path("/e31/outputs/1")) == [
        Path("/results/vision"), Path("/jobs/a"), Path("/e31/outputs/1")]
    assert confine.run_roots(configured, "audio", None, None) == []


@pytest.mark.parametrize(("path", "root", "inside"), [
    ("/jobs/a", "/jobs/a", True),
    ("/jobs/a/out/x", "/jobs/a", True),
    ("/jobs/ab", "/jobs/a", False),  # a sibling sharing a prefix is not inside
    ("/jobs", "/jobs/a", False),
    ("/etc/shadow", "/jobs/a", False),
    ("/anything", "/", True),
])
def test_within_compares_whole_segments(path, root, inside):
    assert confine.within(path, root) is inside


def test_the_first_root_holding_a_path_is_named():
    assert confine.root_holding("/b/x", ["/a", "/b", "/"]) == "/b"
    assert confine.root_holding("/c/x", ["/a", "/b"]) is None
    assert confine.root_holding("/c/x", []) is None


def test_a_path_is_resolved_before_it_is_compared(tmp_path):
    job = tmp_path / "job"
    (job / "data").mkdir(parents=True)
    (job / "data" / "a.csv").write_text("1")
    (job / "out").symlink_to("/etc")
    (job / "shadow").symlink_to("/etc/shadow")
    roots = [job]
    assert confine.confine_file_url(f"file://{job}/data/a.csv", roots, "data") == str(job / "data" / "a.csv")
    assert confine.confine_file_url(f"{job}/data/../data/a.csv", roots, "data") == str(job / "data" / "a.csv")
    for hostile in (f"file://{job}/../../etc/shadow", f"file://{job}/shadow", f"file://{job}/out/cron.d/",
                    "file:///etc/shadow", "file:///proc/self/environ", f"file://{tmp_path}/job-other"):
        with pytest.raises(PathRefused) as refused:
            confine.confine_file_url(hostile, roots, "data", team="vision")
        message = str(refused.value)
        assert message.startswith(f"data {hostile}") and "outside the folders team 'vision' may use" in message
        assert str(job) in message and confine.SETTING in message


def test_a_root_that_is_a_link_is_compared_as_its_real_folder(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    assert confine.confine_file_url(f"{tmp_path}/real/x", [tmp_path / "alias"], "output.to") == str(
        tmp_path / "real" / "x")
    with pytest.raises(PathRefused, match="a job with no team"):
        confine.confine_file_url("/tmp", [], "output.to")


# -- outputs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "links", "why"), [
    (stat.S_IFREG | 0o644, 1, None),
    (stat.S_IFREG | 0o644, 0, None),
    (stat.S_IFDIR | 0o755, 5, None),
    (stat.S_IFREG | 0o644, 2, "a hard link: one of 2 names of one file"),
    (stat.S_IFLNK | 0o777, 1, "a symbolic link"),
    (stat.S_IFIFO | 0o644, 1, "a fifo"),
    (stat.S_IFSOCK | 0o755, 1, "a socket"),
    (stat.S_IFCHR | 0o666, 1, "a device"),
    (stat.S_IFBLK | 0o660, 1, "a device"),
])
def test_only_regular_files_with_one_name_are_sent(mode, links, why):
    assert confine.not_sent_because(mode, links) == why


def test_not_sent_reasons_match_what_lstat_says_of_real_entries(tmp_path):
    (tmp_path / "own").write_text("x")
    (tmp_path / "link").symlink_to("/etc/shadow")
    os.link(tmp_path / "own", tmp_path / "twin")
    os.mkfifo(tmp_path / "fifo")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "sock"))
        whys = {p.name: confine.not_sent_because(p.lstat().st_mode, p.lstat().st_nlink) for p in tmp_path.iterdir()}
    assert whys == {"own": "a hard link: one of 2 names of one file", "twin": "a hard link: one of 2 names of one file",
                    "link": "a symbolic link", "fifo": "a fifo", "sock": "a socket"}
    assert confine.not_sent_because(os.lstat("/dev/null").st_mode, 1) == "a device"


def test_the_summary_names_what_was_skipped_and_counts_the_rest():
    skipped = [Skipped(f"f{n}", "a symbolic link to /etc/shadow") for n in range(12)]
    one = confine.skipped_summary(skipped[:1])
    assert one.startswith("1 entry of the output dir not sent") and "f0 (a symbolic link to /etc/shadow)" in one
    many = confine.skipped_summary(skipped, limit=3)
    assert "12 entries" in many and "f2 (" in many and "f3 (" not in many and many.endswith("and 9 more")
