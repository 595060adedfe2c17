"""Regenerate the example jobs' shipped data: python deployments/jobs/data/make_data.py

- train.csv (in deployments/data/, beside the jobs' folder) and batch.csv: two features and a label from a
  known noisy linear rule;
- model.json: a logistic model trained on train.csv (the inference example's model file);
- frames/: 24 grey 64x48 PGM frames of a bright square moving over a noisy background.
Deterministic (fixed seeds), so the committed files are what this script writes.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

HERE = Path(__file__).parent


def rows(n: int, seed: int) -> list[tuple[float, float, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        x1, x2 = rng.gauss(0, 1), rng.gauss(0, 1)
        logit = 1.5 * x1 - 2.0 * x2 + 0.3 + rng.gauss(0, 0.7)
        out.append((round(x1, 4), round(x2, 4), int(logit > 0)))
    return out


def write_csv(path: Path, data: list[tuple[float, float, int]]) -> None:
    path.write_text("x1,x2,label\n" + "".join(f"{a},{b},{c}\n" for a, b, c in data))


def train(data, epochs: int = 30, rate: float = 0.1) -> dict[str, float]:
    w1 = w2 = b = 0.0
    for _ in range(epochs):
        for x1, x2, y in data:
            p = 1 / (1 + math.exp(-(w1 * x1 + w2 * x2 + b)))
            w1, w2, b = w1 - rate * (p - y) * x1, w2 - rate * (p - y) * x2, b - rate * (p - y)
    return {"w1": round(w1, 6), "w2": round(w2, 6), "b": round(b, 6)}


def frames(count: int = 24, width: int = 64, height: int = 48) -> None:
    rng = random.Random(31)
    folder = HERE / "frames"
    folder.mkdir(exist_ok=True)
    for index in range(count):
        x0, y0 = 4 + index * 2, 10 + index
        pixels = bytearray()
        for y in range(height):
            for x in range(width):
                inside = x0 <= x < x0 + 10 and y0 <= y < y0 + 10
                pixels.append(220 if inside else 40 + rng.randint(0, 20))
        (folder / f"frame_{index:03d}.pgm").write_bytes(f"P5 {width} {height} 255\n".encode() + bytes(pixels))


if __name__ == "__main__":
    train_rows = rows(2000, seed=7)
    write_csv(HERE.parents[1] / "data" / "train.csv", train_rows)
    write_csv(HERE / "batch.csv", rows(500, seed=8))
    (HERE / "model.json").write_text(json.dumps(train(train_rows), indent=2) + "\n")
    frames()
