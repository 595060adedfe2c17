"""Unit tests for e31_prefect.planning.scheduling: which waiting runs a worker starts now, on which devices.

Order: least slack (earliest latest start) first, then higher priority, then earlier scheduled
time; runs with no deadline come last, ordered among themselves by priority, then scheduled
time. A run that does not fit is skipped (not blocking), a run past its latest start is
reported as missed. A seeded randomized test checks the invariants over many generated cases.
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

import pytest

from e31_prefect.host.inventory import Device, matches
from e31_prefect.planning.scheduling import Decision, WaitingQueue, WaitingRun, decide, urgency

UTC = timezone.utc
NOW = datetime(2026, 12, 3, 22, 0, tzinfo=UTC)

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-40GB"


def minutes(n: float) -> timedelta:
    return timedelta(minutes=n)


def run(
    id: str,
    gpus: int = 1,
    gpu_type: str | None = None,
    *,
    scheduled: float = 0,
    latest: float | None = None,
    priority: int = 0,
    queue: int = 0,
) -> WaitingRun:
    """A waiting run; ``scheduled`` and ``latest`` are minutes relative to NOW; ``queue`` its queue's priority."""
    return WaitingRun(
        id=id,
        gpus=gpus,
        gpu_type=gpu_type,
        queue_priority=queue,
        scheduled=NOW + minutes(scheduled),
        latest_start=None if latest is None else NOW + minutes(latest),
        priority=priority,
    )


def gpus(*names: str) -> list[Device]:
    return [Device(i, name) for i, name in enumerate(names)]


def started(decision: Decision) -> list[str]:
    return [r.id for r, _ in decision.start]


def placement(decision: Decision) -> dict[str, list[int]]:
    return {r.id: [d.index for d in devices] for r, devices in decision.start}


# -- order ------------------------------------------------------------------------------------


def test_least_slack_goes_first():
    waiting = [run("relaxed", latest=120), run("urgent", latest=10)]
    decision = decide(waiting, gpus(H100), NOW)
    assert started(decision) == ["urgent"]
    assert decision.missed == []


def test_equal_slack_higher_priority_goes_first():
    waiting = [run("low", latest=30, priority=0), run("high", latest=30, priority=5)]
    assert started(decide(waiting, gpus(H100), NOW)) == ["high"]


def test_slack_beats_priority():
    waiting = [run("vip", latest=60, priority=100), run("tight", latest=5, priority=0)]
    assert started(decide(waiting, gpus(H100), NOW)) == ["tight"]


def test_equal_slack_and_priority_earlier_scheduled_goes_first():
    waiting = [run("later", scheduled=-1, latest=30), run("earlier", scheduled=-20, latest=30)]
    assert started(decide(waiting, gpus(H100), NOW)) == ["earlier"]


def test_runs_with_no_deadline_go_last():
    waiting = [
        run("no-deadline", scheduled=-600, priority=100),
        run("far-deadline", scheduled=0, latest=7 * 24 * 60),
    ]
    assert started(decide(waiting, gpus(H100), NOW)) == ["far-deadline"]


def test_start_list_is_in_urgency_order():
    waiting = [
        run("d", scheduled=-5),
        run("b", latest=30, priority=1),
        run("c", latest=30),
        run("a", latest=5),
    ]
    decision = decide(waiting, gpus(H100, H100, H100, H100), NOW)
    assert started(decision) == ["a", "b", "c", "d"]
    assert placement(decision) == {"a": [0], "b": [1], "c": [2], "d": [3]}


def test_no_deadline_runs_are_first_come_first_served():
    waiting = [run("second", scheduled=-1), run("first", scheduled=-2)]
    assert started(decide(waiting, gpus(H100), NOW)) == ["first"]


def test_no_deadline_runs_higher_priority_goes_first():
    waiting = [run("fifo", scheduled=-10, priority=0), run("important", scheduled=-5, priority=10)]
    assert started(decide(waiting, gpus(H100), NOW)) == ["important"]


def test_no_deadline_runs_in_priority_then_scheduled_order():
    waiting = [
        run("low-early", scheduled=-30, priority=0),
        run("high-late", scheduled=-1, priority=3),
        run("high-early", scheduled=-2, priority=3),
        run("negative", scheduled=-60, priority=-1),
    ]
    decision = decide(waiting, gpus(H100, H100, H100, H100), NOW)
    assert started(decision) == ["high-early", "high-late", "low-early", "negative"]


