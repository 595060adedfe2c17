"""Nothing is lost when the store goes down while outputs are being sent: a moto S3 server of this
test's own is stopped mid-upload, the run ends OutputNotSent with its outputs in the spool, and
`e31 outputs retry` sends every file once the server is back on the same port."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

import pytest
import s3fs
from moto.server import ThreadedMotoServer

from tests.integration.conftest import cli, flow_run_id
from tests.integration.test_jobs_end_to_end import artifacts_of, read_run, write_job

pytestmark = pytest.mark.integration

FILES = 600

FLOW = f"""
import random
from prefect import flow
from e31_prefect import output_dir

@flow
def many():
    rng = random.Random(7)
    for n in range({FILES}):
        (output_dir() / f"part-{{n // 100}}").mkdir(exist_ok=True)
        (output_dir() / f"part-{{n // 100}}" / f"{{n:04d}}.bin").write_bytes(rng.randbytes(8192))
    return {FILES}
"""


def expected_outputs() -> dict[str, bytes]:
    rng = random.Random(7)
    return {f"part-{n // 100}/{n:04d}.bin": rng.randbytes(8192) for n in range(FILES)}


def own_server(port: int = 0) -> ThreadedMotoServer:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server


def store_env(server: ThreadedMotoServer) -> dict[str, str]:
    host, port = server.get_host_and_port()
    return {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "spool-key",
            "AWS_SECRET_ACCESS_KEY": "spool-secret", "AWS_DEFAULT_REGION": "us-east-1"}


def test_outputs_survive_the_store_stopping_mid_upload_and_retry_sends_them(prefect_server, tmp_path, pool,
                                                                            monkeypatch):
    server = own_server()
    env = store_env(server)
    port = server.get_host_and_port()[1]
    fs = s3fs.S3FileSystem(key="k", secret="s", client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL"]},
                           skip_instance_cache=True)
    fs.mkdir("results")
    job = write_job(tmp_path / "spool", """
        name: many-outputs
        work: {flow: flow.py:many}
        request: {gpus: 0, max_duration: 10m}
        output: {to: "s3://results/{job}/{flow_run.id}/"}
        """, flow=FLOW)
    program = shutil.which("e31", path=str(Path(sys.executable).parent))
    run = subprocess.Popen([program, "run", str(job), "--pool", pool], env={**os.environ, **env},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # The store goes down as soon as the first output has arrived, with most still to send.
        deadline = time.monotonic() + 180
        arrived: list[str] = []
        while not arrived and time.monotonic() < deadline and run.poll() is None:
            fs.invalidate_cache()
            arrived = fs.find("results/many-outputs/")
            time.sleep(0.05)
        server.stop()
        assert arrived and len(arrived) < FILES, f"the upload was not caught in flight ({len(arrived)} sent)"
        output, _ = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 1, output
    run_id = flow_run_id(output)
    state = read_run(run_id).state
    assert state.name == "OutputNotSent", output
    kept = Path(os.environ["E31_HOME"]) / "spool" / str(run_id) / "outputs"
    assert str(kept) in state.message and f"e31 outputs retry {run_id}" in state.message
    assert "does not answer" in state.message
    # Nothing lost on disk: every file the flow wrote is in the spool, byte for byte.
    expected = expected_outputs()
    on_disk = {p.relative_to(kept).as_posix(): p.read_bytes() for p in kept.rglob("*") if p.is_file()}
    assert {k: v for k, v in on_disk.items() if not k.startswith(".prefect-results/")} == expected
    assert "spool" in artifacts_of(run_id)

    server = own_server(port)  # the store comes back, on the same port, with what it had
    try:
        retried = cli("e31", "outputs", "retry", str(run_id), env=env)
        assert retried.returncode == 0, retried.stdout + retried.stderr
        assert f"Sent {len(on_disk)} file(s)" in retried.stdout
        fs.invalidate_cache()
        prefix = f"results/many-outputs/{run_id}/"
        assert {path: fs.cat(f"{prefix}{path}") for path in on_disk} == on_disk
        assert not kept.parent.exists()
        assert read_run(run_id).state.name == "Completed"  # the flow had completed; only its outputs failed
        # Its return value, sent with the outputs, reads back (through the store, with the caller's credentials).
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert read_run(run_id).state.result() == FILES
        again = cli("e31", "outputs", "retry", str(run_id), env=env)
        assert again.returncode == 0 and "Nothing kept" in again.stdout
    finally:
        server.stop()


# -- only the job's own bytes, only to its own destination ----------------------------------------

OWN = {"model.json": b'{"w": 1}', "sub/metrics.json": b'{"acc": 0.9}'}


def hostile_output_dir(tmp_path: Path) -> tuple[Path, bytes]:
    """An output dir as a hostile job leaves it: its own files, and links and special files pointing at the host.

    Returns the dir and the bytes of a host file the job must not get out.
    """
    secret = tmp_path / "host-secret.txt"
    secret.write_bytes(b"the worker host's private bytes")
    out = tmp_path / "output"
    (out / "sub").mkdir(parents=True)
    for name, data in OWN.items():
        (out / name).write_bytes(data)
    (out / "shadow").symlink_to("/etc/shadow")
    (out / "passwd").symlink_to("/etc/passwd")
    (out / "environ").symlink_to("/proc/self/environ")
    (out / "host.txt").symlink_to(secret)
    (out / "sub" / "etc").symlink_to("/etc")
    os.link(secret, out / "twin.txt")  # a hard link: the host file under a name in the output dir
    os.mkfifo(out / "pipe")
    return out, secret.read_bytes()


NOT_SENT = {"environ": "a symbolic link to /proc/self/environ", "passwd": "a symbolic link to /etc/passwd",
            "pipe": "a fifo", "shadow": "a symbolic link to /etc/shadow", "sub/etc": "a symbolic link to /etc",
            "twin.txt": "a hard link: one of 2 names of one file"}


def test_only_the_jobs_own_bytes_are_sent_and_the_rest_is_named(tmp_path):
    from e31_prefect.data.staging import upload_outputs

    out, secret = hostile_output_dir(tmp_path)
    sent = upload_outputs(out, f"file://{tmp_path}/dest/", attempts=1)
    got = {p.relative_to(tmp_path / "dest").as_posix(): p.read_bytes()
           for p in (tmp_path / "dest").rglob("*") if p.is_file() or p.is_symlink()}
    assert got == OWN
    assert {s.path: s.why for s in sent.skipped} == {**NOT_SENT, "host.txt": f"a symbolic link to {tmp_path}/host-"
                                                     "secret.txt"}
    assert sent.files == 2 and "7 not sent (links or special files)" in str(sent)


def test_only_the_jobs_own_bytes_go_to_s3(s3_server, tmp_path):
    from e31_prefect.data.staging import upload_outputs

    out, _ = hostile_output_dir(tmp_path)
    fs = s3fs.S3FileSystem(key="k", secret="s", client_kwargs={"endpoint_url": s3_server["AWS_ENDPOINT_URL"]},
                           skip_instance_cache=True)
    fs.mkdir("own-bytes")
    options = {"s3": {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": s3_server["AWS_ENDPOINT_URL"]}}}
    sent = upload_outputs(out, "s3://own-bytes/run/", options, attempts=1)
    fs.invalidate_cache()
    assert {p.removeprefix("own-bytes/run/"): fs.cat(p) for p in fs.find("own-bytes/")} == OWN
    assert len(sent.skipped) == 7


def test_a_link_in_a_local_destination_is_not_written_through(tmp_path):
    from e31_prefect.data.staging import UploadError, upload_outputs

    out = tmp_path / "output"
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "x.txt").write_text("mine")
    elsewhere = tmp_path / "team-b"
    elsewhere.mkdir()
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "sub").symlink_to(elsewhere)  # left in the destination before the send
    with pytest.raises(UploadError) as failure:
        upload_outputs(out, f"file://{tmp_path}/dest/", attempts=1)
    assert f"{tmp_path}/dest/sub is a symbolic link" in str(failure.value)
    assert list(elsewhere.iterdir()) == []


def test_an_expected_output_that_is_a_link_counts_as_missing_and_says_why(tmp_path):
    from e31_prefect.data.staging import missing_outputs

    out, _ = hostile_output_dir(tmp_path)
    assert missing_outputs(out, ["model.json", "sub/metrics.json", "sub", "passwd", "sub/etc/passwd", "nope",
                                 "model.json/x"]) == [
        "passwd (a symbolic link to /etc/passwd: not sent)", "sub/etc/passwd (a symbolic link to /etc: not sent)",
        "nope", "model.json/x"]


def test_the_spool_keeps_only_own_bytes_and_retry_follows_no_link(prefect_server, tmp_path):
    from e31_prefect.surface import spool

    out, secret = hostile_output_dir(tmp_path)
    home = tmp_path / "e31" / "spool"
    run_id = "00000000-0000-4000-8000-000000000010"
    kept = spool.keep(out, home, run_id, f"file://{tmp_path}/dest/", reason="the store does not answer")
    assert {f["path"] for f in kept.files} == set(OWN)
    assert {s.path for s in kept.not_kept} == set(NOT_SENT) | {"host.txt"}
    assert "7 entries of the output dir not sent" in kept.message() and "shadow (a symbolic link" in kept.message()
    # An entry an older e31 kept (it moved links as they were): the retry sends the files, not the links.
    (Path(kept.outputs) / "later-link").symlink_to(tmp_path / "host-secret.txt")
    retried = cli("e31", "outputs", "retry", run_id, env={"E31_HOME": str(tmp_path / "e31")})
    assert retried.returncode == 0, retried.stdout + retried.stderr
    assert "Sent 2 file(s)" in retried.stdout and "later-link (a symbolic link to" in retried.stdout
    got = {p.relative_to(tmp_path / "dest").as_posix(): p.read_bytes() for p in (tmp_path / "dest").rglob("*")
           if p.is_file()}
    assert got == OWN and secret not in b"".join(got.values())


HOSTILE_FLOW = """
import os
from prefect import flow
from e31_prefect import output_dir

