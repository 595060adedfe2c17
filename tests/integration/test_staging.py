"""Staging against moto's S3 server over HTTP through s3fs: the host's content cache, one download
for two jobs wanting one object, and plain-words errors for bad input."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import boto3
import httpx
import pytest
import s3fs

from e31_prefect.data.cache import ContentCache
from e31_prefect.data.staging import StagingError, stage_inputs
from e31_prefect.model.job import DataInput

pytestmark = pytest.mark.integration


def options(env: dict[str, str], key: str | None = None, secret: str | None = None) -> dict:
    return {"s3": {"key": key or env["AWS_ACCESS_KEY_ID"], "secret": secret or env["AWS_SECRET_ACCESS_KEY"],
                   "client_kwargs": {"endpoint_url": env["AWS_ENDPOINT_URL"]}, "skip_instance_cache": True}}


def filled_bucket(env: dict[str, str], name: str, objects: dict[str, bytes]) -> s3fs.S3FileSystem:
    fs = s3fs.S3FileSystem(key="k", secret="s", client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL"]},
                           skip_instance_cache=True)
    fs.makedirs(name, exist_ok=True)
    fs.pipe({f"{name}/{k}": v for k, v in objects.items()})
    return fs


def test_a_cached_restage_downloads_nothing_and_says_so(s3_server, tmp_path, caplog):
    objects = {f"set/{n:03d}.bin": bytes([n]) * (1000 + n) for n in range(40)}
    filled_bucket(s3_server, "nightly", objects)
    cache = ContentCache(tmp_path / "cache", 1 << 30)
    source = [DataInput(source="s3://nightly/set/", to="set")]
    log = logging.getLogger("e31.test.staging")
    first = stage_inputs(source, tmp_path / "run1", options(s3_server), log, cache=cache)
    assert (first.files, first.cached_files, first.downloaded_bytes) == (40, 0, first.bytes)
    with caplog.at_level(logging.INFO, logger="e31.test.staging"):
        again = stage_inputs(source, tmp_path / "run2", options(s3_server), log, cache=cache)
    assert (again.files, again.cached_files, again.downloaded_bytes) == (40, 40, 0)
    assert "40 from the host's cache, 0.00 MB downloaded" in caplog.text
    staged = {p.relative_to(tmp_path / "run2" / "set").as_posix(): p.read_bytes()
              for p in (tmp_path / "run2").rglob("*") if p.is_file()}
    assert staged == {k.removeprefix("set/"): v for k, v in objects.items()}
    assert cache.counters.downloads == 40 and cache.counters.hits == 40


def test_a_prefix_of_several_pages_and_folder_placeholders_is_staged_whole_and_cached_whole(s3_server, tmp_path):
    """S3 lists at most 1,000 keys a page; the cache links a page's files as the next is listed. A folder's
    placeholder key (``sub/``, as consoles make) is no file: its folder's files are staged under it."""
    objects = {f"big/{n // 100:02d}/{n:04d}.bin": n.to_bytes(2, "big") for n in range(1050)}
    fs = filled_bucket(s3_server, "pages", objects)
    fs.pipe({"pages/big/sub/": b"", "pages/big/sub/inside.txt": b"inside"})
    objects["big/sub/inside.txt"] = b"inside"
    cache = ContentCache(tmp_path / "cache", 1 << 30)
    source = [DataInput(source="s3://pages/big/", to="d")]
    for run, cached in (("run1", 0), ("run2", len(objects))):
        staged = stage_inputs(source, tmp_path / run, options(s3_server), cache=cache)
        assert (staged.files, staged.cached_files) == (len(objects), cached)
        found = {p.relative_to(tmp_path / run / "d").as_posix(): p.read_bytes()
                 for p in (tmp_path / run).rglob("*") if p.is_file()}
        assert found == {k.removeprefix("big/"): v for k, v in objects.items()}


