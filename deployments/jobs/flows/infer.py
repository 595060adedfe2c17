"""Score a batch with a model file staged as data; writes predictions.csv and summary.json."""

from __future__ import annotations

import csv
import json
import math

from prefect import flow, get_run_logger

from e31_prefect import data_dir, output_dir


@flow(name="batch-inference")
def infer(threshold: float = 0.5) -> dict[str, float]:
    """Apply model.json to every row of batch.csv."""
    model = json.loads((data_dir() / "model.json").read_text())
    with (data_dir() / "batch.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    correct = 0
    with (output_dir() / "predictions.csv").open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["x1", "x2", "probability", "predicted"])
        for row in rows:
            x1, x2 = float(row["x1"]), float(row["x2"])
            p = 1 / (1 + math.exp(-(model["w1"] * x1 + model["w2"] * x2 + model["b"])))
            predicted = int(p > threshold)
            correct += predicted == int(row["label"])
            writer.writerow([x1, x2, round(p, 6), predicted])
    summary = {"rows": len(rows), "accuracy": round(correct / len(rows), 4)}
    (output_dir() / "summary.json").write_text(json.dumps(summary))
    get_run_logger().info("Scored %d rows, accuracy %.3f", len(rows), summary["accuracy"])
    return summary
