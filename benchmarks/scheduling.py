"""Deadline-aware scheduling on a 32-GPU pool: FIFO (Prefect's order), plain EDF and e31's policy.

    python benchmarks/scheduling.py [--jobs 2000] [--seed 31] [--gpus 32] [--kinds 40] [--seeds 31,32,33]

A seeded trace: jobs of 1-8 GPUs running minutes to hours, deadlines of
varying slack (some none), submissions through three days and a burst at
22:00 on the last night (about 112% load while jobs arrive: more work than GPUs, so order matters).
Each policy (and FIFO under e31's admission rule) replays it through
`e31_prefect.planning.scheduling.simulate`, the decision
function the worker uses. Printed: deadlines met, GPU utilisation (all GPU
time used), on-time utilisation (GPU time of runs that met their deadline or
had none), mean wait, and e31's gain in deadlines met over FIFO (project goal:
at least 15 points at no lower utilisation). Then the time of one decision
with 10,000 waiting runs kept in a `WaitingQueue` (project goal: at most
1 ms), beside what the worker spends keeping that queue in order at a poll
and what a decision costs when it must sort the runs afresh.

Learned run times: each job comes from one of ``--kinds`` deployments, whose runs take about the
same time, and whose user set a time limit as real users do: 1x to 20x the true time, rounded up to
a round value (15 min, 1 h, 4 h, 24 h, then whole days). e31's policy replays the same jobs three
times, planning with the users' limits, with lengths learned from each deployment's last 20 runs
(:mod:`e31_prefect.model.prediction`), and with perfect knowledge; printed for each seed of ``--seeds``:
deadlines met, on-time utilisation, mean wait, and the share of the gap in deadlines met between
limits and perfect knowledge that learning recovers (project goal: at least 80%).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from datetime import datetime, timedelta, timezone

from e31_prefect.host.inventory import Device
from e31_prefect.planning.scheduling import (
    POLICIES,
    RESERVATION_DEPTH,
    Busy,
    TraceJob,
    WaitingQueue,
    WaitingRun,
    decide,
    simulate,
)

ROUND_LIMITS = (timedelta(minutes=15), timedelta(hours=1), timedelta(hours=4), timedelta(hours=24))
RUN_SPREAD = 0.15  # a deployment's runs take its typical time, give or take this share


def user_limit(true_longest: timedelta, overestimate: float) -> timedelta:
    """The limit a user sets: ``overestimate`` times the longest a run takes, rounded up to a round value
    (15 min, 1 h, 4 h, 24 h, then whole days)."""
    wanted = true_longest * overestimate
    for limit in ROUND_LIMITS:
        if wanted <= limit:
            return limit
    return timedelta(days=math.ceil(wanted / timedelta(days=1)))


def trace(jobs: int, seed: int, days: int = 3, kinds: int | None = None) -> list[TraceJob]:
    """Submissions through ``days`` days, a tenth of them in a burst at 22:00 on the last: about 112% load.
    With ``kinds``, each job comes from one of that many deployments: its typical time and its user's limit
    are the deployment's (see :func:`deployments`); without, each job's time is its own and its limit exact."""
    rng = random.Random(seed)
    typical, limits = deployments(kinds, seed) if kinds else ([], [])
    first = datetime(2026, 12, 2, tzinfo=timezone.utc)
    burst = first + timedelta(days=days - 1, hours=22)
    made = []
    for index in range(jobs):
        if rng.random() < 0.1:
            submit = burst + timedelta(seconds=rng.uniform(0, 600))
        else:
            submit = first + timedelta(seconds=rng.uniform(0, (days - 1) * 86400 + 22 * 3600))
        gpus = rng.choices([1, 2, 4, 8], weights=[50, 25, 15, 10])[0]
        if kinds:
            kind = rng.randrange(kinds)
            duration = timedelta(minutes=typical[kind] * rng.uniform(1 - RUN_SPREAD, 1 + RUN_SPREAD))
        else:
            kind = None
            duration = timedelta(minutes=min(360.0, max(3.0, math.exp(rng.gauss(math.log(20), 0.9)))))
        roll = rng.random()
        if roll < 0.15:
            deadline = None
        elif submit >= burst:
            deadline = burst.replace(hour=7) + timedelta(days=1)  # the nightly batch: done by 07:00
        else:
            deadline = submit + duration * rng.uniform(1.2, 6.0)
        made.append(TraceJob(index, submit, gpus, duration, deadline, priority=rng.choice([0, 0, 0, 1]),
                             limit=limits[kind] if kind is not None else None, kind=kind))
    return made


def deployments(kinds: int, seed: int) -> tuple[list[float], list[timedelta]]:
    """Each deployment's typical run time (minutes: 3 min to 6 h, about 20 min) and the limit its user set:
    1x to 20x (log-uniform) its longest run, rounded up to a round value."""
    rng = random.Random(seed * 7919 + kinds)
    typical = [min(360.0, max(3.0, math.exp(rng.gauss(math.log(20), 0.9)))) for _ in range(kinds)]
    limits = [user_limit(timedelta(minutes=minutes * (1 + RUN_SPREAD)), math.exp(rng.uniform(0, math.log(20))))
              for minutes in typical]
    return typical, limits


def past_runs(kinds: int, seed: int, runs: int = 20) -> dict[int, list[float]]:
    """Work times (seconds) of each deployment's last ``runs`` runs before the trace: a pool that ran before."""
    rng = random.Random(seed * 104729 + kinds)
    typical, _ = deployments(kinds, seed)
    return {kind: [60 * minutes * rng.uniform(1 - RUN_SPREAD, 1 + RUN_SPREAD) for _ in range(runs)]
            for kind, minutes in enumerate(typical)}


