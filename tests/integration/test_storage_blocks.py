"""E31 Storage blocks: `e31 blocks apply`, jobs with `storage: NAME`, and results read back with state.result().

The S3 store is moto's S3 server over HTTP; the worker (`e31 run`, a subprocess) has no AWS_* variables,
so whatever reached the store used the block's credentials.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
import s3fs
from prefect import get_client

from e31_prefect.data.blocks import E31Storage
from e31_prefect.data.results import RESULTS_FOLDER, released_result
from tests.integration.conftest import REPO, cli, flow_run_id
from tests.integration.test_jobs_end_to_end import read_run, write_job

pytestmark = pytest.mark.integration

FLOW = """
import json, os
from prefect import flow
from e31_prefect import data_dir, output_dir

@flow
def inventory():
    (output_dir() / "env.json").write_text(json.dumps(dict(os.environ)))
    names = sorted(p.relative_to(data_dir()).as_posix() for p in data_dir().rglob("*") if p.is_file())
    return {"files": names, "bytes": sum((data_dir() / n).stat().st_size for n in names)}
"""


@pytest.fixture
def no_aws_env(monkeypatch, tmp_path) -> None:
    """Neither the test nor the `e31` it starts has AWS credentials: only a block's can work."""
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.aws either


def store_env(s3_env: dict[str, str], key_id: str | None = None) -> dict[str, str]:
    """The variables blocks/e31-store.yaml reads its endpoint and secrets from."""
    return {"E31_STORE_ENDPOINT": s3_env["AWS_ENDPOINT_URL"],
            "E31_STORE_KEY_ID": key_id or s3_env["AWS_ACCESS_KEY_ID"],
            "E31_STORE_SECRET": s3_env["AWS_SECRET_ACCESS_KEY"]}


def store(s3_env: dict[str, str]) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(key=s3_env["AWS_ACCESS_KEY_ID"], secret=s3_env["AWS_SECRET_ACCESS_KEY"],
                             client_kwargs={"endpoint_url": s3_env["AWS_ENDPOINT_URL"]}, skip_instance_cache=True)


def apply_blocks(folder: Path, env: dict[str, str]) -> str:
    applied = cli("e31", "blocks", "apply", str(folder), env=env)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    return applied.stdout


def test_applied_block_stages_and_sends_with_its_credentials_and_the_result_reads_back(
        prefect_server, s3_server, tmp_path, pool, no_aws_env):
    blocks = tmp_path / "blocks"
    shutil.copytree(REPO / "blocks", blocks)
    out = apply_blocks(blocks, store_env(s3_server))
    assert "E31 Storage block 'e31-store'" in out and "secret_access_key from $E31_STORE_SECRET" in out
    # Applying again updates the same block.
    assert "Updated E31 Storage block 'e31-store'" in apply_blocks(blocks, store_env(s3_server))
    with get_client(sync_client=True) as client:
        document = client.read_block_document_by_name("e31-store", "e31-storage", include_secrets=False)
    assert s3_server["AWS_SECRET_ACCESS_KEY"] not in json.dumps(document.data)
    assert set(document.block_schema.fields["secret_fields"]) == {"access_key_id", "secret_access_key",
                                                                  "session_token"}

    fs = store(s3_server)
    fs.mkdir("stored")
    fs.pipe({"stored/in/a.bin": b"a" * 300, "stored/in/deep/b.bin": b"b" * 4000})
    job = write_job(tmp_path / "job", """
        name: stored-job
        storage: e31-store
        work: {flow: flow.py:inventory}
        data:
          - {from: "s3://stored/in/", to: in}
        request: {gpus: 0, max_duration: 5m}
        output: {to: "s3://stored/out/{flow_run.id}/", expect: [env.json]}
        """, flow=FLOW)
    result = cli("e31", "run", str(job), "--pool", pool)
    assert result.returncode == 0, result.stdout + result.stderr
    run_id = flow_run_id(result.stdout)

    seen = json.loads(fs.cat(f"stored/out/{run_id}/env.json"))
    assert not [k for k in seen if k.startswith("AWS_") or k.startswith("E31_STORE")]
    assert {k for k in seen if k.startswith("E31_")} == {"E31_DATA_DIR", "E31_OUTPUT_DIR"}
    assert not [k for k, v in seen.items() if s3_server["AWS_SECRET_ACCESS_KEY"] in v]

    state = read_run(run_id).state
    assert state.is_completed()
    assert state.data.storage_key.startswith(f"s3://stored/out/{run_id}/{RESULTS_FOLDER}/")
    assert state.result() == {"files": ["in/a.bin", "in/deep/b.bin"], "bytes": 4300}