def test_urgency_key_shape():
    assert urgency(run("x", latest=30, priority=2, scheduled=-1, queue=3)) == (
        3, NOW + minutes(30), -2, NOW - minutes(1),
    )
    assert urgency(run("y", scheduled=-1, priority=4)) == (
        0, datetime.max.replace(tzinfo=UTC), -4, NOW - minutes(1),
    )


def test_a_higher_priority_work_queue_goes_first_whatever_the_slack():
    """Prefect users order their queues on purpose: queue 1 before queue 2, then least slack within."""
    waiting = [
        run("low-queue-day-late", scheduled=-24 * 60, latest=600, queue=2),
        run("high-queue-relaxed", scheduled=0, latest=900, queue=1),
        run("high-queue-urgent", scheduled=0, latest=60, queue=1),
    ]
    decision = decide(waiting, gpus(H100, H100), NOW)
    assert started(decision) == ["high-queue-urgent", "high-queue-relaxed"]


def test_missed_runs_of_every_queue_are_refused_even_when_nothing_can_start():
    queue = WaitingQueue([run("busy-1", queue=1), run("late-1", latest=-5, queue=1),
                          run("late-3", latest=-1, queue=3), run("fine-3", latest=30, queue=3)])
    decision = decide(queue, [], NOW)
    assert sorted(r.id for r in decision.missed) == ["late-1", "late-3"]
    assert decision.start == []


# -- fitting ----------------------------------------------------------------------------------


def test_run_that_needs_too_many_devices_is_skipped_and_a_smaller_one_starts():
    waiting = [run("big", gpus=4, latest=5), run("small", gpus=1, latest=60)]
    decision = decide(waiting, gpus(H100, H100), NOW)
    assert placement(decision) == {"small": [0]}
    assert decision.missed == []


def test_run_that_needs_another_gpu_type_is_skipped_and_a_later_one_starts():
    waiting = [run("wants-a100", gpus=1, gpu_type="A100", latest=5), run("any", gpus=1, latest=60)]
    decision = decide(waiting, gpus(H100), NOW)
    assert placement(decision) == {"any": [0]}


def test_gpu_type_matches_case_insensitively_inside_the_device_name():
    waiting = [run("h", gpus=1, gpu_type="h100"), run("a", gpus=1, gpu_type="a100")]
    decision = decide(waiting, gpus(A100, H100), NOW)
    assert placement(decision) == {"a": [0], "h": [1]}


def test_lowest_indexed_matching_devices_are_given():
    free = [Device(5, H100), Device(2, A100), Device(3, H100), Device(1, H100)]
    decision = decide([run("two", gpus=2, gpu_type="H100")], free, NOW)
    assert placement(decision) == {"two": [1, 3]}


def test_devices_are_not_given_twice_in_one_decision():
    waiting = [run(f"r{i}", gpus=1, scheduled=-i) for i in range(5)]
    decision = decide(waiting, gpus(H100, H100, H100), NOW)
    assert placement(decision) == {"r4": [0], "r3": [1], "r2": [2]}


def test_cpu_only_run_starts_with_no_devices_even_when_none_are_free():
    decision = decide([run("cpu", gpus=0), run("gpu", gpus=1)], [], NOW)
    assert placement(decision) == {"cpu": []}


def test_nothing_waiting_decides_nothing():
    decision = decide([], gpus(H100), NOW)
    assert decision.start == [] and decision.missed == []


# -- missed deadlines -------------------------------------------------------------------------


def test_run_past_its_latest_start_is_missed_and_not_started():
    late, fine = run("late", latest=-1), run("fine", latest=60)
    decision = decide([late, fine], gpus(H100, H100), NOW)
    assert decision.missed == [late]
    assert placement(decision) == {"fine": [0]}


def test_missed_run_does_not_take_devices():
    waiting = [run("late", gpus=1, latest=-30), run("next", gpus=1, latest=600)]
    decision = decide(waiting, gpus(H100), NOW)
    assert [r.id for r in decision.missed] == ["late"]
    assert placement(decision) == {"next": [0]}


def test_run_exactly_at_its_latest_start_still_starts():
    decision = decide([run("just-in-time", latest=0)], gpus(H100), NOW)
    assert started(decision) == ["just-in-time"]
    assert decision.missed == []


def test_missed_is_reported_even_without_free_devices():
    decision = decide([run("late", gpus=2, latest=-1), run("cpu-late", gpus=0, latest=-5)], [], NOW)
    assert [r.id for r in decision.missed] == ["cpu-late", "late"]
    assert decision.start == []