def _median_ms(action, repeats: int = 15) -> float:
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        timings.append((time.perf_counter() - started) * 1000)
    return statistics.median(timings)


def decision_ms(waiting_count: int, seed: int) -> dict[str, float]:
    """Median wall times with ``waiting_count`` waiting runs on a busy 32-GPU host: one decision on a kept
    queue, one poll's sync of that queue (nothing changed), and one decision from an unsorted list."""
    rng = random.Random(seed)
    now = datetime(2026, 12, 2, 22, tzinfo=timezone.utc)
    waiting = [WaitingRun(i, rng.choice([1, 2, 4, 8]), None, now - timedelta(seconds=rng.uniform(0, 3600)),
                          latest_start=now + timedelta(minutes=rng.uniform(1, 600)), priority=rng.choice([0, 1]),
                          duration=timedelta(minutes=rng.uniform(5, 300))) for i in range(waiting_count)]
    devices = [Device(i, "H100") for i in range(32)]
    busy = [Busy(d, now + timedelta(minutes=rng.uniform(1, 120))) for d in devices[4:]]
    queue = WaitingQueue(waiting)
    # The last decision's reservations, as a worker hands them in; a few past due (a run outlived its prediction).
    promised = decide(queue, devices[:4], now, busy).reserved
    promised.update({run_id: now - timedelta(minutes=1) for run_id in list(promised)[:4]})
    return {
        "decision": _median_ms(lambda: decide(queue, devices[:4], now, busy)),
        "promised": _median_ms(lambda: decide(queue, devices[:4], now, busy, promised=promised)),
        "sync": _median_ms(lambda: queue.sync(waiting)),
        "unsorted": _median_ms(lambda: decide(waiting, devices[:4], now, busy)),
    }


