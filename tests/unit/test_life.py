"""The life of a job, step by step, without a Prefect server: every ending of every step.

A fake worker stands for the E31Worker (its client answers from memory, its report records what
it would tell Prefect); the inventory, ledger, staging and supervisor are the real ones, on
temporary folders. Each test says what a user would see: the run's ending, what stays held,
what the meter bills.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from uuid import UUID, uuid4

import anyio
import httpx
import pytest
from prefect.exceptions import PrefectHTTPStatusError
from prefect.states import Completed, Failed, Running

from e31_prefect.host.inventory import Device, Inventory
from e31_prefect.host.ledger import Ledger, Record, Spec, process_running
from e31_prefect.host.settings import E31Settings
from e31_prefect.model import endings
from e31_prefect.model.job import Job, parse_job
from e31_prefect.model.job_values import JobError
from e31_prefect.runtimes import Placement
from e31_prefect.surface.life import JobLife
from e31_prefect.surface.life_terms import Ends, judge
from e31_prefect.surface.run_states import RunStates

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the worker's own loop


class FakeClient:
    """Prefect's client as a life uses it, answering from memory."""

    def __init__(self, quota: str = "free"):
        self.state: Any = Running()
        self.states: list[Any] = []
        self.quota = quota  # free | full | never
        self.leases: dict[UUID, int] = {}
        self.released: list[UUID] = []
        self.reads: list[Any] = []  # each read of the run, as answered

    async def read_flow_run(self, flow_run_id: UUID) -> Any:
        self.reads.append(SimpleNamespace(id=flow_run_id, state=self.state, tags=[]))
        return self.reads[-1]

    async def set_flow_run_state(self, flow_run_id: UUID, state: Any, force: bool = False) -> Any:
        self.state = state
        self.states.append(state)

    async def increment_concurrency_slots_with_lease(self, names, slots, mode, lease_duration, holder) -> Any:
        if self.quota != "free":
            code = 423 if self.quota == "full" else 422
            request = httpx.Request("POST", "http://prefect/leases")
            raise PrefectHTTPStatusError(f"{code}", request=request, response=httpx.Response(code, request=request))
        lease = uuid4()
        self.leases[lease] = slots
        return httpx.Response(200, json={"lease_id": str(lease)})

    async def renew_concurrency_lease(self, lease_id: UUID, lease_duration: float) -> None:
        return None

    async def release_concurrency_slots_with_lease(self, lease_id: UUID) -> None:
        self.released.append(lease_id)
        self.leases.pop(lease_id, None)

    async def create_artifact(self, artifact: Any) -> None:
        return None


class FakeReport:
    """What a life tells Prefect, recorded."""

    def __init__(self, client: FakeClient, fail_closing: bool = False):
        self.client = client
        self.steps: list[str] = []
        self.closed: list[tuple[Any, str | None, str | None]] = []
        self.closed_with: list[Any] = []  # the read of the run each close was given
        self.fail_closing = fail_closing

    def step(self, step: str, held: Any = (), **payload: Any) -> None:
        self.steps.append(step)

    async def end(self, ending: endings.Ending) -> Any:
        await self.client.set_flow_run_state(UUID(int=0), ending)
        return ending

    async def close(self, meter: Any, job_name: str, outcome: str | None, outputs: str | None,
                    current: Any = None) -> None:
        if self.fail_closing:
            raise httpx.ConnectError("the Prefect API is down")
        self.closed.append((meter, outcome, outputs))
        self.closed_with.append(current)


class FakeWorker:
    """The parts of an E31Worker a life uses."""

    name = "fake-worker"
    _work_pool_name = "gpu"
    _only_flow_run_ids = None
    at_keyboard = False

    def __init__(self, tmp_path: Path, gpus: int = 2, quota: str = "free"):
        self.settings = E31Settings(home=tmp_path / "e31", device_locks=tmp_path / "locks", stop_grace_seconds=1,
                                    watch_seconds=0.2, cache_bytes=0, file_roots={"*": [tmp_path]})
        self.inventory = Inventory([Device(i, "H100") for i in range(gpus)], self.settings.device_locks)
        self.ledger = Ledger(self.settings.home / "ledger")
        self.client = FakeClient(quota)
        self.meters: dict[UUID, Any] = {}
        self.holds_until: dict[UUID, datetime] = {}
        self.admitted_latest: dict[UUID, datetime] = {}  # runs a poll took on a predicted length
        self.run_states = RunStates(self._read_states, lambda: [], self.settings.watch_seconds)
        self.taken_states: dict[UUID, str] = {}
        self.failed_devices: dict[int, Any] = {}
        self.cut_off = False  # whether this worker's heartbeats stopped reaching the API (the pool may requeue)
        self.requeued = False  # whether the pool requeued the run meanwhile
        self.lost: list[Any] = []

    def maybe_superseded(self, since: float) -> bool:
        return self.cut_off

    async def superseded(self, run_id: UUID, taken: str | None) -> bool:
        return self.requeued

    async def lose_attempt(self, run_id: UUID, loss: Any) -> Any:
        self.lost.append(loss)
        return endings.HOST_LOST

    def rented(self, run_id: UUID, at: datetime) -> None:
        pass

    async def _read_states(self, ids: list[UUID]) -> dict[UUID, Any]:
        return {run_id: (await self.client.read_flow_run(run_id)).state for run_id in ids}

    def get_flow_run_logger(self, flow_run: Any) -> logging.Logger:
        return logging.getLogger("e31.test")

    def _event_related_resources(self, configuration: Any = None) -> list:
        return []

    def return_devices(self, flow_run_id: UUID) -> None:
        self.inventory.give_back(flow_run_id)
        self.holds_until.pop(flow_run_id, None)