@flow
def hostile(secret: str) -> str:
    out = output_dir()
    (out / "own.txt").write_text("mine")
    os.symlink("/etc/shadow", out / "shadow")
    os.symlink("/proc/self/environ", out / "environ")
    os.symlink(secret, out / "host.txt")
    try:
        os.link(secret, out / "twin.txt")
    except OSError:  # a job of its own uid cannot reach the host's file (or link what it does not own)
        (out / "mine-too.txt").write_text("also mine")
        os.link(out / "mine-too.txt", out / "twin.txt")
    os.mkfifo(out / "pipe")
    return "done"
"""


def test_a_job_leaving_links_in_its_output_dir_sends_only_its_own_bytes_and_says_which(prefect_server, tmp_path,
                                                                                         pool):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("the worker host's private bytes")
    job = write_job(tmp_path / "job", f"""
        name: leaves-links
        work: {{flow: flow.py:hostile, parameters: {{secret: "{secret}"}}}}
        request: {{gpus: 0, max_duration: 10m}}
        output: {{to: ./out/}}
        """, flow=HOSTILE_FLOW)
    result = cli("e31", "run", str(job), "--pool", pool)
    assert result.returncode == 0, result.stdout + result.stderr
    run_id = flow_run_id(result.stdout)
    sent = {p.relative_to(tmp_path / "job" / "out").as_posix() for p in (tmp_path / "job" / "out").rglob("*")}
    assert sent == {"own.txt", ".prefect-results"} | {f".prefect-results/{p.name}" for p in
                                                      (tmp_path / "job" / "out" / ".prefect-results").iterdir()}
    state = read_run(run_id).state
    assert state.is_completed() and state.result() == "done"
    for name in ("shadow (a symbolic link to /etc/shadow)", "environ (a symbolic link to /proc/self/environ)",
                 "host.txt (a symbolic link to", "twin.txt (a hard link", "pipe (a fifo)"):
        assert name in state.message, state.message
    assert "entries of the output dir not sent" in state.message
    found = artifacts_of(run_id)
    assert "shadow" in found["skipped"].data and "twin.txt" in found["skipped"].data


def deploy_and_run(tmp_path: Path, pool: str, job_text: str, run_name: str) -> UUID:
    """Deploy a job file as e31 does, start one run of it named ``run_name``, and let one worker run it."""
    from prefect import get_client
    from prefect.states import Scheduled

    from e31_prefect.model.job_file import load_job_file
    from e31_prefect.surface.submission import deploy_job, ensure_pool

    path = write_job(tmp_path / "job", job_text)
    job = load_job_file(path)

    async def submit() -> UUID:
        async with get_client() as client:
            await ensure_pool(client, pool)
            deployment = await deploy_job(client, job, path.parent, pool)
            run = await client.create_flow_run_from_deployment(deployment, name=run_name, state=Scheduled())
            return run.id

    run_id = asyncio.run(submit())
    worker = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once",
                 env={"PREFECT_WORKER_QUERY_SECONDS": "1"})
    assert worker.returncode == 0, worker.stdout + worker.stderr
    return run_id


def test_a_flow_run_named_with_slashes_stays_in_its_destination(prefect_server, tmp_path, pool):
    run_id = deploy_and_run(tmp_path, pool, """
        name: named-run
        work: {command: ["sh", "-c", "echo hi > $E31_OUTPUT_DIR/hi.txt"]}
        request: {gpus: 0, max_duration: 10m}
        output: {to: "./out/{flow_run.name}/"}
        """, run_name="../../x")
    assert read_run(run_id).state.is_completed(), read_run(run_id).state
    assert (tmp_path / "job" / "out" / "____x" / "hi.txt").read_text() == "hi\n"
    assert not (tmp_path / "x").exists() and not (tmp_path / "job" / "x").exists()


def test_outputs_to_another_teams_folder_are_refused_naming_the_rule(prefect_server, tmp_path, pool):
    theirs = tmp_path / "team-b" / "results"
    theirs.mkdir(parents=True)
    job = write_job(tmp_path / "team-a", f"""
        name: writes-elsewhere
        team: a
        work: {{command: ["sh", "-c", "echo hi > $E31_OUTPUT_DIR/hi.txt"]}}
        request: {{gpus: 0, max_duration: 10m}}
        output: {{to: "file://{theirs}/"}}
        """)
    result = cli("e31", "run", str(job), "--pool", pool)
    assert result.returncode != 0
    state = read_run(flow_run_id(result.stdout)).state
    assert state.name == "InvalidJob", state
    assert f"output.to file://{theirs}/: outside the folders team 'a' may use" in state.message
    assert str(tmp_path / "team-a") in state.message and "E31_FILE_ROOTS" in state.message
    assert list(theirs.iterdir()) == []
    # The operator allows the team that folder: then the same job sends there.
    allowed = cli("e31", "run", str(job), "--pool", pool, env={"E31_FILE_ROOTS": f'{{"a": ["{tmp_path / "team-b"}"]}}'})
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert (theirs / "hi.txt").read_text() == "hi\n"


CONTAINER_FLOW = """
import os
from prefect import flow
from e31_prefect import output_dir

