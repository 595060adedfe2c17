"""Unit tests for sharded jobs: the job's shard fields, and e31_prefect.model.shards' pure schedule.

A user notices which shards ran where, how often a failing one ran again, whether the
job ended Completed, and what the messages say; these tests check exactly that.
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

import pytest

from e31_prefect.model.job import Job, parse_job
from e31_prefect.model.job_file import load_job_file
from e31_prefect.model.job_plan import plan, plan_problems
from e31_prefect.model.job_values import MAX_SHARDS, JobError
from e31_prefect.model.shards import (
    SHARDS_VARIABLE,
    Progress,
    Schedule,
    ShardSettings,
    allowed_failures,
    entrypoint_problem,
    failure_rows,
    failure_summary,
    missing_shard_parameters,
    progress_bar,
    shard_environment,
    shard_parameters,
    slot_count,
    slots,
)
from e31_prefect.runtimes import job_environment
from e31_prefect.surface.submission import entrypoint_of


def sharded(gpus: int = 4, **work) -> dict:
    return {"name": "sims", "work": {"command": ["python", "sim.py"], **work},
            "request": {"gpus": gpus, "max_duration": "1h"}}


def problems(data: dict) -> list[str]:
    with pytest.raises(JobError) as caught:
        parse_job(data)
    return [str(problem) for problem in caught.value.problems]


# -- the job's fields ---------------------------------------------------------------------------


def test_a_sharded_job_round_trips_through_job_variables_with_its_defaults_filled_in():
    job = parse_job(sharded(shards=10_000, shard_retries=2, allow_failed_shards=0.01, reduce="python reduce.py"))
    assert Job.from_job_variables(job.to_job_variables(), "sims") == job
    assert ShardSettings.of(job) == ShardSettings(count=10_000, gpus_per_shard=1, shards_per_gpu=1, retries=2,
                                                  allow_failed=0.01, reduce=["python", "reduce.py"])


def test_a_job_without_shards_has_no_shard_settings_and_no_new_job_variables():
    job = parse_job(sharded())
    assert ShardSettings.of(job) is None
    assert set(job.to_job_variables()["work"]) == {"command", "parameters", "env"}


def test_cpu_only_shards_of_a_job_renting_no_gpu_see_no_device():
    settings = ShardSettings.of(parse_job(sharded(gpus=0, shards=5, shards_per_gpu=3)))
    assert settings is not None and settings.gpus_per_shard == 0
    assert slots([], settings.gpus_per_shard, settings.shards_per_gpu) == [(), (), ()]


@pytest.mark.parametrize("count", [0, -1, MAX_SHARDS + 1, 10**12])
def test_zero_negative_and_absurd_shard_counts_are_refused(count):
    [problem] = problems(sharded(shards=count))
    assert problem.startswith(f"work.shards = {count}: must be from 1 to {MAX_SHARDS}")


@pytest.mark.parametrize("value", [True, "10", 2.0, [3]])
def test_a_shard_count_that_is_not_a_whole_number_is_refused(value):
    [problem] = problems(sharded(shards=value))
    assert problem.startswith("work.shards = ") and "is not a whole number" in problem


def test_more_gpus_per_shard_than_the_job_rents_is_refused():
    assert problems(sharded(gpus=2, shards=4, gpus_per_shard=4)) == [
        "work.gpus_per_shard = 4: is more than the job's request.gpus (2); rent at least 4 GPU(s) or give "
        "each shard fewer"]


def test_gpus_per_shard_that_leaves_a_rented_gpu_idle_is_refused():
    [problem] = problems(sharded(gpus=5, shards=4, gpus_per_shard=2))
    assert problem.startswith("work.gpus_per_shard = 2: does not divide request.gpus (5): 1 GPU(s)")


def test_cpu_only_shards_of_a_job_renting_gpus_are_refused():
    [problem] = problems(sharded(gpus=2, shards=4, gpus_per_shard=0))
    assert "leaves the job's 2 rented GPU(s) unused" in problem


def test_reduce_and_every_shard_setting_without_shards_are_refused_one_line_each():
    assert problems(sharded(reduce=["python", "r.py"], shard_retries=1, allow_failed_shards=2)) == [
        "work.shard_retries = 1: only applies to a sharded job; set work.shards (e.g. shards: 100) or remove it",
        "work.allow_failed_shards = 2: only applies to a sharded job; set work.shards (e.g. shards: 100) or "
        "remove it",
        "work.reduce = ['python', 'r.py']: only applies to a sharded job; set work.shards (e.g. shards: 100) or "
        "remove it",
    ]


@pytest.mark.parametrize("allow, fix", [
    (1.0, "is a fraction of the shards, so at least 0 and below 1"),
    (float("nan"), "is a fraction of the shards"),
    (-1, "must be 0 or more shards"),
    (10, "allows all 10 shards to fail"),
    ("1%", "is not a count or a fraction"),
])
def test_a_failure_allowance_that_means_nothing_is_refused(allow, fix):
    [problem] = problems(sharded(shards=10, allow_failed_shards=allow))
    assert problem.startswith("work.allow_failed_shards = ") and fix in problem


def test_bad_retries_shards_per_gpu_and_an_empty_reduce_are_each_one_line():
    found = problems(sharded(shards=10, shard_retries=99, shards_per_gpu=0, reduce=[]))
    assert sorted(line.split(":")[0] for line in found) == ["work.reduce = []", "work.shard_retries = 99",
                                                            "work.shards_per_gpu = 0"]


def test_a_flow_may_be_sharded():
    job = parse_job({"name": "j", "work": {"flow": "f.py:f", "parameters": {"steps": 5}, "shards": 3},
                     "request": {"gpus": 1, "max_duration": "1h"}})
    assert ShardSettings.of(job) == ShardSettings(count=3)


def test_a_sharded_flows_parameters_cannot_name_the_shard_e31_gives_each_shard():
    found = problems({"name": "j", "work": {"flow": "f.py:f", "shards": 3,
                                            "parameters": {"shard_index": 0, "shard_count": 3, "steps": 5}},
                      "request": {"max_duration": "1h"}})
    assert found == ["work.parameters.shard_index = 0: is given to each shard by e31 (from 0 to shards - 1, and "
                     "the shard count); remove it",
                     "work.parameters.shard_count = 3: is given to each shard by e31 (from 0 to shards - 1, and "
                     "the shard count); remove it"]
    # Without shards they are the flow's own parameters like any other.
    parse_job({"name": "j", "work": {"flow": "f.py:f", "parameters": {"shard_index": 0}},
               "request": {"max_duration": "1h"}})


FLOW_FILE = """\
from prefect import flow