class FakeConfiguration:
    """A run's job configuration: job variables that may or may not make a valid job."""

    def __init__(self, job: dict[str, Any]):
        self.raw = job
        self.env: dict[str, str] = {}
        self._job_name = job.get("name", "job")
        self._job_folder = None

    def job(self) -> Job:
        return parse_job(self.raw)

    def setting_problems(self, allowed_volumes: list[Path]) -> list:
        return []


def job_dict(tmp_path: Path, **request: Any) -> dict[str, Any]:
    return {"name": "train", "team": "vision", "work": {"command": ["true"]},
            "request": {"gpus": 1, "max_duration": "1h", **request},
            "output": {"to": f"file://{tmp_path}/sent/", "expect": []}}


def life_for(tmp_path: Path, job: dict[str, Any] | None = None, **worker: Any) -> JobLife:
    fake = FakeWorker(tmp_path, **worker)
    created = datetime.now(timezone.utc)  # read as each test runs: none depends on when the suite started
    flow_run = SimpleNamespace(id=uuid4(), name="brave-otter", expected_start_time=created,
                               next_scheduled_start_time=None, created=created, work_queue_name="default")
    life = JobLife(fake, flow_run, FakeConfiguration(job or job_dict(tmp_path)))  # type: ignore[arg-type]
    life.report = FakeReport(fake.client)  # type: ignore[assignment]
    return life


# What e31's job entry does first: say it is ready, then wait to be handed its devices (e31_prefect.job_entry).
GATE = ("import os\nfrom e31_prefect import job_entry\njob_entry._pipe.append(os.environ['E31_WORK_ENDED'])\n"
        "job_entry.wait_for_hand_over(os.environ['E31_HAND_OVER'])\n")


class CommandRuntime:
    """A runtime whose work is a plain command after e31's gate, run by the real supervisor."""

    name = "process"
    died = endings.PROCESS_DIED
    loads_before_rent = True

    def __init__(self, code: str, problem: str | None = None, before_gate: str = ""):
        self.code = code
        self.problem = problem
        self.before_gate = before_gate  # what the process does before it says it is ready (loading Prefect)

    async def check(self) -> str | None:
        return self.problem

    def spec(self, placement: Placement) -> Spec:
        return placement.spec(self.name, argv=[sys.executable, "-c", self.before_gate + GATE + self.code],
                              env={"PATH": os.environ["PATH"], "OUT": str(placement.output_dir),
                                   "E31_WORK_ENDED": str(placement.folder.work_ended_pipe),
                                   "E31_HAND_OVER": str(placement.folder.hand_over_pipe)},
                              cwd=str(placement.workspace))

    async def start(self, placement: Placement, supervisor: Any) -> None:
        return None

    def ended(self) -> None:
        return None


def ending_of(step) -> endings.Ending:
    with pytest.raises(Ends) as ended:
        step()
    return ended.value.ending


async def ending_of_async(step) -> endings.Ending:
    with pytest.raises(Ends) as ended:
        await step()
    return ended.value.ending


# -- admit ------------------------------------------------------------------------------------


def test_admit_takes_a_valid_job_that_can_meet_its_deadline(tmp_path):
    job = life_for(tmp_path).admit()
    assert job.name == "train" and job.request.gpus == 1


def test_admit_refuses_an_invalid_job_with_its_problems(tmp_path):
    life = life_for(tmp_path, {"name": "train", "work": {"command": ["true"]}, "request": {"gpus": -1}})
    ending = ending_of(life.admit)
    assert ending.is_(endings.INVALID_JOB) and not ending.billed
    assert ending.message == ("The job is not valid:\n"
                              "request.gpus = -1: must be 0 or more; use gpus: 0 for a CPU-only job")


