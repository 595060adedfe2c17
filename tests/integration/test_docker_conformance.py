"""prefect-docker's job variables on the stock DockerWorker and on the e31 worker, side by side.

Each test runs the same setting through both workers on the real engine (a real `prefect worker start
--type docker|e31`), so every difference between them shows here as a named, intended one: e31 mounts
host volumes read-only and refuses settings that would widen a job's view of the host, before renting.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from prefect import get_client

from tests.integration.test_jobs_end_to_end import read_run

pytestmark = pytest.mark.integration

PROBE = """
import json, os, time
from pathlib import Path
from prefect import flow

@flow
def probe(sleep: float = 0):
    time.sleep(sleep)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    shm = os.statvfs("/dev/shm")
    seen = {"shm_bytes": shm.f_blocks * shm.f_frsize, "env": os.environ.get("CONFORMANCE"),
            "cap_eff": status["CapEff"].strip()}
    limits = [p for p in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
              if Path(p).exists()]
    seen["memory_limit"] = Path(limits[0]).read_text().strip() if limits else None
    shared = Path("/mnt/shared")
    if shared.exists():
        seen["shared"] = (shared / "hello.txt").read_text()
        try:
            (shared / "written.txt").write_text("x")
            seen["shared_write"] = "allowed"
        except OSError as exc:
            seen["shared_write"] = exc.strerror
    out = Path(os.environ.get("E31_OUTPUT_DIR") or os.getcwd())
    (out / "seen.json").write_text(json.dumps(seen))