def test_a_key_whose_dots_climb_out_of_the_prefix_fails_naming_it_and_nothing_lands_outside(s3_server, tmp_path):
    """An S3 key may hold '..' segments: staged as a path, ``set/../../../x`` would be written (by the worker, as
    root) outside the run's data dir."""
    s3 = boto3.client("s3", endpoint_url=s3_server["AWS_ENDPOINT_URL"], region_name="us-east-1",
                      aws_access_key_id="k", aws_secret_access_key="s")
    s3.create_bucket(Bucket="climbing")
    s3.put_object(Bucket="climbing", Key="set/ok.txt", Body=b"ok")
    s3.put_object(Bucket="climbing", Key="set/../../../escaped.txt", Body=b"out")
    run = tmp_path / "a" / "b" / "run"
    with pytest.raises(StagingError) as failed:
        stage_inputs([DataInput(source="s3://climbing/set/", to="d")], run / "data", options(s3_server),
                     cache=ContentCache(tmp_path / "cache", 1 << 30))
    assert "'set/../../../escaped.txt'" in str(failed.value) and "outside d" in str(failed.value)
    assert [p.name for p in tmp_path.rglob("escaped.txt")] == []


def test_a_changed_object_is_downloaded_again(s3_server, tmp_path):
    fs = filled_bucket(s3_server, "changing", {"model.bin": b"version one"})
    cache = ContentCache(tmp_path / "cache", 1 << 30)
    source = [DataInput(source="s3://changing/model.bin")]
    stage_inputs(source, tmp_path / "run1", options(s3_server), cache=cache)
    fs.pipe("changing/model.bin", b"version two")
    again = stage_inputs(source, tmp_path / "run2", options(s3_server), cache=cache)
    assert again.cached_files == 0 and (tmp_path / "run2" / "model.bin").read_bytes() == b"version two"


STAGE = """
import json, sys
from pathlib import Path
from e31_prefect.data.cache import ContentCache
from e31_prefect.model.job import DataInput
from e31_prefect.data.staging import stage_inputs
options, root, target = json.loads(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
sys.stdin.readline()  # both processes start staging together
result = stage_inputs([DataInput(source="s3://shared/weights.bin")], target, options,
                      cache=ContentCache(root, 1 << 30))
print(json.dumps({"cached": result.cached_files, "downloaded": result.downloaded_bytes}))
"""


def test_two_jobs_staging_one_object_at_once_download_it_once(s3_server, tmp_path):
    weights = bytes(range(256)) * 40_000  # 10 MB
    filled_bucket(s3_server, "shared", {"weights.bin": weights})
    workers = [subprocess.Popen([sys.executable, "-c", STAGE, json.dumps(options(s3_server)),
                                 str(tmp_path / "cache"), str(tmp_path / f"job{n}")],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for n in range(2)]
    for worker in workers:
        worker.stdin.write("go\n")
        worker.stdin.flush()
    results = [json.loads(worker.communicate(timeout=120)[0]) for worker in workers]
    assert sorted(r["cached"] for r in results) == [0, 1]
    assert sum(r["downloaded"] for r in results) == len(weights)
    for n in range(2):
        assert (tmp_path / f"job{n}" / "weights.bin").read_bytes() == weights


@pytest.fixture
def guarded_store(s3_server):
    """moto checking credentials: an admin key, a key allowed only bucket `open-data`, and two buckets."""
    url = s3_server["AWS_ENDPOINT_URL"]
    iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1", aws_access_key_id="x",
                       aws_secret_access_key="x")
    keys = {}
    for user, resource in (("stage-admin", "*"), ("stage-reader", "arn:aws:s3:::open-data*")):
        iam.create_user(UserName=user)
        iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": resource}]}))
        created = iam.create_access_key(UserName=user)["AccessKey"]
        keys[user] = (created["AccessKeyId"], created["SecretAccessKey"])
    filled_bucket(s3_server, "open-data", {"a.csv": b"1,2\n"})
    filled_bucket(s3_server, "closed-data", {"b.csv": b"3,4\n"})
    auth = f"{url}/moto-api/reset-auth"
    before = httpx.post(auth, content=b"0").json()["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"]
    yield keys
    httpx.post(auth, content=str(before).encode())
    for user, (key_id, _) in keys.items():
        iam.delete_access_key(UserName=user, AccessKeyId=key_id)
        iam.delete_user_policy(UserName=user, PolicyName="s3")
        iam.delete_user(UserName=user)