def staging_message_of(folder: Path, team: str, storage: str, pool: str) -> str:
    """Run a job naming ``storage``; it must fail StagingFailed before renting. Its state's message."""
    job = write_job(folder, f"""
        name: {folder.name}
        team: {team}
        storage: {storage}
        work: {{flow: flow.py:inventory}}
        request: {{gpus: 1, max_duration: 5m}}
        """, flow=FLOW)
    result = cli("e31", "run", str(job), "--pool", pool, gpus="1xH100")
    assert result.returncode == 1
    run = read_run(flow_run_id(result.stdout))
    assert run.state.name == "StagingFailed"
    assert "e31:billed-s=0" in run.tags
    return run.state.message


def test_a_job_naming_a_block_that_does_not_exist_fails_before_renting(prefect_server, tmp_path, pool):
    message = staging_message_of(tmp_path / "nostore", "vision", "not-applied-yet", pool)
    assert "not-applied-yet" in message and "e31 blocks apply blocks/" in message


def test_a_job_of_another_team_naming_a_teams_block_fails_before_renting(prefect_server, tmp_path, pool):
    from e31_prefect.data.blocks import E31Storage

    E31Storage(endpoint_url="http://127.0.0.1:1", teams=["vision"]).save("vision-store", overwrite=True)
    message = staging_message_of(tmp_path / "borrow", "speech", "vision-store", pool)
    assert "'vision-store' is for team(s) vision, and this job's team is speech" in message


def test_wrong_credentials_fail_before_renting_naming_the_url(prefect_server, s3_server, tmp_path, pool,
                                                              no_aws_env):
    fs = store(s3_server)
    fs.mkdir("guarded")
    fs.pipe({"guarded/data.csv": b"x,y\n"})
    write_job(tmp_path / "blocks", """
        type: e31-storage
        name: wrong-keys
        endpoint_url: {env: E31_STORE_ENDPOINT}
        access_key_id: {env: E31_STORE_KEY_ID}
        secret_access_key: {env: E31_STORE_SECRET}
        """, name="wrong-keys.yaml")
    apply_blocks(tmp_path / "blocks", store_env(s3_server, key_id="AKIANOTAKEY"))
    job = write_job(tmp_path / "job", """
        name: wrong-keys
        storage: wrong-keys
        work: {flow: flow.py:inventory}
        data: [{from: "s3://guarded/data.csv"}]
        request: {gpus: 1, max_duration: 5m}
        """, flow=FLOW)
    # moto checks credentials only when asked to: from now on, every request.
    auth = f"{s3_server['AWS_ENDPOINT_URL']}/moto-api/reset-auth"
    before = httpx.post(auth, content=b"0").json()["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"]
    try:
        result = cli("e31", "run", str(job), "--pool", pool, gpus="1xH100")
    finally:
        httpx.post(auth, content=str(before).encode())
    assert result.returncode == 1
    run = read_run(flow_run_id(result.stdout))
    assert run.state.name == "StagingFailed"
    assert "s3://guarded/data.csv" in run.state.message
    # The cause as the store gave it: a HEAD request's 403 carries no reason, a listing's names the key.
    assert any(cause in run.state.message for cause in ("Access Key Id", "Forbidden", "denied", "PermissionError"))
    assert "e31:billed-s=0" in run.tags


