"""The reduce step of the ten thousand simulations: one summary and a histogram from every shard's night.

Run once by e31 after all shards, in the same rent:  python sims/summarize.py
Reads shard-<i>/finished.txt under E31_OUTPUT_DIR (each shard's night, from night.awk) and
writes summary.json and histogram.csv beside them. Shards that failed within the job's
allowance (E31_FAILED_SHARDS) are left out and counted.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path


def main() -> None:
    out = Path(os.environ["E31_OUTPUT_DIR"])
    count = int(os.environ["E31_SHARD_COUNT"])
    failed = {int(i) for i in os.environ.get("E31_FAILED_SHARDS", "").split(",") if i}
    results = [int((out / f"shard-{i}" / "finished.txt").read_text()) for i in range(count) if i not in failed]
    ordered = sorted(results)
    summary = {
        "simulations": len(results),
        "failed_shards": sorted(failed),
        "mean_finished": round(statistics.fmean(results), 3),
        "stdev": round(statistics.pstdev(results), 3),
        "p05": ordered[int(0.05 * len(ordered))],
        "p95": ordered[int(0.95 * len(ordered))],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    counts: dict[int, int] = {}
    for value in results:
        counts[value] = counts.get(value, 0) + 1
    (out / "histogram.csv").write_text("finished,nights\n" + "".join(f"{k},{counts[k]}\n" for k in sorted(counts)))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