"""

KINDS = ["docker", "e31"]
RUN_LABEL = "io.prefect.flow-run-id"  # prefect-docker's label of a run's container (Prefect's prefect.io/flow-run-id)


class Contender:
    """One worker type's pool, deployment and runs, in a folder of its own."""

    def __init__(self, kind: str, folder: Path, pool: str, image: str, variables: dict[str, Any],
                 pool_defaults: dict[str, Any] | None = None, deployment_name: str | None = None):
        self.kind, self.folder, self.pool = kind, folder, f"{pool}-{kind}"
        # The e31 worker's home, beside the job's folder: a container job whose code folder holds it is refused.
        self.home = folder.parent / f"{folder.name}-e31-home"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "probe.py").write_text(PROBE)
        if kind == "docker":
            variables = {"image": image, "image_pull_policy": "Never", "network_mode": "host",
                         **variables, "volumes": [f"{folder}:{folder}", *variables.get("volumes", [])]}
        else:
            variables = {"request": {"gpus": 0, "max_duration": "5m"}, "work": {"image": variables.pop("image", image)},
                         "output": {"to": f"file://{folder}/out/"}, **variables}
        from prefect.client.schemas.actions import WorkPoolCreate
        from prefect.workers.base import BaseWorker

        template = BaseWorker.get_worker_class_from_type(kind).get_default_base_job_template()
        for name, default in (pool_defaults or {}).items():
            template["variables"]["properties"][name]["default"] = default
        with get_client(sync_client=True) as client:
            client.create_work_pool(WorkPoolCreate(name=self.pool, type=kind, base_job_template=template),
                                    overwrite=True)
            self.deployment = client.create_deployment(
                flow_id=client.create_flow_from_name("probe"), name=deployment_name or self.pool,
                work_pool_name=self.pool,
                entrypoint="probe.py:probe", path=str(folder),
                pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(folder)}}],
                job_variables=variables)

    def submit(self, name: str | None = None, **parameters: Any) -> UUID:
        with get_client(sync_client=True) as client:
            return client.create_flow_run_from_deployment(self.deployment, parameters=parameters, name=name).id

    def worker(self, *extra: str, **env: str) -> subprocess.Popen:
        log = (self.folder / f"worker-{time.monotonic_ns()}.log").open("wb")
        return subprocess.Popen(
            [str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", self.pool, "--type",
             self.kind, *extra],
            env={**os.environ, "E31_HOME": str(self.home), "PREFECT_WORKER_QUERY_SECONDS": "1", **env},
            stdout=log, stderr=subprocess.STDOUT)

    def run_once(self, name: str | None = None, **env: str) -> UUID:
        run_id = self.submit(name)
        worker = self.worker("--run-once", **env)
        assert worker.wait(timeout=240) == 0
        return run_id

    def seen(self) -> dict[str, Any]:
        place = self.folder / ("seen.json" if self.kind == "docker" else "out/seen.json")
        return json.loads(place.read_text())


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A host folder a job may mount (e31: under E31_ALLOWED_VOLUMES)."""
    folder = tmp_path / "shared"
    folder.mkdir()
    (folder / "hello.txt").write_text("from the host")
    return folder


@pytest.mark.parametrize("kind", KINDS)
def test_settings_that_work_on_both(kind, prefect_server, job_image, tmp_path, pool, shared):
    contender = Contender(kind, tmp_path / kind, pool, job_image, {
        "container_create_kwargs": {"shm_size": "256m", "ipc_mode": "shareable"},
        "env": {"CONFORMANCE": "yes"},
        "volumes": [f"{shared}:/mnt/shared:rw"],
    })
    run_id = contender.run_once(E31_ALLOWED_VOLUMES=json.dumps([str(shared)]))
    assert read_run(run_id).state.is_completed(), read_run(run_id).state
    seen = contender.seen()
    assert seen["shm_bytes"] == 256 * 2**20
    assert seen["env"] == "yes"
    assert seen["shared"] == "from the host"
    # The intended difference: e31 mounts a host folder read-only, whatever mode the setting asks.
    assert seen["shared_write"] == {"docker": "allowed", "e31": "Read-only file system"}[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_settings_e31_refuses_by_name_before_renting(kind, prefect_server, job_image, tmp_path, pool):
    contender = Contender(kind, tmp_path / kind, pool, job_image, {
        # `privileged` is refused the same way (tests/unit/test_container.py); it is left out here
        # because a nested engine (this host may be a container) cannot start a privileged container.
        "mem_limit": "300m", "auto_remove": True, "container_create_kwargs": {"cap_add": ["SYS_ADMIN"]},
    })
    run_id = contender.run_once()
    state = read_run(run_id).state
    if kind == "docker":
        assert state.is_completed(), state
        seen = contender.seen()
        assert seen["memory_limit"] in ("314572800", str(300 * 2**20))
        assert seen["cap_eff"] != "0000000000000000"
        listed = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={RUN_LABEL}={run_id}"],
                                capture_output=True, text=True, check=True)
        assert listed.stdout.split() == [], "auto_remove removed the container"
        return
    assert state.name == "InvalidJob", state
    for named in ("mem_limit = '300m': is not an e31 setting: use request.memory",
                  "auto_remove = True", "container_create_kwargs.cap_add = ['SYS_ADMIN']"):
        assert named in state.message
    assert "e31:billed-s=0" in read_run(run_id).tags


@pytest.mark.parametrize("kind", KINDS)
def test_kill_infrastructure_stops_the_work_from_the_id_the_worker_reported(
        kind, prefect_server, job_image, tmp_path, pool):
    """Prefect's cancellation path: a worker's kill_infrastructure with the run's infrastructure_pid."""
    contender = Contender(kind, tmp_path / kind, pool, job_image, {})
    run_id = contender.submit(sleep=600)
    worker = contender.worker(E31_WATCH_SECONDS="3600")  # e31's own cancellation watcher never looks
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (read_run(run_id).infrastructure_pid
                                                   and read_run(run_id).state.is_running()):
            time.sleep(0.5)
        infrastructure = read_run(run_id).infrastructure_pid
        assert infrastructure and read_run(run_id).state.is_running()
        # Both workers' containers carry prefect-docker's run label (e31 finds a run's container by it).
        running = subprocess.run(["docker", "ps", "-q", "--filter", f"label={RUN_LABEL}={run_id}"],
                                 capture_output=True, text=True, check=True)
        assert len(running.stdout.split()) == 1, running.stdout

        from prefect.workers.base import BaseWorker

        from e31_prefect.host.settings import E31Settings

        worker_class = BaseWorker.get_worker_class_from_type(kind)
        extra = {"settings": E31Settings(home=contender.home)} if kind == "e31" else {}
        killer = worker_class(work_pool_name=contender.pool, **extra)
        asyncio.run(killer.kill_infrastructure(infrastructure, configuration=None, grace_seconds=2))
        # The engine in the container reports Crashed as it is stopped; e31's worker then ends the run
        # Cancelled from its supervisor's record: wait for the worker's word, not the first final state.
        ended = (lambda state: state.is_cancelled()) if kind == "e31" else (lambda state: state.is_final())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not ended(read_run(run_id).state):
            time.sleep(0.5)
    finally:
        worker.kill()  # a stock worker does not stop on SIGTERM (Prefect turns it into a SIGINT loop)
        worker.wait(timeout=60)
    state = read_run(run_id).state
    assert state.is_final(), state
    listed = subprocess.run(["docker", "ps", "-q", "--filter", f"label={RUN_LABEL}={run_id}"],
                            capture_output=True, text=True, check=True)
    assert listed.stdout.split() == [], "the container still runs"
    if kind == "e31":
        assert state.is_cancelled(), state


