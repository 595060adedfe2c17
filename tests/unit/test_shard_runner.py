"""e31_prefect.shard_runner with real processes (no Prefect): each shard's devices, folder, log and retries."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from e31_prefect.shard_runner import NoDevicesForShards, run_shards
from e31_prefect.shards import ShardSettings

PROBE = textwrap.dedent("""\
    import json, os, sys
    from pathlib import Path
    index = int(os.environ["E31_SHARD_INDEX"])
    out = Path(os.environ["E31_OUTPUT_DIR"])
    tries = out / "tries"
    tries.write_text(str(int(tries.read_text()) + 1 if tries.exists() else 1))
    seen = {k: os.environ.get(k) for k in ("E31_SHARD_COUNT", "SLURM_ARRAY_TASK_ID", "CUDA_VISIBLE_DEVICES",
                                          "NVIDIA_VISIBLE_DEVICES", "JOB_COMPLETION_INDEX")}
    (out / "seen.json").write_text(json.dumps(seen))
    print(f"shard {index} says hello")
    fail = os.environ.get("FAIL_" + str(index))
    if fail == "always" or (fail == "once" and tries.read_text() == "1"):
        print(f"shard {index}: bad seed", file=sys.stderr)
        sys.exit(3)
    """)


def run(tmp_path: Path, settings: ShardSettings, devices: str = "0,1,2,3", **fail: str):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": devices, **{f"FAIL_{k.removeprefix('s')}": v for k, v in fail.items()}}
    progress = []
    schedule = run_shards([sys.executable, str(script)], settings, env, tmp_path / "out", on_progress=progress.append)
    return schedule, progress


def seen(tmp_path: Path, shard: int) -> dict:
    return json.loads((tmp_path / "out" / f"shard-{shard}" / "seen.json").read_text())


def test_each_shard_sees_only_its_devices_its_index_and_its_folder(tmp_path):
    schedule, progress = run(tmp_path, ShardSettings(count=12, gpus_per_shard=2))
    assert schedule.ok and schedule.succeeded == 12
    for shard in range(12):
        view = seen(tmp_path, shard)
        assert view["CUDA_VISIBLE_DEVICES"] in ("0,1", "2,3")
        assert view["NVIDIA_VISIBLE_DEVICES"] == view["CUDA_VISIBLE_DEVICES"]
        assert view["SLURM_ARRAY_TASK_ID"] == view["JOB_COMPLETION_INDEX"] == str(shard)
        assert view["E31_SHARD_COUNT"] == "12"
        log = (tmp_path / "out" / f"shard-{shard}" / "shard.log").read_text()
        assert log == f"shard {shard} says hello\n"
    assert progress[-1].done == 12 and progress[-1].running == 0


def test_a_failing_shard_is_retried_and_one_failing_for_good_is_reported_with_its_last_lines(tmp_path):
    schedule, _ = run(tmp_path, ShardSettings(count=6, retries=1, allow_failed=1), s2="once", s4="always")
    assert schedule.ok and schedule.succeeded == 5 and schedule.retried == 2
    assert list(schedule.failures) == [4]
    failure = schedule.failures[4]
    assert failure.attempts == 2 and failure.exit_code == 3
    assert failure.tail.splitlines()[-1] == "shard 4: bad seed"
    log = (tmp_path / "out" / "shard-2" / "shard.log").read_text()
    assert "--- e31: attempt 2 of shard 2 ---" in log


def test_shards_failing_past_the_allowance_fail_the_job_and_stop_the_rest(tmp_path):
    schedule, _ = run(tmp_path, ShardSettings(count=40, gpus_per_shard=1), devices="0", s0="always")
    assert not schedule.ok and list(schedule.failures) == [0] and schedule.not_run == 39


def test_a_program_that_does_not_exist_fails_its_shards(tmp_path):
    settings = ShardSettings(count=2, allow_failed=1)
    schedule = run_shards(["/nonexistent/sim"], settings, {"CUDA_VISIBLE_DEVICES": "0"}, tmp_path)
    assert not schedule.ok and schedule.failures[0].exit_code == 127
    assert "cannot start /nonexistent/sim" in schedule.failures[0].tail


def test_a_job_seeing_fewer_devices_than_a_shard_needs_is_told_so(tmp_path):
    with pytest.raises(NoDevicesForShards, match="each shard needs 2 GPU"):
        run_shards(["true"], ShardSettings(count=2, gpus_per_shard=2), {"CUDA_VISIBLE_DEVICES": "0"}, tmp_path)
