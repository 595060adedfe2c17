"""Retrain a logistic model on the staged training set; writes model.json and metrics.json."""

from __future__ import annotations

import csv
import json
import math
import random

from prefect import flow, get_run_logger, task

from e31_prefect import data_dir, output_dir


@task
def load(name: str) -> list[tuple[float, float, int]]:
    with (data_dir() / name).open() as handle:
        return [(float(r["x1"]), float(r["x2"]), int(r["label"])) for r in csv.DictReader(handle)]


def predict(model: dict[str, float], x1: float, x2: float) -> float:
    return 1 / (1 + math.exp(-(model["w1"] * x1 + model["w2"] * x2 + model["b"])))


@task
def fit(rows, epochs: int, rate: float, seed: int) -> dict[str, float]:
    logger = get_run_logger()
    rng = random.Random(seed)
    model = {"w1": 0.0, "w2": 0.0, "b": 0.0}
    for epoch in range(1, epochs + 1):
        rng.shuffle(rows)
        loss = 0.0
        for x1, x2, y in rows:
            p = predict(model, x1, x2)
            loss -= math.log(p if y else 1 - p)
            model["w1"] -= rate * (p - y) * x1
            model["w2"] -= rate * (p - y) * x2
            model["b"] -= rate * (p - y)
        logger.info("epoch %d: mean log-loss %.4f", epoch, loss / len(rows))
    return model


@flow(name="retrain")
def retrain(epochs: int = 3, rate: float = 0.05) -> dict[str, float]:
    """Train on data/train.csv (80/20 split); return and write the held-out metrics."""
    import os

    rows = load("train.csv")
    split = int(len(rows) * 0.8)
    model = fit(rows[:split], epochs, rate, int(os.environ.get("SEED", "7")))
    held_out = rows[split:]
    correct = sum((predict(model, x1, x2) > 0.5) == bool(y) for x1, x2, y in held_out)
    metrics = {"accuracy": round(correct / len(held_out), 4), "epochs": epochs, "train_rows": split}
    (output_dir() / "model.json").write_text(json.dumps(model, indent=2))
    (output_dir() / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics
