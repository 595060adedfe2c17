"""A processing pass over footage: motion masks per frame and the moving object's track."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow, get_run_logger, task

from e31_prefect import data_dir, output_dir


def read_pgm(path: Path) -> tuple[int, int, bytes]:
    header, _, pixels = path.read_bytes().partition(b"\n")
    _, width, height, _ = header.split()
    return int(width), int(height), pixels


@task
def background(paths: list[Path]) -> list[int]:
    """Per-pixel median over all frames: what does not move."""
    stacks = [read_pgm(p)[2] for p in paths]
    return [sorted(column)[len(column) // 2] for column in zip(*stacks, strict=True)]


@task
def motion(path: Path, still: list[int], threshold: int) -> dict[str, object]:
    """Pixels far from the background, written as a mask frame; returns the blob's centre."""
    width, height, pixels = read_pgm(path)
    mask = bytes(255 if abs(p - b) > threshold else 0 for p, b in zip(pixels, still, strict=True))
    (output_dir() / "masks").mkdir(exist_ok=True)
    (output_dir() / "masks" / path.name).write_bytes(f"P5 {width} {height} 255\n".encode() + mask)
    moving = [i for i, value in enumerate(mask) if value]
    if not moving:
        return {"frame": path.name, "pixels": 0}
    xs, ys = [i % width for i in moving], [i // width for i in moving]
    return {"frame": path.name, "pixels": len(moving),
            "x": round(sum(xs) / len(xs), 2), "y": round(sum(ys) / len(ys), 2)}


@flow(name="footage-pass")
def process_footage(threshold: int = 60) -> dict[str, object]:
    """Subtract the background from every frame and track what moves."""
    paths = sorted((data_dir() / "frames").glob("*.pgm"))
    still = background(paths)
    track = [motion(p, still, threshold) for p in paths]
    (output_dir() / "track.json").write_text(json.dumps(track, indent=1))
    summary = {"frames": len(paths), "frames_with_motion": sum(1 for t in track if t["pixels"])}
    get_run_logger().info("Processed %(frames)d frames, motion in %(frames_with_motion)d", summary)
    return summary
