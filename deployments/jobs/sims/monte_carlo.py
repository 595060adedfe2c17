"""Ten thousand simulations: a Monte Carlo of a queue of GPU jobs, aggregated.

Each simulation runs one night of a 4-GPU host taking jobs whose lengths are
random; it records how many finished by 07:00. Usage: python monte_carlo.py --n 10000
Writes summary.json (and histogram.csv) to E31_OUTPUT_DIR.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import statistics
from pathlib import Path


def one_night(rng: random.Random, gpus: int = 4, hours: float = 9.0) -> int:
    free_at = [0.0] * gpus
    finished = 0
    while True:
        start = heapq.heappop(free_at)
        end = start + rng.expovariate(1 / 1.2)
        if end > hours:
            return finished
        finished += 1
        heapq.heappush(free_at, end)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=int(os.environ.get("SEED", "31")))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    results = [one_night(rng) for _ in range(args.n)]
    out = Path(os.environ["E31_OUTPUT_DIR"])
    summary = {
        "simulations": args.n,
        "mean_finished": round(statistics.fmean(results), 3),
        "stdev": round(statistics.pstdev(results), 3),
        "p05": sorted(results)[int(0.05 * args.n)],
        "p95": sorted(results)[int(0.95 * args.n)],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    counts: dict[int, int] = {}
    for value in results:
        counts[value] = counts.get(value, 0) + 1
    (out / "histogram.csv").write_text("finished,nights\n" + "".join(f"{k},{counts[k]}\n" for k in sorted(counts)))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