def learned_vs_limits(jobs: int, seeds: list[int], gpus: int, kinds: int) -> None:
    """Print e31's policy on the same jobs planned with limits, learned lengths and perfect knowledge, per seed,
    and the share of the limits-to-perfect gap in deadlines met that learning recovers. ``learned`` starts from
    each deployment's last 20 runs before the trace (a pool in use); ``cold`` learns from nothing (a new pool)."""
    print(f"\nlearned run times: e31's policy, {jobs} jobs from {kinds} deployments, user limits 1-20x the true "
          "time rounded up to 15 min / 1 h / 4 h / 24 h")
    print(f"{'seed':>5} {'plan':<8} {'deadlines met':>14} {'on time':>8} {'mean wait':>12} {'refused':>8}")
    shares: dict[str, list[float]] = {"learned": [], "cold": []}
    for seed in seeds:
        made = trace(jobs, seed, kinds=kinds)
        results = {"limits": simulate(made, "e31", gpus, "limits"),
                   "learned": simulate(made, "e31", gpus, "learned", past=past_runs(kinds, seed)),
                   "cold": simulate(made, "e31", gpus, "learned"),
                   "perfect": simulate(made, "e31", gpus, "perfect")}
        for plan, result in results.items():
            print(f"{seed:>5} {plan:<8} {result.percent_met:>13.1f}% {100 * result.on_time_utilisation:>7.1f}% "
                  f"{result.mean_wait.total_seconds() / 60:>10.1f} m {result.refused:>8}")
        gap = results["perfect"].deadlines_met - results["limits"].deadlines_met
        for plan, found in shares.items():
            found.append((results[plan].deadlines_met - results["limits"].deadlines_met) / gap if gap else 1.0)
        print(f"{seed:>5} learning recovers {100 * shares['learned'][-1]:.0f}% of the gap in deadlines met "
              f"({results['limits'].percent_met:.1f}% -> {results['learned'].percent_met:.1f}% of "
              f"{results['perfect'].percent_met:.1f}%); from nothing {100 * shares['cold'][-1]:.0f}%")
    for plan, found in shares.items():
        print(f"{plan}: learning recovers {100 * min(found):.0f}-{100 * max(found):.0f}% of the gap over "
              f"{len(seeds)} seed(s), mean {100 * statistics.mean(found):.0f}%"
              + (" (goal >= 80%)" if plan == "learned" else " (a new pool: each deployment's first runs use limits)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--gpus", type=int, default=32)
    parser.add_argument("--kinds", type=int, default=40, help="deployments the jobs come from")
    parser.add_argument("--seeds", default="31,32,33", help="seeds of the learned-run-times comparison")
    args = parser.parse_args()
    jobs = trace(args.jobs, args.seed)
    results = {policy: simulate(jobs, policy, args.gpus) for policy in POLICIES}
    window = (max(j.submit for j in jobs) - min(j.submit for j in jobs)).total_seconds()
    load = sum(j.gpus * j.duration.total_seconds() for j in jobs) / (args.gpus * window)
    print(f"trace: {args.jobs} jobs (seed {args.seed}), {results['e31'].with_deadline} with a deadline, "
          f"{args.gpus} GPUs, offered load {100 * load:.0f}% of the pool while jobs arrive")
    print(f"{'policy':<10} {'deadlines met':>14} {'utilisation':>12} {'on time':>8} {'mean wait':>12} {'refused':>8}")
    for policy, result in results.items():
        print(f"{policy:<10} {result.percent_met:>13.1f}% {100 * result.utilisation:>11.1f}% "
              f"{100 * result.on_time_utilisation:>7.1f}% {result.mean_wait.total_seconds() / 60:>10.1f} m "
              f"{result.refused:>8}")
    e31, fifo = results["e31"], results["fifo"]
    print(f"e31 vs FIFO: {e31.percent_met - fifo.percent_met:+.1f} points of deadlines met (goal >= +15); "
          f"utilisation ratio {e31.utilisation / fifo.utilisation:.3f} (goal >= 1.0), "
          f"on-time utilisation ratio {e31.on_time_utilisation / fifo.on_time_utilisation:.3f}")
    admit = results["fifo-admit"]
    print(f"under the same admission rule (runs that can no longer make it refused), FIFO uses "
          f"{100 * admit.utilisation:.1f}%: e31's utilisation ratio to it is {e31.utilisation / admit.utilisation:.3f}")
    times = decision_ms(10_000, args.seed)
    print(f"one decision, 10,000 waiting runs in a kept queue: {times['decision']:.3f} ms (goal <= 1 ms); "
          f"with the last decision's {RESERVATION_DEPTH} reservations handed in, 4 of them delayed: "
          f"{times['promised']:.3f} ms; "
          f"keeping the queue at a poll: {times['sync']:.2f} ms; deciding from an unsorted list: "
          f"{times['unsorted']:.2f} ms")
    learned_vs_limits(args.jobs, [int(seed) for seed in args.seeds.split(",")], args.gpus, args.kinds)


if __name__ == "__main__":
    main()