def test_admit_refuses_a_run_past_its_latest_start(tmp_path):
    now = datetime.now(timezone.utc)
    life = life_for(tmp_path, job_dict(tmp_path, deadline=(now + timedelta(minutes=30)).isoformat()))
    ending = ending_of(life.admit)
    assert ending.is_(endings.DEADLINE_MISSED) and "No GPU was rented" in ending.message
    assert life.report.steps == ["deadline-missed"]


def test_admit_takes_a_run_the_poll_took_on_its_predicted_length(tmp_path):
    # Past its latest start by its limit, not by what its deployment's runs take: the poll's judgement stands.
    now = datetime.now(timezone.utc)
    life = life_for(tmp_path, job_dict(tmp_path, deadline=(now + timedelta(minutes=30)).isoformat()))
    life.worker.admitted_latest[life.run_id] = now + timedelta(minutes=20)
    assert life.admit().name
    assert life.report.steps == []


def test_a_container_job_whose_code_folder_holds_the_workers_home_is_refused_saying_how(tmp_path):
    job = job_dict(tmp_path)
    job["work"] = {"image": "python:3.11-slim", "command": ["true"]}
    life = life_for(tmp_path, job)
    life.configuration.code_mount = lambda: tmp_path  # the worker's E31_HOME is tmp_path/e31
    ending = ending_of(life.admit)
    assert ending.is_(endings.INVALID_JOB) and "holds this worker's E31_HOME" in ending.message
    life.configuration.code_mount = lambda: tmp_path / "elsewhere"
    assert life.admit().work.image == "python:3.11-slim"


async def test_check_refuses_a_host_that_cannot_run_the_job(tmp_path):
    life = life_for(tmp_path, job_dict(tmp_path) | {"work": {"command": ["true"], "image": "acme/x:1"}})
    job = life.admit()
    ending = await ending_of_async(lambda: life.check(job, CommandRuntime("", problem="no engine answers")))
    assert ending.is_(endings.NO_CONTAINER_ENGINE) and "'acme/x:1'" in ending.message


# -- stage ------------------------------------------------------------------------------------


async def test_stage_copies_the_data_read_only_before_anything_is_rented(tmp_path):
    (tmp_path / "train.csv").write_text("a,b\n1,2\n")
    life = life_for(tmp_path, job_dict(tmp_path) | {"data": [{"from": f"file://{tmp_path}/train.csv"}]})
    await life.stage(life.admit())
    staged = life.workspace / "data" / "train.csv"
    assert staged.read_text() == "a,b\n1,2\n" and not os.access(staged, os.W_OK) or os.geteuid() == 0
    assert "staged" in life.meter.marks and "rented" not in life.meter.marks
    assert life.worker.inventory.free() == life.worker.inventory.devices


async def test_stage_fails_a_missing_input_before_renting(tmp_path):
    life = life_for(tmp_path, job_dict(tmp_path) | {"data": [{"from": f"file://{tmp_path}/nothing.csv"}]})
    job = life.admit()
    ending = await ending_of_async(lambda: life.stage(job))
    assert ending.is_(endings.STAGING_FAILED) and "nothing.csv" in ending.message and not ending.billed


# -- rent -------------------------------------------------------------------------------------


async def rent_and(life: JobLife, inside=None):
    job = life.admit()
    async with life.rent(job, CommandRuntime("")) as rental:
        if inside:
            await inside(rental)
        return rental


async def test_rent_holds_devices_and_slots_writes_the_ledger_and_gives_them_all_back(tmp_path):
    life = life_for(tmp_path)
    seen: dict[str, Any] = {}

    async def inside(placement: Placement) -> None:
        seen["free"] = life.worker.inventory.free()
        seen["holding"] = life.folder.holding()
        seen["leases"] = dict(life.worker.client.leases)

    rental = await rent_and(life, inside)
    assert rental.devices == [Device(0, "H100")]
    assert seen["free"] == [Device(1, "H100")]
    assert seen["holding"].devices == [0] and seen["holding"].job["name"] == "train"
    assert list(seen["leases"].values()) == [1]
    assert life.worker.inventory.free() == life.worker.inventory.devices
    assert life.worker.client.leases == {}, "the quota slots went back with the devices"
    assert "rented" not in life.meter.marks, "the meter starts at the hand-over, not when the devices are held"


async def test_rent_hands_the_run_back_when_no_device_is_free(tmp_path):
    life = life_for(tmp_path, job_dict(tmp_path, gpus=3))
    ending = await ending_of_async(lambda: rent_and(life))
    assert ending.handed_back and "No 3 free GPU(s)" in ending.message
    assert life.folder.holding() is None and "rented" not in life.meter.marks


