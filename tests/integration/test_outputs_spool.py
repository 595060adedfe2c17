"""Nothing is lost when the store goes down while outputs are being sent: a moto S3 server of this
test's own is stopped mid-upload, the run ends OutputNotSent with its outputs in the spool, and
`e31 outputs retry` sends every file once the server is back on the same port."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

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