def test_latest_start_in_another_zone_is_compared_as_an_instant():
    from zoneinfo import ZoneInfo

    paris = ZoneInfo("Europe/Paris")
    # 22:30 Paris is 21:30 UTC, half an hour before NOW.
    latest = datetime(2026, 12, 3, 22, 30, tzinfo=paris)
    late = WaitingRun("late", 0, None, NOW, latest_start=latest)
    assert decide([late], [], NOW).missed == [late]


# -- randomized invariants --------------------------------------------------------------------

NAMES = [H100, A100, "Tesla T4", "NVIDIA H100 PCIe"]
TYPES = [None, None, "H100", "h100", "A100", "T4", "V100", "NVIDIA"]


def random_case(rng: random.Random) -> tuple[list[WaitingRun], list[Device]]:
    host = [Device(i, rng.choice(NAMES)) for i in range(rng.randint(0, 8))]
    free = [d for d in host if rng.random() < 0.7]
    rng.shuffle(free)
    waiting = []
    for i in range(rng.randint(0, 10)):
        latest = None if rng.random() < 0.3 else NOW + minutes(rng.randint(-60, 600))
        waiting.append(WaitingRun(
            id=f"run-{i}",
            gpus=rng.choice([0, 1, 1, 1, 2, 2, 3, 4, 8]),
            gpu_type=rng.choice(TYPES),
            scheduled=NOW + minutes(rng.randint(-600, 0)),
            latest_start=latest,
            priority=rng.randint(-2, 2),
        ))
    return waiting, free


@pytest.mark.parametrize("seed", range(20))
def test_randomized_decisions_keep_their_promises(seed: int):
    rng = random.Random(seed)
    for _ in range(100):
        waiting, free = random_case(rng)
        decision = decide(waiting, free, NOW)

        started_ids = [r.id for r, _ in decision.start]
        missed_ids = [r.id for r in decision.missed]
        # Each waiting run is started, missed or skipped: never two of these.
        assert len(set(started_ids)) == len(started_ids)
        assert not set(started_ids) & set(missed_ids)

        # Missed is exactly the runs past their latest start.
        assert sorted(missed_ids) == sorted(
            r.id for r in waiting if r.latest_start is not None and r.latest_start < NOW
        )

        # No device is given twice, and only free devices are given.
        given = [d for _, devices in decision.start for d in devices]
        assert len(given) == len(set(given))
        assert set(given) <= set(free)

        # Every started run got exactly its count, all of its type and all one model.
        for started_run, devices in decision.start:
            assert len(devices) == started_run.gpus
            assert all(matches(d, started_run.gpu_type) for d in devices)
            assert len({d.name for d in devices}) <= 1

        # No skipped run could have fitted in what is left free at the end, on any one model.
        left = [d for d in free if d not in given]
        for skipped in waiting:
            if skipped.id in started_ids or skipped.id in missed_ids:
                continue
            for model in {d.name for d in left}:
                fitting = [d for d in left if d.name == model and matches(d, skipped.gpu_type)]
                assert len(fitting) < skipped.gpus, (skipped, left)

        # Runs needing GPUs start in order of urgency (runs needing none start at once).
        keys = [urgency(r) for r, _ in decision.start if r.gpus]
        assert keys == sorted(keys)


# -- backfill and the simulator ---------------------------------------------------------------

from datetime import timedelta as _td  # noqa: E402

from e31_prefect.planning.scheduling import Busy, TraceJob, simulate  # noqa: E402

_NOW = datetime(2026, 12, 2, 22, 0, tzinfo=timezone.utc)
_FOUR = [Device(i, "H100") for i in range(4)]


def _run(run_id, gpus, minutes, latest_in=None, priority=0, scheduled_ago=0):
    return WaitingRun(run_id, gpus, None, _NOW - _td(minutes=scheduled_ago),
                      latest_start=None if latest_in is None else _NOW + _td(minutes=latest_in),
                      priority=priority, duration=_td(minutes=minutes))


def test_a_small_run_backfills_only_where_it_does_not_delay_the_big_one():
    busy = [Busy(_FOUR[0], _NOW + _td(minutes=60)), Busy(_FOUR[1], _NOW + _td(minutes=60))]
    big = _run("big", 4, 60, latest_in=120)
    short = _run("short", 1, 30, latest_in=600)
    long = _run("long", 1, 120, latest_in=600)
    decision = decide([long, short, big], _FOUR[2:], _NOW, busy)
    assert [(r.id, [d.index for d in ds]) for r, ds in decision.start] == [("short", [2])]
    # The big run is promised 23:00; the long one goes after it, not before it.
    assert decision.reserved == {"big": _NOW + _td(minutes=60), "long": _NOW + _td(minutes=120)}