async def test_a_ready_run_whose_planned_device_was_rented_meanwhile_rents_what_is_free_or_goes_back(tmp_path):
    life = life_for(tmp_path)  # two GPUs
    life.worker.inventory.plan(life.run_id, [Device(0, "H100")], seconds=60)
    assert life.worker.inventory.hold(uuid4(), [Device(0, "H100")])  # another run's, while this one loaded
    assert (await rent_and(life)).devices == [Device(1, "H100")]
    alone = life_for(tmp_path / "one", gpus=1)
    alone.worker.inventory.plan(alone.run_id, [Device(0, "H100")], seconds=60)
    assert alone.worker.inventory.hold(uuid4(), [Device(0, "H100")])
    ending = await ending_of_async(lambda: rent_and(alone))
    assert ending.handed_back and not ending.billed
    assert "when its work was ready" in ending.message and "nothing was billed" in ending.message
    assert alone.folder.holding() is None and "rented" not in alone.meter.marks


async def test_rent_hands_the_run_back_for_later_when_its_quota_is_full(tmp_path):
    life = life_for(tmp_path, quota="full")
    ending = await ending_of_async(lambda: rent_and(life))
    assert ending.handed_back and ending.retry_in_seconds == 15 and "Quota full" in ending.message
    assert life.worker.inventory.free() == life.worker.inventory.devices, "the devices went back"


async def test_rent_refuses_a_run_its_quota_can_never_hold(tmp_path):
    life = life_for(tmp_path, quota="never")
    ending = await ending_of_async(lambda: rent_and(life))
    assert ending.is_(endings.OVER_QUOTA) and not ending.billed
    assert life.worker.inventory.free() == life.worker.inventory.devices


async def test_a_worker_stopping_while_rented_keeps_the_lease_for_the_adopter(tmp_path):
    life = life_for(tmp_path)

    async def stopped(rental: Any) -> None:
        raise anyio.get_cancelled_exc_class()()

    with pytest.raises(anyio.get_cancelled_exc_class()):
        await rent_and(life, stopped)
    assert len(life.worker.client.leases) == 1 and life.worker.client.released == []
    assert life.folder.holding() is not None, "the ledger keeps the run for the next worker"


async def test_an_adoption_that_meets_the_api_down_leaves_the_run_for_the_next_sweep(tmp_path):
    life = life_for(tmp_path)

    async def stopped(rental: Any) -> None:
        raise anyio.get_cancelled_exc_class()()

    with pytest.raises(anyio.get_cancelled_exc_class()):
        await rent_and(life, stopped)
    life._let_go()  # its worker is gone
    worker = life.worker
    [(folder, owner)] = worker.ledger.claim_orphans()

    async def down(flow_run_id: UUID) -> Any:
        raise httpx.ConnectError("the Prefect server restarts")

    worker.client.read_flow_run = down
    with pytest.raises(httpx.ConnectError):
        await JobLife.adopt(worker, folder, owner)
    assert [f.run_id for f, _ in worker.ledger.claim_orphans()] == [folder.run_id], \
        "the failed adoption kept the run's lock: no sweep adopts it again, its meter is never closed"


# -- run --------------------------------------------------------------------------------------


def staged(life: JobLife) -> Job:
    """The admitted job, its run taken (its ledger folder) and its workspace made, as before the run step."""
    life._take()
    (life.workspace / "output").mkdir(parents=True, exist_ok=True)
    return life.admit()


async def run_work(life: JobLife, code: str, before_gate: str = "") -> Record:
    """The run step as the life takes it: prepare the work, rent, hand over, watch until it ends."""
    job = staged(life)
    runtime = CommandRuntime(code, before_gate=before_gate)
    async with life.prepare(job, runtime, []) as supervisor, life.rent(job, runtime) as rental:
        await life.hand_over(job, supervisor, rental)
        async with life.watching(supervisor):
            record = await supervisor.wait()
    return record


async def test_run_starts_the_work_under_its_supervisor_and_records_its_end(tmp_path):
    life = life_for(tmp_path)
    record = await run_work(life, "import os; open(os.environ['OUT'] + '/x.txt', 'w').write('x')")
    assert record.ending == "exited" and record.exit_code == 0
    assert (life.workspace / "output" / "x.txt").read_text() == "x"
    assert life.infrastructure == record.infrastructure and "running" in life.meter.marks
    assert life.worker.inventory.free() == life.worker.inventory.devices