@pytest.fixture(scope="session")
def private_image(job_image: str) -> tuple[str, str]:
    """The job image in a registry that wants a password (scripts/registry.sh), and that block's id."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "registry.sh"
    printed = subprocess.run([str(script)], capture_output=True, text=True)
    if printed.returncode != 0:
        pytest.fail(f"no registry: {printed.stderr[-2000:]}")
    env = dict(item.split("=", 1) for item in printed.stdout.strip().removeprefix("export ").split())
    registry, user, password = env["E31_REGISTRY"], env["E31_REGISTRY_USER"], env["E31_REGISTRY_PASSWORD"]
    private = f"{registry}/e31/job:{job_image.rsplit(':', 1)[1]}"
    subprocess.run(["docker", "tag", job_image, private], check=True)
    subprocess.run(["docker", "login", registry, "-u", user, "--password-stdin"], input=password, text=True,
                   check=True, capture_output=True)
    try:
        subprocess.run(["docker", "push", private], check=True, capture_output=True)
    finally:
        subprocess.run(["docker", "logout", registry], capture_output=True)
    from prefect_docker.credentials import DockerRegistryCredentials

    block = DockerRegistryCredentials(username=user, password=password, registry_url=registry)
    block_id = block.save("e31-conformance-registry", overwrite=True)
    return private, str(block_id)


@pytest.mark.parametrize("kind", KINDS)
def test_a_private_image_is_pulled_with_a_registry_credentials_block(
        kind, prefect_server, private_image, tmp_path, pool):
    image, block_id = private_image
    subprocess.run(["docker", "rmi", image], capture_output=True)  # not on this host: it must be pulled
    # As the UI does it: the pool's form names the block; a run's variables cannot (they are validated
    # as values, and a block reference is not one).
    contender = Contender(kind, tmp_path / kind, pool, image, {"image": image, "image_pull_policy": "Always"},
                          pool_defaults={"registry_credentials": {"$ref": {"block_document_id": block_id}}})
    run_id = contender.run_once()
    assert read_run(run_id).state.is_completed(), read_run(run_id).state
    assert contender.seen()["env"] is None


@pytest.mark.parametrize("kind", KINDS)
def test_with_limit_one_the_high_priority_queue_goes_first_and_the_other_run_stays_in_the_pool(
        kind, prefect_server, job_image, tmp_path, pool):
    """`--limit 1` with a day-late run on a low-priority queue and a fresh run on the high-priority one."""
    from prefect.states import Scheduled

    # On e31 each run wants one of two declared GPUs: the run left behind must hold none of them.
    variables = {"request": {"gpus": 1, "max_duration": "5m"}} if kind == "e31" else {}
    contender = Contender(kind, tmp_path / kind, pool, job_image, variables)
    with get_client(sync_client=True) as client:
        for name, priority in (("urgent", 1), ("bulk", 5)):
            client.create_work_queue(name=name, work_pool_name=contender.pool, priority=priority)
        late = client.create_flow_run_from_deployment(
            contender.deployment, work_queue_name="bulk",
            state=Scheduled(scheduled_time=datetime.now(timezone.utc) - timedelta(days=1))).id
        urgent = client.create_flow_run_from_deployment(contender.deployment, work_queue_name="urgent").id
    worker = contender.worker("--run-once", "--limit", "1", E31_GPUS="2xH100")
    assert worker.wait(timeout=240) == 0
    assert read_run(urgent).state.is_completed(), read_run(urgent).state
    assert read_run(late).state.is_scheduled(), read_run(late).state  # still the pool's, for the next worker


def container_events(run_id: UUID, expect: set[str], timeout: float = 60) -> list[Any]:
    """prefect-docker's container events related to a flow run, oldest first, once all of ``expect`` arrived."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter

    found: list[Any] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with get_client(sync_client=True) as client:
            page = client.read_events(filter=EventFilter(
                event=EventNameFilter(prefix=["prefect.docker.container."]),
                related=EventRelatedFilter(id=[f"prefect.flow-run.{run_id}"])), limit=50)
        found = sorted(page.events, key=lambda event: event.occurred)
        if expect <= {event.event.rsplit(".", 1)[1] for event in found}:
            return found
        time.sleep(1)
    raise AssertionError(f"container events {sorted(expect)} never all arrived; got {[e.event for e in found]}")