def test_without_backfill_the_long_small_run_would_take_a_device_the_big_one_needs():
    busy = [Busy(_FOUR[0], _NOW + _td(minutes=60)), Busy(_FOUR[1], _NOW + _td(minutes=60))]
    runs = [_run("big", 4, 60, latest_in=120), _run("short", 1, 30, latest_in=600), _run("long", 1, 120, latest_in=600)]
    started = {r.id for r, _ in decide(runs, _FOUR[2:], _NOW, busy, backfill=False).start}
    assert started == {"short", "long"}


def test_reservations_stop_at_the_depth_and_later_runs_first_fit():
    busy = [Busy(d, _NOW + _td(minutes=60)) for d in _FOUR[:2]]
    runs = [_run("big", 4, 60, latest_in=120), _run("long", 1, 120, latest_in=600)]
    decision = decide(runs, _FOUR[2:], _NOW, busy, reservation_depth=0)
    assert [r.id for r, _ in decision.start] == ["long"] and decision.reserved == {}


def test_an_eight_gpu_job_is_not_starved_by_a_stream_of_one_gpu_jobs():
    # A 1-GPU job arrives every 6 minutes and runs 50: about eight at a time, all day long.
    trace = [TraceJob(i, _NOW + _td(minutes=6 * (i - 1)), 1, _td(minutes=50)) for i in range(1, 200)]
    trace.append(TraceJob(0, _NOW + _td(minutes=30), 8, _td(hours=1), deadline=_NOW + _td(hours=3)))
    fifo, e31 = simulate(trace, "fifo", gpus=8), simulate(trace, "e31", gpus=8)
    assert fifo.deadlines_met == 0  # first fit keeps giving freed GPUs to the small jobs
    assert e31.deadlines_met == 1  # the reservation holds them for the big one


def test_least_slack_first_meets_a_deadline_fifo_misses():
    trace = [TraceJob(0, _NOW, 2, _td(hours=1)),
             TraceJob(1, _NOW, 2, _td(hours=1), deadline=_NOW + _td(minutes=65))]
    fifo, e31 = simulate(trace, "fifo", gpus=2), simulate(trace, "e31", gpus=2)
    assert (fifo.deadlines_met, e31.deadlines_met) == (0, 1)
    assert fifo.percent_met == 0.0 and e31.percent_met == 100.0
    assert fifo.utilisation == e31.utilisation == 1.0
    assert e31.mean_wait == fifo.mean_wait == _td(minutes=30)


def test_e31_refuses_a_run_that_can_no_longer_make_it_and_fifo_runs_it_late():
    trace = [TraceJob(0, _NOW, 1, _td(hours=2)),
             TraceJob(1, _NOW + _td(minutes=1), 1, _td(hours=1), deadline=_NOW + _td(minutes=90))]
    e31, fifo = simulate(trace, "e31", gpus=1), simulate(trace, "fifo", gpus=1)
    assert e31.refused == 1 and e31.deadlines_met == 0
    assert fifo.refused == 0 and fifo.deadlines_met == 0
    assert e31.utilisation > fifo.utilisation * 0.99  # the doomed hour is not spent


# -- one model per run, the kept queue, and plans that never over-commit -------------------------



def test_a_run_never_spans_two_models():
    decision = decide([run("pair", gpus=2)], gpus(A100, H100), NOW)
    assert decision.start == [] and decision.reserved == {}
    decision = decide([run("pair", gpus=2)], gpus(A100, H100, H100), NOW)
    assert placement(decision) == {"pair": [1, 2]}


def test_a_run_goes_to_the_model_where_it_starts_soonest():
    a100, h100s = Device(0, A100), [Device(1, H100), Device(2, H100)]
    busy = [Busy(a100, NOW + minutes(90)), Busy(h100s[0], NOW + minutes(20))]
    pair = WaitingRun("pair", 2, None, NOW, latest_start=NOW + minutes(600), duration=minutes(30))
    decision = decide([pair], [h100s[1]], NOW, busy)
    assert decision.reserved == {"pair": NOW + minutes(20)}