async def test_the_work_loads_before_the_rent_and_the_meter_starts_at_the_hand_over(tmp_path):
    life = life_for(tmp_path)
    loading = "import time; time.sleep(1.5)\n"  # as Prefect's import, before the entry says it is ready
    record = await run_work(life, "import os; open(os.environ['OUT'] + '/devices', 'w').write("
                                  "os.environ['CUDA_VISIBLE_DEVICES'])", before_gate=loading)
    assert record.ending == "exited" and record.exit_code == 0
    assert (life.workspace / "output" / "devices").read_text() == "0", "its code sees the device it was handed"
    marks = life.meter.marks
    assert marks["ready"] <= marks["rented"] <= marks["running"], "rented once the work was ready, not before"
    assert life.meter.billed_seconds < 1.5, "the load before the hand-over was billed"


async def test_no_device_is_held_while_the_work_loads(tmp_path):
    life = life_for(tmp_path)
    job = staged(life)
    async with life.prepare(job, CommandRuntime("pass", before_gate="import time; time.sleep(1)\n"), []):
        assert life.worker.inventory.free() == life.worker.inventory.devices
        assert life.folder.record().ready is not None
    assert life.folder.record().ending == "not-started", "left before its hand-over, the work ended"


async def test_a_process_that_dies_while_waiting_is_handed_nothing_and_billed_nothing(tmp_path):
    life = life_for(tmp_path)
    job = staged(life)
    ending = await ending_of_async(lambda: life.prepare(job, CommandRuntime(
        "pass", before_gate="raise SystemExit(3)\n"), []).__aenter__())
    assert ending.is_(endings.NOT_STARTED) and "exit code 3" in ending.message
    assert "rented" not in life.meter.marks and life.worker.client.leases == {}
    assert life.worker.inventory.free() == life.worker.inventory.devices


async def test_a_worker_that_goes_before_the_hand_over_leaves_no_work_running(tmp_path):
    life = life_for(tmp_path)
    job = staged(life)
    async with life.prepare(job, CommandRuntime("import time; time.sleep(600)"), []) as supervisor:
        pid = int(life.folder.record().infrastructure)
        supervisor.stop()  # a cancel as it waits: nothing of the job ran, nothing is billed
        record = await supervisor.wait()
    assert record.ending == "not-started" and "cancelled" in record.message and record.started is None
    assert not process_running(pid)
    life2 = life_for(tmp_path / "2")
    async with life2.prepare(staged(life2), CommandRuntime("import time; time.sleep(600)"), []):
        pid = int(life2.folder.record().infrastructure)
    record = life2.folder.record()  # the worker let it go (it stopped, or could not rent)
    assert record.ending == "not-started" and "no devices" in record.message and not process_running(pid)


async def test_a_cancel_requested_in_prefect_stops_the_work(tmp_path):
    life = life_for(tmp_path)
    life.worker.client.state = SimpleNamespace(is_cancelling=lambda: True, is_final=lambda: False)
    record = await run_work(life, "import time; time.sleep(600)")
    assert record.ending == "stopped"


# -- attempts -----------------------------------------------------------------------------------

async def test_a_run_requeued_while_its_worker_was_cut_off_reports_nothing_and_keeps_its_outputs(tmp_path):
    """The pool requeued the run while this worker's heartbeats did not reach it: the run is another
    attempt's now. What this one wrote stays in the spool, and nothing of it reaches Prefect."""
    life = life_for(tmp_path)
    life.taken, life.attempt = "the-take", 1
    record = await run_work(life, "import os; open(os.environ['OUT'] + '/x.txt', 'w').write('x')")
    life.worker.cut_off = life.worker.requeued = True  # as it ran
    assert not await life.still_ours()
    ending = life.stand_down()
    await life._set_state(endings.PROCESS_DIED.saying("anything"))
    await life.release(ending)
    assert record.ending == "exited"
    assert life.worker.client.states == [] and life.report.closed == [], "a superseded attempt said something"
    kept = life.worker.settings.spool / "superseded" / f"{life.run_id}-attempt-1" / "outputs" / "x.txt"
    assert kept.read_text() == "x"
    assert not life.folder.path.exists() and not life.workspace.exists()


async def test_a_worker_cut_off_as_its_run_loaded_rents_nothing_for_a_run_requeued_meanwhile(tmp_path):
    life = life_for(tmp_path)
    life.taken = "the-take"
    job = staged(life)
    runtime = CommandRuntime("pass")
    life.worker.cut_off = life.worker.requeued = True
    ending = await ending_of_async(lambda: life.rent(job, runtime).__aenter__())
    assert ending is endings.SUPERSEDED and life.worker.client.leases == {}
    assert life.worker.inventory.free() == life.worker.inventory.devices


async def test_a_worker_never_cut_off_reads_no_history(tmp_path):
    life = life_for(tmp_path)
    life.taken = "the-take"
    life.worker.requeued = True  # it would say so, were it asked
    assert await life.still_ours(), "a worker whose heartbeats all arrived was judged by its run's history"


async def test_a_fenced_attempt_is_ended_by_its_own_host_as_a_lost_one(tmp_path):
    life = life_for(tmp_path)
    life.taken = "the-take"
    record = await run_work(life, "import os; open(os.environ['OUT'] + '/x.txt', 'w').write('x')")
    record.ending = "fenced"  # as its supervisor records a work its fence stopped
    ending = await life.lost_here(record)
    assert ending is endings.SUPERSEDED and [loss.kind for loss in life.worker.lost] == ["HostLost"]
    assert "cut off from the Prefect API" in life.worker.lost[0].why
    await life.release(ending)
    assert life.report.closed == [], "the pool's end of the attempt closed its meter; this host closes none"


# -- judge ------------------------------------------------------------------------------------

JOB = parse_job({"name": "train", "work": {"command": ["true"]}, "request": {"max_duration": "1h", "memory": "2g"}})


@pytest.mark.parametrize(("record", "flow_state", "expected"), [
    (Record(ending="exited", exit_code=0), Completed(), None),
    (Record(ending="exited", exit_code=1), Failed(), None),
    (Record(ending="timed-out", stop_requested="2026-12-03T07:00:00+00:00"), Running(), endings.TIMED_OUT),
    (Record(ending="stopped"), Running(), endings.CANCELLED),
    (Record(ending="out-of-memory"), Running(), endings.OUT_OF_MEMORY),
    (Record(ending="not-started", message="no such image"), None, endings.NOT_STARTED),
    (Record(ending="exited", exit_code=-9), Running(), endings.PROCESS_DIED),
    (Record(ending="exited", exit_code=0, work_ended="2026-12-03T07:00:00+00:00", outcome="completed"), Running(),
     endings.REPORTED_BY_WORKER),
    (Record(ending="exited", exit_code=1, work_ended="2026-12-03T07:00:00+00:00", outcome="failed",
            unreported=True), Running(), endings.reported_by_worker("failed")),
    # A word no engine says, or a process killed after its word: no outcome is taken from it.
    (Record(ending="exited", exit_code=0, work_ended="2026-12-03T07:00:00+00:00", outcome=None), Running(),
     endings.PROCESS_DIED),
    (Record(ending="exited", exit_code=-9, work_ended="2026-12-03T07:00:00+00:00", outcome="completed"),
     Running(), endings.PROCESS_DIED),
    # Said its flow returned and went on: killed after its report grace, Failed whatever it reported.
    (Record(ending="kept-running", exit_code=-9, work_ended="2026-12-03T07:00:00+00:00", outcome="completed",
            stop_reason="report-overdue", stop_requested="2026-12-03T07:01:00+00:00"), Completed(),
     endings.KEPT_RUNNING),
    (None, Running(), endings.PROCESS_DIED),
    (Record(), Running(), endings.PROCESS_DIED),
])
def test_judge_names_every_way_the_work_can_end(record, flow_state, expected):
    ending = judge(record, flow_state, endings.PROCESS_DIED, JOB)
    if expected is None:
        assert ending is None, "the flow's own final state stands"
    else:
        assert ending is not None and ending.is_(expected) and ending.message


def test_judge_says_what_a_user_needs_to_act():
    assert "request.memory = 2g" in judge(Record(ending="out-of-memory"), None, endings.PROCESS_DIED, JOB).message
    died = judge(Record(ending="exited", exit_code=137), Running(), endings.CONTAINER_DIED, JOB)
    assert died.is_(endings.CONTAINER_DIED) and "container died with exit code 137" in died.message
    assert "no such image" in judge(Record(ending="not-started", message="no such image"), None,
                                    endings.CONTAINER_DIED, JOB).message
    told = judge(Record(ending="exited", exit_code=1), Running(), endings.PROCESS_DIED, JOB, "ImportError: torch")
    assert told.message.endswith("Its last output:\nImportError: torch")
    liar = judge(Record(ending="kept-running", work_ended="2026-12-03T07:00:00+00:00", outcome="completed",
                        stop_requested="2026-12-03T07:01:00+00:00"), Completed(), endings.PROCESS_DIED, JOB)
    assert liar.state.value == "FAILED" and "said its flow returned (completed)" in liar.message
    assert "killed at 2026-12-03T07:01:00+00:00" in liar.message
    failed = judge(Record(ending="exited", exit_code=1, work_ended="2026-12-03T07:00:00+00:00", outcome="failed"),
                   Running(), endings.PROCESS_DIED, JOB)
    assert failed.state.value == "FAILED" and failed.name == "Failed" and "e31 reports it" in failed.message


