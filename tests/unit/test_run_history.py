"""Unit tests for what the worker keeps of its deployments' recent runs (e31_prefect.planning.run_history), the pool's
plan artifact rows (e31_prefect.surface.plan_artifact) and what ``e31 submit`` / ``e31 queue`` say of a run's length."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta, timezone
from uuid import uuid4

from e31_prefect.cli.forecast import length_line, rows
from e31_prefect.host.inventory import Device
from e31_prefect.planning.run_history import RunHistory
from e31_prefect.planning.scheduling import Busy, WaitingRun, plan
from e31_prefect.surface.plan_artifact import MAX_ROWS, PlanWriter, key, table

NOW = datetime(2026, 12, 3, 22, 0, tzinfo=timezone.utc)
TWO_HOURS = timedelta(hours=2)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_run_learns_only_from_its_own_teams_runs_of_a_deployment():
    # `e31 submit` deploys a job under its name: two teams' jobs named "train" share a deployment.
    history, deployment = RunHistory(runs=20), uuid4()
    history.keep(deployment, [("vision", 700.0)] * 10 + [("audio", 1.0)] * 30 + [(None, 50_000.0)] * 5)
    vision, _ = history.predict(deployment, "vision", TWO_HOURS)
    audio, _ = history.predict(deployment, "audio", TWO_HOURS)
    nobody, _ = history.predict(deployment, None, TWO_HOURS)
    assert vision.duration == timedelta(seconds=700) and vision.runs == 10
    assert audio.duration == timedelta(seconds=1) and audio.runs == 20  # the last 20 only
    assert nobody.duration == TWO_HOURS and nobody.runs == 5  # capped: past runs took more than this limit
    assert history.predict(uuid4(), "vision", TWO_HOURS)[0].duration == TWO_HOURS  # another deployment: no history


def test_junk_times_in_a_record_never_plan_below_zero_or_past_the_limit():
    history, deployment = RunHistory(), uuid4()
    history.keep(deployment, [("t", value) for value in (0.0, -3600.0, float("nan"), float("inf"), 1e12, -1e-9)])
    prediction, seen = history.predict(deployment, "t", TWO_HOURS)
    assert prediction.duration == TWO_HOURS and seen == 0
    assert prediction.basis(seen).startswith("planned by its 2 h limit (no past runs")


def test_a_record_is_read_again_only_when_stale_and_a_change_is_seen_only_when_it_changed():
    clock = Clock()
    history, deployment = RunHistory(refresh_seconds=60, clock=clock), uuid4()
    assert history.stale([deployment, None]) == [deployment]
    history.keep(deployment, [("t", 600.0)] * 3)
    generation, version = history.generation, history.version(deployment)
    clock.now = 59
    assert history.stale([deployment]) == []
    clock.now = 60
    assert history.stale([deployment]) == [deployment]
    history.keep(deployment, [("t", 600.0)] * 3)  # read again, the same
    assert (history.generation, history.version(deployment)) == (generation, version)
    history.keep(deployment, [("t", 660.0)] + [("t", 600.0)] * 3)
    assert history.generation == generation + 1 and history.version(deployment) != version


def test_a_history_of_zero_runs_plans_every_run_by_its_limit():
    history, deployment = RunHistory(runs=0), uuid4()
    history.keep(deployment, [("t", 600.0)] * 30)
    assert history.predict(deployment, "t", TWO_HOURS)[0].duration == TWO_HOURS


def _learned(id: str, *, latest: timedelta | None, basis: str = "your last 20 runs took 12-14 min of a 2 h limit",
             ) -> WaitingRun:
    return WaitingRun(id, 1, None, NOW, latest_start=None if latest is None else NOW + latest,
                      duration=timedelta(minutes=14), limit=TWO_HOURS, basis=basis)


def test_submit_says_how_long_its_run_is_planned_for_and_why_and_when_a_deadline_rests_on_it():
    busy = [Busy(Device(0, "H100"), NOW + timedelta(minutes=30))]
    planned = plan([_learned("mine", latest=timedelta(minutes=46))], [([], busy)], NOW)  # deadline 23:00
    assert length_line(planned, "mine") == (
        "planned for 14 min: your last 20 runs took 12-14 min of a 2 h limit; it meets its deadline only on this "
        "prediction (run to its 2 h limit it would not)")
    roomy = plan([_learned("mine", latest=None)], [([], busy)], NOW)
    assert length_line(roomy, "mine") == "planned for 14 min: your last 20 runs took 12-14 min of a 2 h limit"
    assert length_line(roomy, "other") is None


def test_queue_shows_each_runs_planned_length_and_basis():
    busy = [Busy(Device(0, "H100"), NOW + timedelta(minutes=30))]
    planned = plan([_learned("a", latest=timedelta(minutes=46))], [([], busy)], NOW)
    [row] = rows(planned, {"a": ("brave-fox", "train")}, NOW)
    assert row[6:] == ("yes, on prediction", "14 min", "your last 20 runs took 12-14 min of a 2 h limit")


def test_the_plan_artifact_has_a_stable_key_per_pool_and_a_row_per_waiting_run():
    assert key("gpu") == "e31-plan-gpu" and key("GPU pool_2") == "e31-plan-gpu-pool-2"
    runs = [_learned(f"r{i}", latest=None) for i in range(MAX_ROWS + 5)]
    planned = plan(runs, [([Device(0, "H100")], [])], NOW)
    made = table(planned, {"r0": ("brave-fox", "train")})
    assert made[0] == {"run": "brave-fox", "job": "train", "gpus": "1", "planned start": "2026-12-03 22:00:00Z",
                       "planned finish": "2026-12-03 22:14:00Z", "planned length": "14 min",
                       "latest start": "-", "meets deadline": "-",
                       "basis": "your last 20 runs took 12-14 min of a 2 h limit"}
    assert len(made) == MAX_ROWS + 1 and made[-1] == {"run": "... and 5 more (e31 queue shows them all)"}
    json.dumps(made)


def test_the_plan_is_written_only_when_it_changed_and_at_most_every_interval():
    clock, written = Clock(), []
    writer = PlanWriter(30, clock)

    async def send(rows: list) -> None:
        written.append(rows)

    async def poll(rows: list) -> None:
        async def make() -> tuple[list, object]:
            return rows, send
        writer.start(make)
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    async def scenario() -> None:
        await poll([{"run": "a"}])
        await poll([{"run": "b"}])  # too soon
        clock.now = 30
        await poll([{"run": "a"}])  # unchanged
        clock.now = 60
        await poll([{"run": "b"}])

    asyncio.run(scenario())
    assert written == [[{"run": "a"}], [{"run": "b"}]]


def test_a_workers_busy_device_comes_back_at_its_runs_predicted_end_unless_its_limit_is_sooner(tmp_path):
    from uuid import uuid4

    from e31_prefect.host.settings import E31Settings
    from e31_prefect.surface.worker import E31Worker

    worker = E31Worker(work_pool_name="gpu", settings=E31Settings(gpus="2xH100", home=tmp_path / "home",
                                                                  device_locks=tmp_path / "locks"))
    learned, plain, odd = uuid4(), uuid4(), uuid4()
    worker.holds_until.update({learned: NOW + TWO_HOURS, plain: NOW + TWO_HOURS, odd: NOW + timedelta(minutes=5)})
    worker.predicted_until.update({learned: NOW + timedelta(minutes=14), odd: NOW + timedelta(minutes=14)})
    assert worker.planned_end(learned) == NOW + timedelta(minutes=14)
    assert worker.planned_end(plain) == NOW + TWO_HOURS
    assert worker.planned_end(odd) == NOW + timedelta(minutes=5)  # its limit (or its deadline) stops it first
    worker.predicted_length[learned] = timedelta(minutes=14)
    worker.rented(learned, NOW + timedelta(minutes=3))  # staging took 3 minutes: the prediction counts from here
    worker.rented(plain, NOW + timedelta(minutes=3))
    assert worker.planned_end(learned) == NOW + timedelta(minutes=17)
    assert worker.planned_end(plain) == NOW + TWO_HOURS
    worker.return_devices(learned)
    assert worker.planned_end(learned) is None and learned not in worker.predicted_until