def _random_runs(rng: random.Random, count: int) -> list[WaitingRun]:
    return [WaitingRun(
        id=f"run-{i}", gpus=rng.choice([0, 1, 1, 2, 4, 8]), gpu_type=None,
        scheduled=NOW - timedelta(seconds=i),  # distinct, so the order has no ties
        latest_start=None if rng.random() < 0.2 else NOW + minutes(rng.randint(-30, 600)),
        priority=rng.randint(0, 2), duration=None if rng.random() < 0.1 else minutes(rng.randint(1, 240)),
    ) for i in range(count)]


@pytest.mark.parametrize("seed", range(10))
def test_a_queue_kept_across_polls_decides_as_one_built_afresh(seed: int):
    rng = random.Random(seed)
    pool = _random_runs(rng, 200)
    queue = WaitingQueue()
    for _ in range(30):
        current = rng.sample(pool, rng.randint(0, 120))
        if rng.random() < 0.5:
            queue.sync(current)
        else:  # runs come and go one at a time between polls
            for gone in [r.id for r in queue if r not in current] + [r.id for r in queue.gpuless]:
                queue.discard(gone)
            for arriving in current:
                queue.add(arriving)
        assert len(queue) == len(current)
        assert [r.id for r in queue] == [r.id for r in sorted((r for r in current if r.gpus), key=urgency)]
        devices = [Device(i, H100) for i in range(8)]
        busy = [Busy(d, NOW + minutes(rng.randint(1, 120))) for d in devices[rng.randint(0, 8):]]
        free = [d for d in devices if d not in {b.device for b in busy}]
        assert decide(queue, free, NOW, busy) == decide(current, free, NOW, busy)


@pytest.mark.parametrize("seed", range(20))
def test_plans_never_promise_more_devices_than_exist(seed: int):
    """Runs started now, running runs and every reservation fit together at every moment."""
    rng = random.Random(seed)
    for _ in range(50):
        devices = [Device(i, H100) for i in range(rng.choice([1, 2, 4, 8]))]
        # Holds end later, ended already (a run over its expected duration) or have no known end.
        busy = [Busy(d, None if rng.random() < 0.1 else NOW + minutes(rng.randint(-30, 300)))
                for d in devices if rng.random() < 0.6]
        free = [d for d in devices if d not in {b.device for b in busy}]
        waiting = [r for r in _random_runs(rng, rng.randint(1, 30)) if r.gpus <= len(devices)]
        decision = decide(waiting, free, NOW, busy)
        by_id = {r.id: r for r in waiting}
        assert all(len(given) == r.gpus for r, given in decision.start)
        spans = [(NOW, NOW + timedelta(days=10_000) if b.until is None else max(b.until, NOW + timedelta(seconds=1)),
                  1) for b in busy]
        spans += [(NOW, NOW + (r.duration or timedelta(days=10_000)), r.gpus) for r, _ in decision.start if r.gpus]
        spans += [(at, at + (by_id[i].duration or timedelta(days=10_000)), by_id[i].gpus)
                  for i, at in decision.reserved.items()]
        for moment in {start for start, _, _ in spans}:
            in_use = sum(gpus for start, end, gpus in spans if start <= moment < end)
            assert in_use <= len(devices), (moment, decision)
        # A reservation is for a run that could not start now, and never in the past.
        assert all(at > NOW for at in decision.reserved.values())
        assert not set(decision.reserved) & {r.id for r, _ in decision.start}


def test_a_device_held_past_its_expected_end_is_not_given_to_anyone_now():
    h100s = [Device(0, H100), Device(1, H100)]
    overrunning = Busy(h100s[0], NOW - minutes(5))  # an until_done run past its expected duration
    one = WaitingRun("one", 1, None, NOW, latest_start=NOW + minutes(60), duration=minutes(30))
    decision = decide([one], [], NOW, [overrunning])
    assert decision.start == [] and decision.reserved == {"one": NOW + timedelta(seconds=1)}
    pair = WaitingRun("pair", 2, None, NOW, latest_start=NOW + minutes(60), duration=minutes(30))
    decision = decide([pair], [h100s[1]], NOW, [overrunning])
    assert decision.start == [] and "pair" in decision.reserved


def test_a_device_held_with_no_known_end_blocks_only_runs_that_need_it():
    a100, h100 = Device(0, A100), Device(1, H100)
    forever = Busy(h100, None)
    waiting = [WaitingRun("h", 1, "H100", NOW, latest_start=NOW + minutes(60), duration=minutes(30)),
               WaitingRun("any", 1, None, NOW, latest_start=NOW + minutes(90), duration=minutes(30))]
    decision = decide(waiting, [a100], NOW, [forever])
    assert placement(decision) == {"any": [0]}
    assert decision.reserved == {}