def test_the_tail_of_the_works_output_is_its_last_lines(tmp_path):
    from e31_prefect.host.ledger import output_tail

    log = tmp_path / "output.log"
    log.write_text("".join(f"line {n}\n" for n in range(10_000)))
    assert output_tail(log) == "\n".join(f"line {n}" for n in range(9_995, 10_000))
    assert output_tail(tmp_path / "missing.log") == ""


# -- send -------------------------------------------------------------------------------------


async def sent(life: JobLife, files: dict[str, str], state: Any = None) -> endings.Ending | None:
    job = life.admit()
    async with life.rent(job, CommandRuntime("")):
        pass
    output = life.workspace / "output"
    output.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (output / name).write_text(text)
    life.worker.client.state = state or Completed()
    return await life.send(job, life.worker.client.state)


async def test_send_puts_the_outputs_at_their_destination(tmp_path):
    life = life_for(tmp_path)
    assert await sent(life, {"model.json": "{}"}) is None
    assert (tmp_path / "sent" / "model.json").read_text() == "{}"
    assert "output" in life.meter.marks


async def test_send_fails_a_completed_run_missing_an_expected_output(tmp_path):
    life = life_for(tmp_path, job_dict(tmp_path) | {"output": {"to": f"file://{tmp_path}/sent/",
                                                                "expect": ["model.json", "metrics.json"]}})
    ending = await sent(life, {"model.json": "{}"})
    assert ending.is_(endings.OUTPUT_MISSING) and "metrics.json" in ending.message
    assert await sent(life_for(tmp_path, job_dict(tmp_path) | {"output": {
        "to": f"file://{tmp_path}/sent2/", "expect": ["metrics.json"]}}), {}, Failed()) is None, \
        "a run that failed on its own is not blamed for what it did not write"