@pytest.mark.parametrize(("url", "user", "cause"), [
    ("s3://no-such-bucket/x.csv", "stage-admin", "the bucket 'no-such-bucket' does not exist; check the bucket"),
    ("s3://open-data/missing.csv", "stage-admin", "not found: no object or prefix has this key; check the URL"),
    ("s3://open-data/a.csv", None, "the store refused the credentials (InvalidAccessKeyId"),
    ("s3://closed-data/b.csv", "stage-reader", "access denied (AccessDenied): these credentials may not read it"),
    ("s3://closed-data/", "stage-reader", "access denied (AccessDenied)"),
])
def test_bad_input_fails_naming_the_url_and_the_cause(s3_server, guarded_store, tmp_path, url, user, cause):
    key, secret = guarded_store[user] if user else ("AKIAWRONGKEY0000", "wrong")
    with pytest.raises(StagingError) as failure:
        stage_inputs([DataInput(source=url)], tmp_path / "data", options(s3_server, key, secret),
                     cache=ContentCache(tmp_path / "cache", 1 << 30))
    message = str(failure.value)
    assert message.startswith(f"data {url}: ") and cause in message, message
    assert "Traceback" not in message and not any(Path(tmp_path / "data").rglob("*.csv"))


# -- cache integrity ------------------------------------------------------------------------------


def test_a_staged_input_a_job_rewrote_is_not_what_the_next_job_stages(s3_server, tmp_path, caplog):
    filled_bucket(s3_server, "models", {"weights.bin": b"the real weights"})
    cache = ContentCache(tmp_path / "cache", 1 << 30)
    source = [DataInput(source="s3://models/weights.bin")]
    stage_inputs(source, tmp_path / "job1", options(s3_server), cache=cache)
    staged = tmp_path / "job1" / "weights.bin"
    assert staged.stat().st_nlink == 2, "staged as a hard link to the cache entry"
    # The job of team A, running as the worker's user: chmod u+w its read-only input, then write through it.
    staged.chmod(staged.stat().st_mode | 0o200)
    staged.write_bytes(b"poisoned weights")
    log = logging.getLogger("e31.test.poison")
    with caplog.at_level(logging.WARNING):
        again = stage_inputs(source, tmp_path / "job2", options(s3_server), log, cache=cache)
    assert (tmp_path / "job2" / "weights.bin").read_bytes() == b"the real weights"
    assert again.cached_files == 0 and again.downloaded_bytes == len(b"the real weights")
    assert "changed since it was verified" in caplog.text
    assert "fetched again: s3://models/weights.bin" in caplog.text


def test_a_restage_after_the_last_run_was_cleaned_up_downloads_nothing(s3_server, tmp_path):
    from e31_prefect.data.staging import remove_workspace

    filled_bucket(s3_server, "nightly-clean", {f"f{n}.bin": bytes([n]) * 100 for n in range(5)})
    cache = ContentCache(tmp_path / "cache", 1 << 30)
    source = [DataInput(source="s3://nightly-clean/", to="set")]
    for night in range(3):
        workspace = tmp_path / f"run{night}"
        result = stage_inputs(source, workspace / "data", options(s3_server), cache=cache)
        assert result.cached_files == (5 if night else 0)
        remove_workspace(workspace, cache)
    assert cache.counters.changed == [] and cache.counters.downloads == 5


# -- file:// inputs only from what the job may read --------------------------------------------


@pytest.fixture
def job_folder(tmp_path: Path) -> Path:
    """A job's folder with a data folder in it, and a host file beside it the job must not read."""
    folder = tmp_path / "team-a" / "job"
    (folder / "data" / "sub").mkdir(parents=True)
    (folder / "data" / "a.csv").write_text("1,2\n")
    (folder / "data" / "sub" / "b.csv").write_text("3,4\n")
    (tmp_path / "team-b").mkdir()
    (tmp_path / "team-b" / "secret.csv").write_text("team b's private rows\n")
    return folder


