"""A job's code tries what a hostile job would; it reaches only its own flow run, in either runtime.

The job asks the Prefect API it was given for every block's secrets, the variables and other runs,
tries the real API's port directly, and reads its parent's environment. It also does what a
legitimate job does (a task, a subflow, a log line, an artifact): all of that must reach the UI.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from uuid import UUID

import pytest
from prefect import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterParentFlowRunId,
    LogFilter,
    LogFilterFlowRunId,
)

from tests.integration.conftest import cli, flow_run_id
from tests.integration.test_device_fence import make_nodes
from tests.integration.test_jobs_end_to_end import read_run, write_job

pytestmark = pytest.mark.integration

# A job's own call of the Prefect API it was given, as an attacker writes it (it needs json, os and urllib):
# the status and body, refused or not. Its gateway may hold a call for its run's end a while (gateway.END_HOLD_SECONDS).
API_CALL = '''
def call(method, path, body=None):
    request = urllib.request.Request(os.environ["PREFECT_API_URL"] + path, method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
'''

HOSTILE = """
import json, os, socket, urllib.error, urllib.request
from pathlib import Path
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact

@task(tags=["nightly-db"])  # a tagged task holds a slot of its tag's concurrency limit, through the gateway
def step(x: int) -> int:
    return x + 1

@flow
def child() -> int:
    return step(1)

""" + API_CALL + """
@flow
def hostile(api_host: str, api_port: int) -> int:
    seen = {"uid": os.geteuid()}
    seen["secrets"] = call("POST", "/block_documents/filter", {"include_secrets": True})
    seen["secret_by_name"] = call("GET", "/block_types/slug/secret/block_documents/name/leak?include_secrets=true")
    seen["variables"] = call("POST", "/variables/filter", {})
    # A host's heartbeat kept alive (its fence never runs out; a lost host never judged), a host or GPU drained
    # or undrained: each is a variable of e31's.
    seen["heartbeat"] = call("PATCH", "/variables/name/e31_host_forged", {"value": {"host": "forged"}})
    seen["drain"] = call("POST", "/variables/", {"name": "e31_drain_forged", "value": {}, "tags": ["e31-drain"]})
    seen["other_runs"] = call("POST", "/flow_runs/filter", {})
    seen["own_run"] = call("GET", "/flow_runs/" + os.environ["PREFECT__FLOW_RUN_ID"])[0]
    try:
        socket.create_connection((api_host, api_port), timeout=3).close()
        seen["direct"] = "reached"
    except OSError as error:
        seen["direct"] = type(error).__name__
    try:
        seen["parent_environ"] = Path(f"/proc/{os.getppid()}/environ").read_bytes().decode(errors="replace")
    except OSError as error:
        seen["parent_environ"] = type(error).__name__
    seen["environ"] = dict(os.environ)
    get_run_logger().info("the job's own log line")
    create_markdown_artifact("# made by the job", key="made-by-the-job")
    seen["child"] = child()
    Path(os.environ["E31_OUTPUT_DIR"], "seen.json").write_text(json.dumps(seen))
    return step(41)
