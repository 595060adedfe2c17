"""Staging a 256+ MiB prefix: e31's staging against s3fs's recursive get and boto3's transfer manager.

    python benchmarks/staging.py [--rounds 3] [--small 2000] [--large 4] [--large-mib 48] [--no-job]

All on one moto S3 server (started here as its own process, so the client
measured never shares an interpreter with it), over HTTP:

- cold: the prefix into an empty folder, with e31 (`stage_inputs`, empty
  content cache), with `s3fs.S3FileSystem.get(recursive=True)` and with
  boto3's `TransferManager` (one download per object, default config); the
  three alternate round by round so machine noise falls on each; medians;
- cached: e31 staging the same prefix again with the cache the cold stage
  filled (a nightly job re-reading an unchanged data set);
- GPU-seconds held while staging: a real job (`e31 run`, E31_GPUS=1xH100,
  gpus: 1) stages the prefix; its meter artifact says when staging ended and
  when the GPU was rented.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from overhead import free_port, start_server

BUCKET = "bench"
PREFIX = "dataset/"
KEY, SECRET = "bench-key", "bench-secret"
CACHE_BYTES = 100 << 30


def start_moto(home: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = (home / "moto.log").open("wb")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    import httpx

    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            httpx.get(f"{url}/moto-api/", timeout=2)
            return server, url
        except httpx.HTTPError:
            time.sleep(0.5)
    raise SystemExit("moto's server did not start")


def boto_client(url: str):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=url, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                        region_name="us-east-1", config=Config(max_pool_connections=32))


def populate(url: str, small: int, large: int, large_mib: int) -> tuple[int, int]:
    """Many small files (4-64 KiB, in folders of 100) and a few large ones; returns (files, bytes)."""
    s3 = boto_client(url)
    s3.create_bucket(Bucket=BUCKET)
    rng = random.Random(31)
    objects = {f"{PREFIX}small/{n // 100:03d}/{n:05d}.bin": rng.randbytes(rng.randint(4096, 65536))
               for n in range(small)}
    objects.update({f"{PREFIX}large/{n}.bin": os.urandom(large_mib << 20) for n in range(large)})
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda item: s3.put_object(Bucket=BUCKET, Key=item[0], Body=item[1]), objects.items()))
    return len(objects), sum(len(v) for v in objects.values())


def tree_bytes(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def fresh(path: Path, cache_dir: Path | None) -> Path:
    """``path`` emptied, its links into the cache at ``cache_dir`` (that of the e31 stage that filled it, if one
    did) released through that cache, as a worker removes a run's workspace through the host's: a link unlinked
    any other way moves its entry's change time, and the next hit takes that for a write and fetches it again."""
    from e31_prefect.data.cache import ContentCache
    from e31_prefect.data.staging import remove_workspace

    remove_workspace(path, ContentCache(cache_dir, CACHE_BYTES) if cache_dir else False)
    return path


def options(url: str) -> dict:
    return {"s3": {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": url}}}


def e31_stage(url: str, target: Path, cache_dir: Path, cached: bool = False) -> float:
    """Seconds for e31 to stage the prefix into ``target`` through the cache at ``cache_dir``; a ``cached``
    re-stage that downloads anything stops the benchmark (its time would be no cached figure)."""
    from e31_prefect.data.cache import ContentCache
    from e31_prefect.data.staging import stage_inputs
    from e31_prefect.model.job import DataInput

    started = time.perf_counter()
    staged = stage_inputs([DataInput(source=f"s3://{BUCKET}/{PREFIX}", to="d")], target, options(url),
                          cache=ContentCache(cache_dir, CACHE_BYTES))
    seconds = time.perf_counter() - started
    if cached and staged.downloaded_bytes:
        raise SystemExit(f"the cached re-stage downloaded {staged.downloaded_bytes} bytes: {staged}")
    return seconds


def e31_listing(url: str) -> float:
    """Seconds for e31's own listing of the prefix: what a cached re-stage must still ask the store."""
    from e31_prefect.data import store

    fs, root = store.filesystem(f"s3://{BUCKET}/{PREFIX}", options(url))
    started = time.perf_counter()
    listed, _ = store.listing(fs, root.rstrip("/"), True)
    for _ in listed:  # its objects come as the pages arrive
        pass
    return time.perf_counter() - started


def s3fs_get(url: str, target: Path) -> float:
    import s3fs

    started = time.perf_counter()
    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs={"endpoint_url": url}, skip_instance_cache=True)
    fs.get(f"{BUCKET}/{PREFIX}", str(target) + "/", recursive=True)
    return time.perf_counter() - started


def boto3_transfer(url: str, target: Path) -> float:
    from boto3.s3.transfer import TransferManager

    started = time.perf_counter()
    s3 = boto_client(url)
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=PREFIX)
            for o in page.get("Contents", [])]
    with TransferManager(s3) as manager:
        futures = []
        for key in keys:
            local = target / key.removeprefix(PREFIX)
            local.parent.mkdir(parents=True, exist_ok=True)
            futures.append(manager.download(BUCKET, key, str(local)))
        for future in futures:
            future.result()
    return time.perf_counter() - started


JOB = """
name: stage-bench
work: {{flow: flow.py:count}}
data: [{{from: "s3://{bucket}/{prefix}", to: d}}]
request: {{gpus: 1, max_duration: 30m}}
"""

FLOW = """
from prefect import flow
from e31_prefect import data_dir

@flow
def count():
    return sum(1 for p in data_dir().rglob("*") if p.is_file())
"""