def test_inputs_under_the_job_folder_are_staged(job_folder, tmp_path):
    (job_folder / "data" / "alias.csv").symlink_to("a.csv")  # a link to a file inside the folder: a copy
    result = stage_inputs([DataInput(source=f"file://{job_folder}/data/", to="d"),
                           DataInput(source=f"file://{job_folder}/data/a.csv")],
                          tmp_path / "staged", cache=False, roots=[job_folder], team="a")
    staged = {p.relative_to(tmp_path / "staged").as_posix(): p.read_text()
              for p in (tmp_path / "staged").rglob("*") if p.is_file()}
    assert staged == {"d/a.csv": "1,2\n", "d/alias.csv": "1,2\n", "d/sub/b.csv": "3,4\n", "a.csv": "1,2\n"}
    assert result.files == 4 and not any(p.is_symlink() for p in (tmp_path / "staged").rglob("*"))


@pytest.mark.parametrize("source", [
    "file:///etc/shadow",
    "file:///etc/passwd",
    "file:///proc/self/environ",
    "{job}/../../team-b/secret.csv",
    "file://{job}/../../team-b/",
    "file://{job}/link-out.csv",
])
def test_a_file_input_outside_the_allowed_roots_fails_naming_the_path_and_the_rule(job_folder, tmp_path, source):
    (job_folder / "link-out.csv").symlink_to(tmp_path / "team-b" / "secret.csv")
    url = source.format(job=job_folder)
    with pytest.raises(StagingError) as failure:
        stage_inputs([DataInput(source=url)], tmp_path / "staged", cache=False, roots=[job_folder], team="a")
    message = str(failure.value)
    assert message.startswith(f"data {url}") and "outside the folders team 'a' may use" in message
    assert str(job_folder) in message and "E31_FILE_ROOTS" in message
    assert not (tmp_path / "staged").exists() or not any((tmp_path / "staged").rglob("*"))


def test_an_operator_root_lets_a_team_read_a_shared_folder(job_folder, tmp_path):
    shared = tmp_path / "datasets"
    shared.mkdir()
    (shared / "x.csv").write_text("shared\n")
    stage_inputs([DataInput(source=f"file://{shared}/x.csv")], tmp_path / "staged", cache=False,
                 roots=[job_folder, shared], team="a")
    assert (tmp_path / "staged" / "x.csv").read_text() == "shared\n"


@pytest.mark.parametrize(("make", "why"), [
    (lambda folder, tmp: (folder / "shadow").symlink_to("/etc/shadow"), "shadow is a symbolic link to /etc/shadow"),
    (lambda folder, tmp: (folder / "theirs").symlink_to(tmp / "team-b" / "secret.csv"), "theirs is a symbolic link"),
    (lambda folder, tmp: (folder / "up").symlink_to("../../../team-b"), "up is a symbolic link to ../../../team-b"),
    (lambda folder, tmp: (folder / "env").symlink_to("/proc/self/environ"), "env is a symbolic link"),
    (lambda folder, tmp: os.mkfifo(folder / "pipe"), "pipe is a fifo"),
])
def test_a_link_out_of_a_staged_folder_or_a_special_file_fails_naming_it(job_folder, tmp_path, make, why):
    make(job_folder / "data", tmp_path)
    for roots in ([job_folder], None):  # whatever the roots, a link out of the staged folder is not followed
        with pytest.raises(StagingError) as failure:
            stage_inputs([DataInput(source=f"file://{job_folder}/data/")], tmp_path / "staged", cache=False,
                         roots=roots)
        message = str(failure.value)
        assert message.startswith(f"data file://{job_folder}/data/: ") and why in message, message
        assert "team b" not in "".join(p.read_text() for p in (tmp_path / "staged").rglob("*") if p.is_file())