"""


@pytest.fixture
def secret_block(prefect_server) -> str:
    from prefect.blocks.system import Secret

    Secret(value="the-block-secret").save("leak", overwrite=True)
    return "the-block-secret"


@pytest.mark.parametrize("runtime", ["process", "container"])
def test_a_hostile_job_reaches_only_its_own_flow_run(runtime, prefect_server, secret_block, tmp_path, pool,
                                                     request):
    image = f", image: {request.getfixturevalue('job_image')}" if runtime == "container" else ""
    host, port = prefect_server.split("//", 1)[1].split("/", 1)[0].split(":")
    job = write_job(tmp_path / "hostile", f"""
        name: hostile
        work: {{flow: flow.py:hostile{image}, parameters: {{api_host: "{host}", api_port: {port}}}}}
        request: {{gpus: 0, max_duration: 5m}}
        output: {{to: ./out/, expect: [seen.json]}}
        """, flow=HOSTILE)
    result = cli("e31", "run", str(job), "--pool", pool,
                 env={"AWS_SECRET_ACCESS_KEY": "the-worker-secret", "PREFECT_API_KEY": ""})
    assert result.returncode == 0, result.stdout + result.stderr
    run_id = flow_run_id(result.stdout)
    seen = json.loads((tmp_path / "hostile" / "out" / "seen.json").read_text())

    for refused in ("secrets", "secret_by_name", "variables", "heartbeat", "drain", "other_runs"):
        status, body = seen[refused]
        assert status == 403, (refused, status, body)
        assert "the-block-secret" not in body
    assert seen["own_run"] == 200
    assert seen["direct"] != "reached", "the job reached the Prefect API's port itself"
    assert "the-worker-secret" not in json.dumps(seen)
    assert not any(key.startswith(("AWS_", "E31_GPUS", "PREFECT_API_KEY")) for key in seen["environ"])
    if runtime == "container":
        assert seen["uid"] == 62000, "a job container runs as no root of its image"
    if runtime == "process" and os.geteuid() == 0:
        assert seen["uid"] >= 61000, "a process job runs as a user of its own"
        # Its parent, its supervisor, is outside its own PID namespace: no process of the host is in its /proc.
        assert seen["parent_environ"] == "FileNotFoundError"

    # What a legitimate job does through the same gateway reaches Prefect: result, logs, subflow, artifact.
    state = read_run(run_id).state
    assert state.is_completed(), state
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
        assert "the job's own log line" in [log.message for log in logs]
        assert any(log.task_run_id is not None for log in logs), "a task's own log lines pass too"
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run_id])))
        assert [c.state.is_completed() for c in children] == [True]
        made = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["made-by-the-job"]), flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
        assert [artifact.data for artifact in made] == ["# made by the job"]
    # Prefect records task runs from the events the job sent over its websocket, a moment later.
    deadline = time.monotonic() + 30
    while True:
        with get_client(sync_client=True) as client:
            task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [UUID(str(run_id))]}))
        names = {t.name.rsplit("-", 1)[0] for t in task_runs}
        if names >= {"step", "child"} or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert names >= {"step", "child"}


def test_a_job_naming_a_host_file_as_its_data_fails_before_renting(prefect_server, tmp_path, pool):
    job = write_job(tmp_path / "greedy", """
        name: greedy
        work: {command: ["true"]}
        data: [{from: "file:///etc/passwd"}]
        request: {gpus: 1, max_duration: 5m}
        """)
    # A shared pool's worker (`e31 run`'s own worker stages what the person at the keyboard may read).
    submitted = cli("e31", "submit", str(job), "--now", "--pool", pool)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    worker = cli("prefect", "worker", "start", "--pool", pool, "--type", "e31", "--run-once", gpus="1xH100")
    assert worker.returncode == 0, worker.stdout + worker.stderr
    run = read_run(flow_run_id(submitted.stdout))
    assert run.state.name == "StagingFailed", run.state
    assert "/etc/passwd" in run.state.message and "E31_FILE_ROOTS" in run.state.message
    assert "e31:billed-s=0" in run.tags


# A job that ignores CUDA_VISIBLE_DEVICES: it opens every GPU node of the host itself, and makes one of its own.
GREEDY_FOR_GPUS = """
import errno, json, os, stat
from pathlib import Path
from prefect import flow

@flow
def greedy(nodes: str) -> None:
    seen = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES")}
    for node in sorted(Path(nodes).iterdir()):
        try:
            os.close(os.open(node, os.O_RDWR))
            seen[node.name] = "opened"
        except OSError as error:
            seen[node.name] = errno.errorcode[error.errno]
    try:
        os.mknod(Path(os.environ["E31_OUTPUT_DIR"], "my-nvidia3"), stat.S_IFCHR | 0o666, os.makedev(195, 3))
        seen["mknod"] = "made"
    except OSError as error:
        seen["mknod"] = errno.errorcode[error.errno]
    Path(os.environ["E31_OUTPUT_DIR"], "seen.json").write_text(json.dumps(seen))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="device nodes are made with mknod, as root")
def test_a_process_job_opens_only_the_gpus_it_rented(prefect_server, tmp_path, pool):
    """2 of a host's 4 GPUs rented (1 and 2, the H100s): their nodes and nvidiactl open to the job (ENXIO here:
    no driver serves them), GPUs 0 and 3 do not (EPERM), by whatever path it opens them."""
    folder = tmp_path / "greedy"
    make_nodes(folder / "dev", uvm=511)  # this host loads no nvidia-uvm: a node of it stays closed
    job = write_job(folder, f"""
        name: greedy
        work: {{flow: flow.py:greedy, parameters: {{nodes: "{folder / 'dev'}"}}}}
        request: {{gpus: 2, gpu_type: H100, max_duration: 5m}}
        output: {{to: ./out/, expect: [seen.json]}}
        """, flow=GREEDY_FOR_GPUS)
    result = cli("e31", "run", str(job), "--pool", pool, gpus="0:A100,1:H100,2:H100,3:A100")
    assert result.returncode == 0, result.stdout + result.stderr
    seen = json.loads((folder / "out" / "seen.json").read_text())
    EPERM, ENXIO = errno.errorcode[errno.EPERM], errno.errorcode[errno.ENXIO]
    assert seen == {"visible": "1,2", "nvidia0": EPERM, "nvidia1": ENXIO, "nvidia2": ENXIO, "nvidia3": EPERM,
                    "nvidiactl": ENXIO, "elsewhere-nvidia3": EPERM, "nvidia-uvm": EPERM,
                    "nvidia-uvm-tools": EPERM, "mknod": EPERM}, seen
    assert "nvidia-uvm is not loaded" in result.stdout + result.stderr, "the operator is told why CUDA cannot start"
    assert not any(stat.S_ISCHR(path.lstat().st_mode) for path in (folder / "out").rglob("*"))