@pytest.mark.parametrize("kind", KINDS)
def test_container_events_created_running_exited_about_the_container_and_its_run(
        kind, prefect_server, job_image, tmp_path, pool):
    """Automations wait on `prefect.docker.container.exited`: both workers emit created, running, exited."""
    contender = Contender(kind, tmp_path / kind, pool, job_image, {})
    run_id = contender.run_once()
    assert read_run(run_id).state.is_completed(), read_run(run_id).state
    events = container_events(run_id, {"created", "running", "exited"})
    assert [event.event for event in events] == [f"prefect.docker.container.{status}"
                                                 for status in ("created", "running", "exited")]
    # One container, each event following the last, related to the run, its deployment, flow, pool and worker.
    assert len({event.resource.id for event in events}) == 1
    assert events[0].resource.id.startswith("prefect.docker.container.")
    assert events[0].resource.get("prefect.resource.name")
    assert [event.follows for event in events[1:]] == [event.id for event in events[:-1]]
    for event in events:
        related = {resource.role: resource.id for resource in event.related}
        assert related["flow-run"] == f"prefect.flow-run.{run_id}"
        assert related["deployment"] == f"prefect.deployment.{contender.deployment}"
        assert {"flow", "work-pool", "worker"} <= set(related)
        assert related["worker"].startswith(f"prefect.worker.{kind}.")


@pytest.mark.parametrize("kind", KINDS)
def test_a_docker_error_reaches_the_runs_state_and_message(kind, prefect_server, job_image, tmp_path, pool):
    """The engine's own error, not only the log: Crashed with it (stock), or NotStarted quoting it (e31)."""
    missing = "e31-conformance/never-built:1"
    contender = Contender(kind, tmp_path / kind, pool, job_image, {"image": missing, "image_pull_policy": "Never"})
    run_id = contender.run_once()
    state = read_run(run_id).state
    assert state.name == {"docker": "Crashed", "e31": "NotStarted"}[kind], state
    assert f"No such image: {missing}" in state.message