def test_the_result_of_a_run_with_local_outputs_reads_back_on_this_host(prefect_server, tmp_path, pool):
    job = write_job(tmp_path / "local", """
        name: local-result
        work: {flow: flow.py:inventory}
        data: [{from: input.txt}]
        request: {gpus: 0, max_duration: 5m}
        output: {to: ./out/}
        """, flow=FLOW)
    (tmp_path / "local" / "input.txt").write_text("hello")
    result = cli("e31", "run", str(job), "--pool", pool)
    assert result.returncode == 0, result.stdout + result.stderr
    run_id = flow_run_id(result.stdout)
    state = read_run(run_id).state
    assert Path(state.data.storage_key).parent == tmp_path / "local" / "out" / RESULTS_FOLDER
    assert state.result() == {"files": ["input.txt"], "bytes": 5}

    async def released() -> object:
        async with get_client() as client:
            return await released_result(client, run_id)

    assert asyncio.run(released()) == {"files": ["input.txt"], "bytes": 5}


def test_the_block_type_registers_for_the_ui(prefect_server):
    registered = cli("prefect", "block", "register", "-m", "e31_prefect.data.blocks")
    assert registered.returncode == 0, registered.stdout + registered.stderr
    with get_client(sync_client=True) as client:
        block_type = client.read_block_type_by_slug("e31-storage")
    assert block_type.name == "E31 Storage" and E31Storage.get_description()


def test_the_result_of_a_container_run_reads_back(prefect_server, job_image, tmp_path, pool):
    job = write_job(tmp_path / "boxed", f"""
        name: boxed-result
        work: {{flow: flow.py:inventory, image: {job_image}}}
        data: [{{from: input.txt}}]
        request: {{gpus: 0, max_duration: 5m}}
        output: {{to: ./out/}}
        """, flow=FLOW)
    (tmp_path / "boxed" / "input.txt").write_text("boxed")
    result = cli("e31", "run", str(job), "--pool", pool)
    assert result.returncode == 0, result.stdout + result.stderr
    state = read_run(flow_run_id(result.stdout)).state
    # The container wrote it under its own /e31/output; it is read from where the outputs went.
    assert Path(state.data.storage_key).parent == tmp_path / "boxed" / "out" / RESULTS_FOLDER
    assert state.result() == {"files": ["input.txt"], "bytes": 5}


def test_without_a_block_the_result_reads_back_with_the_callers_default_credentials(
        prefect_server, s3_server, tmp_path, pool, monkeypatch):
    fs = store(s3_server)
    fs.mkdir("chained")
    job = write_job(tmp_path / "chain", """
        name: chained-result
        work: {flow: flow.py:inventory}
        request: {gpus: 0, max_duration: 5m}
        output: {to: "s3://chained/{flow_run.id}/"}
        """, flow=FLOW)
    result = cli("e31", "run", str(job), "--pool", pool, env=s3_server)
    assert result.returncode == 0, result.stdout + result.stderr
    state = read_run(flow_run_id(result.stdout)).state
    assert state.data.storage_key.startswith("s3://chained/")
    for name, value in s3_server.items():
        monkeypatch.setenv(name, value)  # the caller's own default chain, as the worker's was
    assert state.result() == {"files": [], "bytes": 0}


ANSWER_FLOW = """
from prefect import flow

@flow
def answer() -> int:
    return 42
"""


def test_a_servers_default_result_storage_leaves_the_jobs_result_with_its_outputs(prefect_server, tmp_path, pool):
    """An operator gave the Prefect server a default result storage: a block the job holds no credentials for and
    may not read. The job's result is kept with its outputs all the same, and read back from there."""
    from prefect.filesystems import LocalFileSystem

    elsewhere = tmp_path / "server-results"
    block_id = LocalFileSystem(basepath=str(elsewhere)).save("e31-server-default-results", overwrite=True)
    with get_client(sync_client=True) as client:
        client.update_server_default_result_storage(block_id)
    try:
        job = write_job(tmp_path / "answer", """
            name: answer
            work: {flow: flow.py:answer}
            request: {gpus: 0, max_duration: 5m}
            output: {to: ./out/}
            """, flow=ANSWER_FLOW)
        result = cli("e31", "run", str(job), "--pool", pool)
    finally:
        with get_client(sync_client=True) as client:
            client.clear_server_default_result_storage()
    assert result.returncode == 0, result.stdout + result.stderr
    state = read_run(flow_run_id(result.stdout)).state
    assert state.is_completed(), state
    assert Path(state.data.storage_key).parent == tmp_path / "answer" / "out" / RESULTS_FOLDER
    assert state.result() == 42
    assert not elsewhere.exists(), "the result went to the server's default storage"
