"""A learning-rate sweep of the retrain model: one rate per shard, then the best of them.

Each shard is one call of :func:`sweep` with its ``shard_index`` and ``shard_count``
(e31 gives them as parameters): shard i trains at ``lowest_rate * 2**i`` and writes
``metrics.json`` in its own ``shard-<i>/`` folder. Run as a script, this file is the
job's reduce step: it reads every shard's metrics and writes ``best.json``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
from pathlib import Path

from prefect import flow, get_run_logger

from e31_prefect import data_dir, output_dir


def predict(model: dict[str, float], x1: float, x2: float) -> float:
    return 1 / (1 + math.exp(-(model["w1"] * x1 + model["w2"] * x2 + model["b"])))


@flow(name="sweep")
def sweep(shard_index: int, shard_count: int, epochs: int = 3, lowest_rate: float = 0.005) -> dict[str, float]:
    """Train on data/train.csv (80/20 split) at this shard's rate; write and return the held-out accuracy."""
    rate = lowest_rate * 2**shard_index
    with (data_dir() / "train.csv").open() as handle:
        rows = [(float(r["x1"]), float(r["x2"]), int(r["label"])) for r in csv.DictReader(handle)]
    split = int(len(rows) * 0.8)
    train, held_out = rows[:split], rows[split:]
    rng = random.Random(int(os.environ.get("SEED", "7")))
    model = {"w1": 0.0, "w2": 0.0, "b": 0.0}
    for _ in range(epochs):
        rng.shuffle(train)
        for x1, x2, y in train:
            p = predict(model, x1, x2)
            model["w1"] -= rate * (p - y) * x1
            model["w2"] -= rate * (p - y) * x2
            model["b"] -= rate * (p - y)
    correct = sum((predict(model, x1, x2) > 0.5) == bool(y) for x1, x2, y in held_out)
    metrics = {"shard": shard_index, "rate": rate, "accuracy": round(correct / len(held_out), 4)}
    get_run_logger().info("shard %d of %d: rate %g, accuracy %.4f", shard_index, shard_count, rate,
                          metrics["accuracy"])
    (output_dir() / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def best() -> None:
    """The reduce step: the shards' metrics (those not failed, E31_FAILED_SHARDS) and the best rate."""
    out = Path(os.environ["E31_OUTPUT_DIR"])
    shards = [json.loads(path.read_text()) for path in sorted(out.glob("shard-*/metrics.json"))]
    winner = max(shards, key=lambda m: m["accuracy"])
    (out / "best.json").write_text(json.dumps({"best": winner, "tried": len(shards),
                                               "failed": os.environ.get("E31_FAILED_SHARDS", "")}, indent=2))


if __name__ == "__main__":
    best()