@pytest.mark.parametrize("kind", KINDS)
def test_settings_e31_would_override_are_refused_by_name_not_replaced(kind, prefect_server, job_image, tmp_path,
                                                                      pool):
    """An explicit API URL, device list, host network or run label is honoured by the stock worker; e31 sets
    its own for isolation, so it refuses each by name before renting instead of replacing it without a word."""
    api = os.environ["PREFECT_API_URL"]
    contender = Contender(kind, tmp_path / kind, pool, job_image, {
        "network_mode": "host", "env": {"PREFECT_API_URL": api, "CUDA_VISIBLE_DEVICES": "0,1,2,3",
                                        "CONFORMANCE": "kept"},
        "labels": {"prefect.io/flow-run-id": "another-run", "team": "vision"}})
    run_id = contender.run_once()
    state = read_run(run_id).state
    if kind == "docker":
        assert state.is_completed(), state
        assert contender.seen()["env"] == "kept"
        return
    assert state.name == "InvalidJob", state
    for named in (f"env.PREFECT_API_URL = '{api}': e31 sets it", "env.CUDA_VISIBLE_DEVICES = '0,1,2,3': e31 sets it",
                  "network_mode = 'host': would put the job on the host's network",
                  "labels.prefect.io/flow-run-id = 'another-run': Prefect and e31 label a run's container"):
        assert named in state.message, state.message
    assert "CONFORMANCE" not in state.message and "vision" not in state.message  # the team's own are the team's
    assert "e31:billed-s=0" in read_run(run_id).tags


@pytest.mark.parametrize("kind", KINDS)
def test_any_deployment_and_flow_run_name_prefect_accepts_runs(kind, prefect_server, job_image, tmp_path, pool):
    contender = Contender(kind, tmp_path / kind, pool, job_image, {}, deployment_name="My Deployment 1")
    run_id = contender.run_once(name="nightly run / ../ #1 ünï")
    assert read_run(run_id).state.is_completed(), read_run(run_id).state
    assert read_run(run_id).name == "nightly run / ../ #1 ünï"


def worker_of(kind: str, contender: Contender) -> Any:
    """The worker class of ``kind`` for the contender's pool, in this process."""
    from prefect.workers.base import BaseWorker

    from e31_prefect.host.settings import E31Settings

    extra = {"settings": E31Settings(home=contender.home)} if kind == "e31" else {}
    return BaseWorker.get_worker_class_from_type(kind)(work_pool_name=contender.pool, **extra)


@pytest.mark.parametrize("kind", KINDS)
def test_a_run_still_being_submitted_is_listed_again_and_not_submitted_twice(
        kind, prefect_server, job_image, tmp_path, pool):
    contender = Contender(kind, tmp_path / kind, pool, job_image, {})
    run_id = contender.submit()

    async def poll_while_submitting() -> list[UUID]:
        async with worker_of(kind, contender) as worker:
            await worker.sync_with_backend()
            worker._submitting_flow_run_ids.add(run_id)  # as while its first submission is under way
            try:
                return [run.id for run in await worker.get_and_submit_flow_runs()]
            finally:
                worker._submitting_flow_run_ids.discard(run_id)

    assert asyncio.run(poll_while_submitting()) == [run_id]
    assert read_run(run_id).state.is_scheduled(), read_run(run_id).state  # this poll submitted nothing