@flow
def sim(steps: int, shard_index: int, shard_count: int): ...

@flow
def keyword_only(*, shard_index: int = 0, shard_count: int = 1): ...

@flow
async def half(steps: int, shard_index: int, **rest): ...

@flow
def positional_only(shard_index, shard_count, /): ...

@flow
def plain(steps: int): ...
"""


@pytest.mark.parametrize("function, missing", [
    ("sim", None), ("keyword_only", None),
    ("half", "half takes no shard_count parameter, which each shard of a sharded flow receives; add it "
             "(def half(..., shard_count: int)) or remove work.shards"),
    ("positional_only", "positional_only takes no shard_index or shard_count parameter"),
    ("plain", "plain takes no shard_index or shard_count parameter, which each shard of a sharded flow "
              "receives; add them (def plain(..., shard_index: int, shard_count: int)) or remove work.shards"),
])
def test_a_sharded_flow_that_cannot_receive_its_shard_is_refused_when_the_job_file_is_read(tmp_path, function,
                                                                                            missing):
    (tmp_path / "flows.py").write_text(FLOW_FILE)
    job = tmp_path / "job.yaml"
    job.write_text(f"work: {{flow: flows.py:{function}, shards: 4}}\nrequest: {{gpus: 2, max_duration: 1h}}\n")
    if missing is None:
        assert load_job_file(job).work.shards == 4
        return
    with pytest.raises(JobError) as caught:
        load_job_file(job)
    [problem] = map(str, caught.value.problems)
    assert problem.startswith(f"work.flow = 'flows.py:{function}': {missing}")
    # The same flow unsharded is fine: it is given no shard.
    job.write_text(f"work: {{flow: flows.py:{function}}}\nrequest: {{max_duration: 1h}}\n")
    assert load_job_file(job).work.shards is None


def test_a_shards_parameters_are_the_jobs_and_its_own_shard():
    assert shard_parameters({"steps": 5}, 3, 8) == {"steps": 5, "shard_index": 3, "shard_count": 8}
    assert missing_shard_parameters(["steps", "shard_count", "shard_index"]) == []
    assert missing_shard_parameters(["shard_count"]) == ["shard_index"]


COMMAND, FLOW_SHARDS = "e31_prefect.command_flow.run_command", "e31_prefect.flow_shards.run_flow_shards"


@pytest.mark.parametrize("shards, entrypoint, refused", [
    (None, None, None), (8, None, None),                          # not known: let through
    (8, COMMAND, None), (None, COMMAND, None),                    # the command flow, sharded or not
    (8, FLOW_SHARDS, None),                                       # a sharded flow
    (None, FLOW_SHARDS, "work.shards: not set, and this deployment runs e31's flow shards"),
    (None, "flows/sim.py:sim", None),                             # a flow of its own, once
    (8, "flows/sim.py:sim", "work.shards = 8: this deployment runs the flow flows/sim.py:sim itself, which would "
                            "run once; deploy it with entrypoint e31_prefect.flow_shards.run_flow_shards and "
                            "parameters {flow: flows/sim.py:sim, parameters: {...}}"),
])
def test_a_deployment_runs_its_shards_only_through_e31s_built_in_flows(shards, entrypoint, refused):
    problem = entrypoint_problem(shards, entrypoint, COMMAND, FLOW_SHARDS)
    assert (problem is None) if refused is None else problem.startswith(refused)


def test_e31_submit_deploys_a_sharded_flow_as_e31s_flow_shards_with_its_flow_and_parameters(tmp_path):
    job = parse_job({"name": "j", "work": {"flow": "f.py:f", "parameters": {"steps": 5}, "shards": 3},
                     "request": {"gpus": 1, "max_duration": "1h"}})
    assert entrypoint_of(job, tmp_path) == (FLOW_SHARDS, "e31-flow-shards",
                                            {"flow": "f.py:f", "parameters": {"steps": 5}})


def test_the_worker_hands_the_shard_settings_to_the_job_in_its_environment():
    job = parse_job(sharded(shards=8, gpus_per_shard=2, reduce=["python", "r.py"]))
    env = job_environment(job, [], "/data", "/out")
    assert ShardSettings.from_text(env[SHARDS_VARIABLE]) == ShardSettings.of(job)
    assert SHARDS_VARIABLE not in job_environment(parse_job(sharded()), [], "/data", "/out")


# -- slots and each shard's environment ---------------------------------------------------------


def test_slots_group_devices_per_shard_and_repeat_them_per_gpu():
    assert slots(["0", "1", "2", "3"], 1, 1) == [("0",), ("1",), ("2",), ("3",)]
    assert slots(["0", "1", "2", "3"], 2, 1) == [("0", "1"), ("2", "3")]
    assert slots(["4", "7"], 1, 2) == [("4",), ("4",), ("7",), ("7",)]
    assert slots(["0", "1", "2"], 2, 1) == [("0", "1")]  # a leftover device is not half a shard
    assert slots(["0"], 2, 1) == []


def test_a_shard_sees_its_index_under_every_familiar_name_and_only_its_devices():
    env = shard_environment(7, 100, ("2", "3"), "/out/shard-7")
    assert {env[name] for name in ("E31_SHARD_INDEX", "SLURM_ARRAY_TASK_ID", "AWS_BATCH_JOB_ARRAY_INDEX",
                                   "JOB_COMPLETION_INDEX")} == {"7"}
    assert env["E31_SHARD_COUNT"] == env["SLURM_ARRAY_TASK_COUNT"] == "100"
    assert env["SLURM_ARRAY_TASK_MAX"] == "99"
    assert env["CUDA_VISIBLE_DEVICES"] == env["NVIDIA_VISIBLE_DEVICES"] == "2,3"
    assert env["E31_OUTPUT_DIR"] == "/out/shard-7"
    assert shard_environment(0, 1, (), "/o")["NVIDIA_VISIBLE_DEVICES"] == "none"


# -- the schedule -------------------------------------------------------------------------------


def test_allowed_failures_of_a_count_and_a_fraction():
    assert allowed_failures(10_000, 3) == 3
    assert allowed_failures(10_000, 0.01) == 100
    assert allowed_failures(100, 0.07) == 7  # not 6 for a float's rounding
    assert allowed_failures(150, 0.01) == 1
    assert allowed_failures(99, 0.01) == 0


def test_shards_start_in_order_on_the_slot_that_asks_and_the_job_succeeds_when_all_do():
    schedule = Schedule(count=3)
    assert [schedule.take(slot) for slot in (0, 1)] == [0, 1]
    assert schedule.running == {0: 0, 1: 1}
    assert schedule.finish(1, 0) == "done"
    assert schedule.take(1) == 2
    assert schedule.take(0) is None and not schedule.over
    schedule.finish(0, 0)
    schedule.finish(2, 0)
    assert schedule.over and schedule.ok and schedule.succeeded == 3


def test_a_failed_shard_is_retried_next_on_any_free_slot_until_its_retries_are_spent():
    schedule = Schedule(count=3, retries=2, allowed_failures=1)
    assert schedule.take(0) == 0 and schedule.take(1) == 1
    assert schedule.finish(0, 1, "boom") == "retry"
    assert schedule.take(0) == 0  # the retry comes before shard 2
    assert schedule.finish(0, 1) == "retry"
    schedule.finish(1, 0)
    assert schedule.take(1) == 0  # on another slot this time
    assert schedule.finish(0, 3, "still boom") == "failed"
    assert schedule.failures[0].attempts == 3 and schedule.failures[0].exit_code == 3
    assert schedule.retried == 2
    assert schedule.take(0) == 2
    schedule.finish(2, 0)
    assert schedule.over and schedule.ok  # one failure, and one allowed


def test_failures_within_the_allowance_leave_the_job_ok():
    schedule = Schedule(count=4, allowed_failures=1)
    for shard in range(4):
        assert schedule.take(0) == shard
        schedule.finish(shard, 1 if shard == 2 else 0, "bad input")
    assert schedule.ok and sorted(schedule.failures) == [2]


def test_once_failures_pass_the_allowance_no_shard_starts_and_running_ones_finish():
    schedule = Schedule(count=10, allowed_failures=1)
    assert [schedule.take(slot) for slot in range(3)] == [0, 1, 2]
    schedule.finish(0, 1)
    schedule.finish(1, 1)
    assert schedule.gave_up and schedule.take(0) is None and not schedule.over
    schedule.finish(2, 0)
    assert schedule.over and not schedule.ok
    assert schedule.not_run == 7
    summary = failure_summary(schedule.outcome())
    assert summary.splitlines()[0] == ("2 of 10 shards failed (allowed: 1); 7 not run after that. "
                                       "Failed shards: 0, 1")


def test_failure_summary_lists_each_failed_shard_with_its_last_line_and_caps_the_list():
    schedule = Schedule(count=30, allowed_failures=29)
    for shard in range(30):
        schedule.take(0)
        schedule.finish(shard, 2, f"starting\nValueError: bad seed {shard}")
    lines = failure_summary(schedule.outcome(), limit=3).splitlines()
    assert lines[0].endswith("Failed shards: 0, 1, 2 and 27 more")
    assert lines[1] == "  shard 0: exit 2 after 1 attempt(s): ValueError: bad seed 0"
    assert len(lines) == 4
    assert failure_rows(schedule.outcome())[29] == {"shard": 29, "attempts": 1, "exit_code": 2,
                                          "last_lines": "starting\nValueError: bad seed 29"}


@pytest.mark.parametrize("seed", range(200))
def test_any_run_of_the_schedule_runs_each_shard_until_it_succeeds_or_spends_its_retries(seed):
    """Random slots, random order of finishing, random failures: the schedule's promises hold."""
    rng = random.Random(seed)
    count, retries, n_slots = rng.randint(1, 40), rng.randint(0, 3), rng.randint(1, 6)
    allowed = rng.randint(0, count)
    fails = {shard: rng.randint(0, retries + 1) for shard in range(count) if rng.random() < 0.3}
    schedule = Schedule(count=count, retries=retries, allowed_failures=allowed)
    runs: dict[int, int] = {}
    free = list(range(n_slots))
    while not schedule.over:
        if schedule.gave_up:
            assert all(schedule.take(slot) is None for slot in free)  # nothing starts once the job is lost
        while free and (shard := schedule.take(free[-1])) is not None:
            assert shard not in runs or runs[shard] < retries + 1
            free.pop()
        assert len(schedule.running) <= n_slots
        assert len(set(schedule.running.values())) == len(schedule.running)  # one shard per slot
        shard = rng.choice(sorted(schedule.running))
        free.append(schedule.running[shard])
        runs[shard] = runs.get(shard, 0) + 1
        schedule.finish(shard, 1 if runs[shard] <= fails.get(shard, 0) else 0, "tail")
    failed_for_good = {shard for shard, n in fails.items() if n > retries}
    assert set(schedule.failures) <= failed_for_good
    if not schedule.gave_up:
        assert set(schedule.failures) == failed_for_good
        assert schedule.succeeded == count - len(failed_for_good)
        assert schedule.ok == (len(failed_for_good) <= allowed)
    else:
        assert len(schedule.failures) > allowed and not schedule.ok
        assert len(set(schedule.pending)) == schedule.not_run
        assert schedule.succeeded + len(schedule.failures) + schedule.not_run == count
    for shard, n in runs.items():
        assert n <= retries + 1
        assert (shard in schedule.failures) == (n == retries + 1 and fails.get(shard, 0) >= n)


# -- progress -----------------------------------------------------------------------------------


def test_progress_says_done_failed_running_rate_and_time_left():
    progress = Progress(count=10_000, done=4_000, failed=3, running=8, elapsed_s=100.0)
    assert progress.describe() == "4000/10000 shards done, 3 failed, 8 running; 40.0 shards/s; ETA 2m30s"
    assert progress.fraction == pytest.approx(0.4003)


def test_progress_before_any_shard_finished_has_no_rate_and_at_the_end_no_eta():
    assert Progress(count=5, done=0, failed=0, running=2, elapsed_s=3.0).describe() == (
        "0/5 shards done, 0 failed, 2 running")
    assert Progress(count=5, done=5, failed=0, running=0, elapsed_s=2.0).describe() == (
        "5/5 shards done, 0 failed, 0 running; 2.5 shards/s")
    assert Progress(count=100, done=1, failed=0, running=1, elapsed_s=60.0).describe().endswith("ETA 1h39m")


def test_the_progress_bar_e31_run_draws():
    assert progress_bar(30.0, "3/10 shards done", width=10) == "[###.......]  30% 3/10 shards done"
    assert progress_bar(100.0, "done", width=4) == "[####] 100% done"
    assert progress_bar(250.0, "", width=2).startswith("[##] 100%")


# -- planning with a shard's expected duration -------------------------------------------------


def until_done(gpus: int = 4, **work) -> dict:
    return {"name": "sims", "work": {"command": ["true"], **work},
            "request": {"gpus": gpus, "until_done": True, "deadline": "+2h"}}


def test_an_until_done_array_is_planned_as_its_shards_over_its_slots():
    job = parse_job(until_done(shards=10_000, shards_per_gpu=2, expected_shard_duration="3s"))
    assert job.shard_slots == 8
    assert job.expected_duration == timedelta(seconds=3 * 1250)
    assert job.admission_duration == timedelta(seconds=3750)
    now = datetime(2026, 12, 3, 12, tzinfo=timezone.utc)
    assert plan(job, now, start_now=True).latest_start == now + timedelta(hours=2) - timedelta(seconds=3750)


def test_an_array_that_cannot_finish_by_its_deadline_is_refused_at_submit_time():
    job = parse_job(until_done(shards=10_000, expected_shard_duration="30s"))
    the_plan = plan(job, datetime(2026, 12, 3, 12, tzinfo=timezone.utc), start_now=True)
    [problem] = plan_problems(job, the_plan)
    assert problem.field == "request.deadline" and "plus 20h50m" in problem.fix


def test_the_request_s_own_expected_duration_wins_over_the_shards():
    job = parse_job(until_done(shards=100, expected_shard_duration="1m")
                    | {"request": {"gpus": 4, "until_done": True, "expected_duration": "5m"}})
    assert job.expected_duration == timedelta(minutes=5)


def test_a_shard_duration_beyond_the_time_limit_is_refused():
    assert problems(sharded(shards=1_000, expected_shard_duration="1m")) == [
        "work.expected_shard_duration = '1m': makes 1000 shards over 4 slot(s) take 4h10m, beyond max_duration "
        "1h; rent more GPUs, run more shards per GPU, or raise the time limit"]


def test_a_shard_duration_without_shards_is_refused():
    assert problems(sharded(expected_shard_duration="30s")) == [
        "work.expected_shard_duration = '30s': only applies to a sharded job; set work.shards (e.g. shards: 100) "
        "or remove it"]


def test_slot_count_of_gpu_and_cpu_only_arrays():
    assert slot_count(8, 2, 3) == 12
    assert slot_count(0, 0, 4) == 4
    assert slot_count(1, 2, 1) == 1  # never zero, so a plan never divides by it