def gpu_seconds_while_staging(url: str, home: Path) -> dict[str, float]:
    """Run a 1-GPU job staging the prefix through a real worker; read its meter artifact."""
    server, api = start_server(home)
    try:
        folder = home / "job"
        folder.mkdir()
        (folder / "job.yaml").write_text(JOB.format(bucket=BUCKET, prefix=PREFIX))
        (folder / "flow.py").write_text(FLOW)
        env = {**os.environ, "E31_GPUS": "1xH100", "E31_HOME": str(home / "e31"), "AWS_ENDPOINT_URL": url,
               "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1"}
        e31 = shutil.which("e31", path=str(Path(sys.executable).parent)) or "e31"
        result = subprocess.run([e31, "run", str(folder / "job.yaml"), "--now", "--pool", "stage-bench"],
                                env=env, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            raise SystemExit(f"the job failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
        run_id = next(line.split("(", 1)[1].split(")", 1)[0] for line in result.stdout.splitlines()
                      if line.startswith("Submitted flow run"))
        rows = meter_rows(run_id)
    finally:
        if server is not None:
            os.killpg(server.pid, 15)
    steps = {row["step"]: row for row in rows}
    from datetime import datetime

    at = {step: datetime.fromisoformat(row["at"]) for step, row in steps.items() if row["at"]}
    held_while_staging = max(0.0, (at["staged"] - at["rented"]).total_seconds()) if "rented" in at else 0.0
    return {
        "staging_s": float(steps["staged"]["seconds"]),
        "rented_after_staged_s": (at["rented"] - at["staged"]).total_seconds(),
        "billed_gpu_s": float(steps["total billed"]["meaning"].split("=")[1].split()[0]),
        "gpu_s_while_staging": held_while_staging,
    }


def meter_rows(run_id: str) -> list[dict]:
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(run_id)])))
    meter = next(a for a in artifacts if a.key and a.key.startswith("e31-meter"))
    return json.loads(meter.data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small", type=int, default=2000, help="small files (4-64 KiB)")
    parser.add_argument("--large", type=int, default=4, help="large files")
    parser.add_argument("--large-mib", type=int, default=48, help="size of each large file (MiB)")
    parser.add_argument("--no-job", action="store_true", help="skip the e31 run measuring GPU-seconds")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="e31-stage-bench-"))
    moto, url = start_moto(home)
    try:
        files, size = populate(url, args.small, args.large, args.large_mib)
        print(f"prefix s3://{BUCKET}/{PREFIX}: {files} files, {size / 2**20:.1f} MiB "
              f"({args.small} small of 4-64 KiB, {args.large} of {args.large_mib} MiB); moto at {url}")
        if size < 256 * 2**20:
            print("note: the prefix is under 256 MiB")
        # First, before this process imports Prefect: the job's worker and server then stop.
        figures = None if args.no_job else gpu_seconds_while_staging(url, home)
        times: dict[str, list[float]] = {"e31": [], "s3fs get": [], "boto3 TransferManager": [], "e31 cached": [],
                                         "listing alone": []}
        methods = [("e31", lambda t, n: e31_stage(url, t, home / f"cache{n}")),
                   ("s3fs get", lambda t, n: s3fs_get(url, t)),
                   ("boto3 TransferManager", lambda t, n: boto3_transfer(url, t))]
        linked_from = None  # the cache the last e31 stage into the target linked its files from
        for n in range(args.rounds):
            for name, method in methods[n % 3:] + methods[:n % 3]:
                target = fresh(home / "target", linked_from)
                times[name].append(method(target, n))
                linked_from = home / f"cache{n}" if name == "e31" else None
                got = tree_bytes(target)
                assert got == (files, size), f"{name} staged {got}, expected {(files, size)}"
            target = fresh(home / "target", linked_from)
            times["e31 cached"].append(e31_stage(url, target, home / f"cache{n}", cached=True))
            linked_from = home / f"cache{n}"
            assert tree_bytes(target) == (files, size)
            times["listing alone"].append(e31_listing(url))
            print(f"round {n + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
        median = {name: statistics.median(values) for name, values in times.items()}
        rate = {name: size / 1e6 / seconds for name, seconds in median.items()}
        print(f"\n| method | median seconds | MB/s (medians of {args.rounds}) |\n| --- | --- | --- |")
        for name in [name for name in times if name != "listing alone"]:
            print(f"| {name} | {median[name]:.2f} | {rate[name]:.1f} |")
        best = max(("s3fs get", "boto3 TransferManager"), key=lambda name: rate[name])
        print(f"\ne31 / best baseline ({best}): {rate['e31'] / rate[best]:.2f} (goal >= 1.0)")
        print(f"cached re-stage vs cold: {median['e31'] / median['e31 cached']:.1f}x faster (goal >= 15; the first "
              "goal, 50, is out of reach of a re-stage that must list the prefix); "
              f"the listing alone, which it cannot skip: {median['listing alone']:.2f} s")
        if figures:
            print(f"e31 run (1 GPU): staging {figures['staging_s']:.2f} s, GPU rented "
                  f"{figures['rented_after_staged_s']:.3f} s after staging ended, billed "
                  f"{figures['billed_gpu_s']:.3f} GPU-s; GPU-seconds held while staging: "
                  f"{figures['gpu_s_while_staging']:.1f} (goal 0)")
    finally:
        os.killpg(moto.pid, 15)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