async def test_send_keeps_outputs_the_store_refuses_in_the_spool(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the destination folder should be")
    life = life_for(tmp_path, job_dict(tmp_path) | {"output": {"to": f"file://{blocked}/run/"}})
    ending = await sent(life, {"model.json": "{}"})
    assert ending.is_(endings.OUTPUT_NOT_SENT) and "e31 outputs retry" in ending.message
    kept = life.worker.settings.spool / str(life.run_id) / "outputs" / "model.json"
    assert kept.read_text() == "{}"


# -- release ----------------------------------------------------------------------------------


async def test_release_closes_the_meter_and_forgets_the_run(tmp_path):
    life = life_for(tmp_path)
    await run_work(life, "pass")
    await life.release(None)
    [(meter, outcome, _)] = life.report.closed
    assert 0 < meter.billed_seconds < 30 and meter.gpus == 1 and outcome is None
    assert not life.folder.path.exists() and not life.workspace.exists()


async def test_a_run_handed_back_is_not_closed_and_leaves_nothing_behind(tmp_path):
    life = life_for(tmp_path, job_dict(tmp_path, gpus=3))
    life.workspace.mkdir(parents=True)
    await life.release(endings.HANDED_BACK.saying("No room"))
    assert life.report.closed == [] and not life.workspace.exists()


async def test_a_meter_prefect_cannot_record_stays_in_the_ledger_for_the_next_worker(tmp_path, monkeypatch):
    monkeypatch.setattr("e31_prefect.surface.life.CLOSE_RETRY_SECONDS", (0, 0))
    life = life_for(tmp_path)
    life.report.fail_closing = True
    await run_work(life, "pass")
    await life.release(None)
    holding = life.folder.holding()
    assert holding is not None and "released" in holding.marks and life.folder.record().finished


# -- the whole life ---------------------------------------------------------------------------


async def test_a_whole_life_refused_at_admission_sets_its_state_and_bills_nothing(tmp_path):
    life = life_for(tmp_path, {"name": "train", "work": {"command": ["true"]}, "request": {"max_duration": "nope"}})
    ending = await life.live()
    assert ending.is_(endings.INVALID_JOB)
    assert life.worker.client.states[-1].is_(endings.INVALID_JOB)
    [(meter, outcome, _)] = life.report.closed
    assert meter.billed_seconds == 0 and outcome == "invalid-job"


class RentFirstRuntime(CommandRuntime):
    """A runtime whose work is the job's code from its start (a container's image): created once rented."""

    loads_before_rent = False

    def __init__(self, code: str, seen: dict[str, Any]):
        super().__init__(code)
        self.seen = seen

    def spec(self, placement: Placement) -> Spec:
        self.seen["devices"] = placement.devices  # what it is created with
        return super().spec(placement)


async def test_work_given_its_devices_at_create_is_started_after_the_rent_and_billed_from_the_rent(
        tmp_path, monkeypatch):
    seen: dict[str, Any] = {}
    life = life_for(tmp_path)
    monkeypatch.setattr("e31_prefect.surface.life.runtime_for",
                        lambda *_: RentFirstRuntime("import time; time.sleep(0.2)", seen))
    life.worker.client.state = Completed()  # as the flow's engine reports it
    assert await life.live() is None  # the flow's own final state stands (the fake client says Completed)
    assert seen["devices"] == [Device(0, "H100")], "created with its rented device"
    [(meter, _, _)] = life.report.closed
    # The image's own code holds its devices from its start: the bill starts at the rent, before it is ready.
    assert meter.marks["rented"] <= meter.marks["ready"] <= meter.marks["running"]


async def test_a_life_reads_its_run_once_after_the_work_for_its_verdict_outputs_and_meter(tmp_path, monkeypatch):
    # Each read is a call to the Prefect server for every run of the pool: the verdict, the outputs' sending
    # (the result pointed at them) and the meter's tags go by the one read once the work ended.
    life = life_for(tmp_path)
    monkeypatch.setattr("e31_prefect.surface.life.runtime_for", lambda *_: CommandRuntime("pass"))
    life.worker.client.state = Completed()  # as the flow's engine reports it
    assert await life.live() is None
    [read] = life.worker.client.reads
    assert life.report.closed_with == [read]
    assert life.report.closed[0][2] is not None, "the outputs were sent"


def test_every_ending_has_its_own_name_and_tag():
    assert len({ending.tag for ending in endings.ALL}) == len(endings.ALL)
    # A run handed back bills nothing; an attempt lost with its host or GPU is billed to its last heartbeat.
    assert all(ending.billed is False for ending in endings.ALL if ending.state.value == "SCHEDULED"
               and ending not in (endings.HOST_LOST, endings.DEVICE_FAILED))


def test_invalid_job_error_type_is_a_job_error():
    with pytest.raises(JobError):
        FakeConfiguration({"name": "x"}).job()


def test_a_queue_of_a_team_meters_its_runs_to_that_team_and_refuses_a_job_claiming_another(tmp_path):
    life = life_for(tmp_path, {**job_dict(tmp_path), "team": None})
    life.worker.settings = life.worker.settings.model_copy(update={"queue_teams": {"default": "speech"}})
    assert life.admit().team == "speech"
    claiming = life_for(tmp_path, job_dict(tmp_path))  # the job says team vision
    claiming.worker.settings = life.worker.settings
    with pytest.raises(Ends) as ended:
        claiming.admit()
    assert ended.value.ending.is_(endings.INVALID_JOB)
    assert "work queue 'default', which is team 'speech'" in ended.value.ending.message


async def test_a_process_job_the_host_cannot_run_ends_before_renting_saying_why(tmp_path):
    life = life_for(tmp_path)
    problem = "a job's own user cannot read /opt/x"
    ending = await ending_of_async(lambda: life.check(life.admit(), CommandRuntime("", problem=problem)))
    assert ending.is_(endings.HOST_CANNOT_RUN) and not ending.billed
    assert "cannot read /opt/x" in ending.message


def test_admit_refuses_shards_for_a_deployment_running_a_flow_of_its_own(tmp_path):
    sharded = job_dict(tmp_path) | {"work": {"shards": 100}}
    life = life_for(tmp_path, sharded)
    life.configuration.entrypoint = "flows/train.py:train"  # type: ignore[union-attr]
    ending = ending_of(life.admit)
    assert ending.is_(endings.INVALID_JOB) and not ending.billed
    assert ("work.shards = 100: this deployment runs the flow flows/train.py:train itself, which would run once; "
            "deploy it with entrypoint e31_prefect.flow_shards.run_flow_shards") in ending.message
    for builtin in ("e31_prefect.command_flow.run_command", "e31_prefect.flow_shards.run_flow_shards"):
        life = life_for(tmp_path, sharded)
        life.configuration.entrypoint = builtin  # type: ignore[union-attr]
        assert life.admit().work.shards == 100


def test_admit_refuses_e31s_flow_shards_for_a_job_without_shards(tmp_path):
    life = life_for(tmp_path)
    life.configuration.entrypoint = "e31_prefect.flow_shards.run_flow_shards"  # type: ignore[union-attr]
    ending = ending_of(life.admit)
    assert ending.is_(endings.INVALID_JOB) and not ending.billed
    assert "work.shards: not set, and this deployment runs e31's flow shards" in ending.message