@flow
def hostile(secret: str) -> str:
    out = output_dir()
    (out / "own.txt").write_text("mine")
    # Inside the container these point nowhere; on the host, where outputs are sent from, they would
    # name the host's own files.
    os.symlink("/etc/shadow", out / "shadow")
    os.symlink(secret, out / "host.txt")
    os.symlink("/proc/self/environ", out / "environ")
    os.mkfifo(out / "pipe")
    return "done"
"""


def test_a_container_leaving_links_to_host_files_sends_only_its_own_bytes(prefect_server, job_image, tmp_path,
                                                                         pool):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("the worker host's private bytes")
    job = write_job(tmp_path / "job", f"""
        name: container-links
        work: {{flow: flow.py:hostile, image: {job_image}, parameters: {{secret: "{secret}"}}}}
        request: {{gpus: 0, max_duration: 5m}}
        output: {{to: ./out/}}
        """, flow=CONTAINER_FLOW)
    result = cli("e31", "run", str(job), "--pool", pool)
    assert result.returncode == 0, result.stdout + result.stderr
    out = tmp_path / "job" / "out"
    assert (out / "own.txt").read_text() == "mine"
    assert not any(p.name in ("shadow", "host.txt", "environ", "pipe") for p in out.rglob("*"))
    state = read_run(flow_run_id(result.stdout)).state
    assert state.is_completed() and "4 entries of the output dir not sent" in state.message, state.message
    assert "shadow (a symbolic link to /etc/shadow)" in state.message