@pytest.mark.parametrize("kind", KINDS)
def test_initiate_run_returns_once_started_and_the_run_lives_on(kind, prefect_server, job_image, tmp_path, pool):
    """Prefect's `_initiate_run` (its non-blocking submission): on e31 the run lives e31's whole life."""
    contender = Contender(kind, tmp_path / kind, pool, job_image, {})
    run_id = contender.submit(sleep=3)

    async def initiate() -> None:
        async with worker_of(kind, contender) as worker:
            await worker.sync_with_backend()
            flow_run = await worker.client.read_flow_run(run_id)
            configuration = await worker.job_configuration.resolve_for_flow_run(
                flow_run, client=worker.client, work_pool=worker.work_pool, worker_name=worker.name)
            await worker._initiate_run(flow_run, configuration)
            assert not (await worker.client.read_flow_run(run_id)).state.is_final()  # it returned at the start
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and not (await worker.client.read_flow_run(run_id)).state.is_final():
                await asyncio.sleep(0.5)

    asyncio.run(initiate())
    run = read_run(run_id)
    assert run.state.is_completed(), run.state
    if kind == "e31":
        assert any(tag.startswith("e31:billed-s=") for tag in run.tags), run.tags  # metered and released
        assert (contender.folder / "out" / "seen.json").exists()  # its outputs sent


def test_a_container_left_by_a_dead_supervisor_is_found_by_prefect_dockers_run_label(job_image, tmp_path):
    """prefect-docker labels a run's container io.prefect.flow-run-id: what e31 looks for when a run's
    supervisor died and its container must go (a label that never matches leaves it running unbounded)."""
    from uuid import uuid4

    from e31_prefect.host.ledger import Holding, Ledger
    from e31_prefect.surface.life_adoption import _stop_leftovers

    run_id = str(uuid4())
    subprocess.run(["docker", "run", "-d", "--network", "none", "--label", f"{RUN_LABEL}={run_id}", job_image,
                    "sleep", "600"], check=True, capture_output=True)
    folder = Ledger(tmp_path / "ledger").folder(run_id)
    folder.write_holding(Holding(flow_run_id=run_id, worker_pid=1, worker_started="0", job_name="left",
                                 devices=[], workspace=str(tmp_path / "workspace"), runtime="container"))
    try:
        _stop_leftovers(folder)
        listed = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={RUN_LABEL}={run_id}"],
                                capture_output=True, text=True, check=True)
        assert listed.stdout.split() == [], "the container a dead supervisor left still runs"
    finally:
        subprocess.run(f"docker ps -aq --filter label={RUN_LABEL}={run_id} | xargs -r docker rm -f", shell=True,
                       capture_output=True)


@pytest.mark.parametrize("kind", KINDS)
def test_a_run_deleted_while_it_runs_lets_its_worker_go_on(kind, prefect_server, job_image, tmp_path, pool):
    """`prefect flow-run delete` (or the UI's delete) while a worker runs the run: the worker goes on and
    leaves nothing running. e31 stops the work (it would hold its GPUs to its time limit, billed to nobody)
    and forgets the run at once, saying why, instead of retrying a 404 and keeping it in its ledger."""
    contender = Contender(kind, tmp_path / kind, pool, job_image, {})
    # The stock worker leaves a deleted run's container to run to its end: give it a short one.
    run_id = contender.submit(sleep={"docker": 20, "e31": 600}[kind])
    worker = contender.worker("--run-once", E31_WATCH_SECONDS="1")
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not read_run(run_id).state.is_running():
            time.sleep(0.5)
        assert read_run(run_id).state.is_running(), read_run(run_id).state
        with get_client(sync_client=True) as client:
            client.delete_flow_run(run_id)
        assert worker.wait(timeout=240) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=60)
    running = subprocess.run(["docker", "ps", "-q", "--filter", f"label={RUN_LABEL}={run_id}"],
                             capture_output=True, text=True, check=True)
    assert running.stdout.split() == [], "the deleted run's container still runs"
    if kind == "e31":
        log = "\n".join(path.read_text(errors="replace") for path in contender.folder.glob("worker-*.log"))
        assert "the flow run is gone from Prefect (deleted while this worker had it)" in log, log[-3000:]
        assert "could not be recorded in Prefect (None)" not in log
        # Nothing left for the next worker on this host to adopt, and no workspace.
        assert not (contender.home / "ledger" / str(run_id)).exists()
        assert not (contender.home / "workspaces" / str(run_id)).exists()
