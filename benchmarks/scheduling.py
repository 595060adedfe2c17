"""Deadline-aware scheduling on a 32-GPU pool: FIFO (Prefect's order), plain EDF and e31's policy.

    python benchmarks/scheduling.py [--jobs 2000] [--seed 31] [--gpus 32]

A seeded trace: jobs of 1-8 GPUs running minutes to hours, deadlines of
varying slack (some none), submissions through three days and a burst at
22:00 on the last night (about 105% load: more work than GPUs, so order matters).
Each policy replays it through `e31_prefect.scheduling.simulate`, the decision
function the worker uses. Printed: deadlines met, GPU utilisation, mean wait,
and e31's gain in deadlines met over FIFO (project goal: at least 15 points
at no lower utilisation). Then the time of one decision with 10,000 waiting
runs (project goal: at most 1 ms).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from datetime import datetime, timedelta, timezone

from e31_prefect.inventory import Device
from e31_prefect.scheduling import POLICIES, Busy, TraceJob, WaitingRun, decide, simulate


def trace(jobs: int, seed: int, days: int = 3) -> list[TraceJob]:
    """Submissions through ``days`` days, a tenth of them in a burst at 22:00 on the last: about 105% load."""
    rng = random.Random(seed)
    first = datetime(2026, 12, 2, tzinfo=timezone.utc)
    burst = first + timedelta(days=days - 1, hours=22)
    made = []
    for index in range(jobs):
        if rng.random() < 0.1:
            submit = burst + timedelta(seconds=rng.uniform(0, 600))
        else:
            submit = first + timedelta(seconds=rng.uniform(0, (days - 1) * 86400 + 22 * 3600))
        gpus = rng.choices([1, 2, 4, 8], weights=[50, 25, 15, 10])[0]
        minutes = min(360.0, max(3.0, math.exp(rng.gauss(math.log(20), 0.9))))
        duration = timedelta(minutes=minutes)
        roll = rng.random()
        if roll < 0.15:
            deadline = None
        elif submit >= burst:
            deadline = burst.replace(hour=7) + timedelta(days=1)  # the nightly batch: done by 07:00
        else:
            deadline = submit + duration * rng.uniform(1.2, 6.0)
        made.append(TraceJob(index, submit, gpus, duration, deadline, priority=rng.choice([0, 0, 0, 1])))
    return made


def one_decision_ms(waiting_count: int, seed: int) -> float:
    """Median wall time of one decision with ``waiting_count`` waiting runs on a busy 32-GPU host."""
    rng = random.Random(seed)
    now = datetime(2026, 12, 2, 22, tzinfo=timezone.utc)
    waiting = [WaitingRun(i, rng.choice([1, 2, 4, 8]), None, now - timedelta(seconds=rng.uniform(0, 3600)),
                          latest_start=now + timedelta(minutes=rng.uniform(1, 600)), priority=rng.choice([0, 1]),
                          duration=timedelta(minutes=rng.uniform(5, 300))) for i in range(waiting_count)]
    devices = [Device(i, "H100") for i in range(32)]
    busy = [Busy(d, now + timedelta(minutes=rng.uniform(1, 120))) for d in devices[4:]]
    timings = []
    for _ in range(15):
        started = time.perf_counter()
        decide(waiting, devices[:4], now, busy)
        timings.append((time.perf_counter() - started) * 1000)
    return statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--gpus", type=int, default=32)
    args = parser.parse_args()
    jobs = trace(args.jobs, args.seed)
    results = {policy: simulate(jobs, policy, args.gpus) for policy in POLICIES}
    print(f"trace: {args.jobs} jobs (seed {args.seed}), {results['e31'].with_deadline} with a deadline, "
          f"{args.gpus} GPUs")
    print(f"{'policy':<6} {'deadlines met':>14} {'utilisation':>12} {'mean wait':>12} {'refused':>8}")
    for policy, result in results.items():
        print(f"{policy:<6} {result.percent_met:>13.1f}% {100 * result.utilisation:>11.1f}% "
              f"{result.mean_wait.total_seconds() / 60:>10.1f} m {result.refused:>8}")
    gain = results["e31"].percent_met - results["fifo"].percent_met
    ratio = results["e31"].utilisation / results["fifo"].utilisation
    print(f"e31 vs FIFO: {gain:+.1f} points of deadlines met (goal >= +15), utilisation ratio {ratio:.3f} "
          "(goal >= 1.0)")
    print(f"one decision, 10,000 waiting runs: {one_decision_ms(10_000, args.seed):.2f} ms (goal <= 1 ms)")


if __name__ == "__main__":
    main()
