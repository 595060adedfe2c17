"""e31_prefect.flows.flow_shards with real processes (no Prefect server): a flow run as shards by the shard runner.

What a user notices: each shard's call got the job's parameters (typed as the flow says) and its own
shard, saw only its devices and wrote in its own folder; ``get_run_logger()`` lines land in the shard's
log; a raising or noisy shard fails alone with its last lines; a flow that cannot shard fails once,
before any shard, naming the flow and what to fix.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from e31_prefect.flows.flow_shards import SHARD_MODULE, FlowCannotShard, check_flow, run_flow_shards
from e31_prefect.flows.shard_runner import run_shards
from e31_prefect.model.shards import ShardSettings

FLOWS = """\
import json, os, sys
from prefect import flow, get_run_logger
from e31_prefect import output_dir

@flow
def sim(steps: int, shard_index: int, shard_count: int, scale: float = 1.0) -> int:
    get_run_logger().info("shard %d of %d running", shard_index, shard_count)
    seen = {"steps": steps, "steps_type": type(steps).__name__, "scale": scale, "index": shard_index,
            "count": shard_count, "env_index": os.environ["E31_SHARD_INDEX"],
            "devices": os.environ["CUDA_VISIBLE_DEVICES"]}
    (output_dir() / "seen.json").write_text(json.dumps(seen))
    if shard_index == 1:
        for line in range(20000):
            print("noise", line)
        raise ValueError("shard 1 cannot converge")
    return steps

@flow
async def later(shard_index: int, shard_count: int) -> None:
    (output_dir() / "async.txt").write_text(f"{shard_index}/{shard_count}")

@flow
def plain(steps: int) -> None: ...

@flow
def typed(steps: int, shard_index: int, shard_count: int) -> None: ...
"""


@pytest.fixture
def flows(tmp_path: Path) -> Path:
    path = tmp_path / "flows.py"
    path.write_text(FLOWS)
    return path


def run_flow(tmp_path: Path, entrypoint: str, parameters: dict, settings: ShardSettings, devices: str = "0,1"):
    given = tmp_path / "parameters.json"
    given.write_text(json.dumps(parameters))
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": devices, "PYTHONPATH": ":".join(sys.path)}
    return run_shards(["python", "-m", SHARD_MODULE, entrypoint, str(given)], settings, env, tmp_path / "out")


def test_each_flow_shard_is_a_call_with_the_jobs_parameters_and_its_own_shard_and_one_failing_fails_alone(
        tmp_path, flows):
    schedule = run_flow(tmp_path, f"{flows}:sim", {"steps": "40"}, ShardSettings(count=3, allow_failed=1))
    assert schedule.ok and schedule.succeeded == 2 and list(schedule.failures) == [1]
    for shard in (0, 2):
        seen = json.loads((tmp_path / "out" / f"shard-{shard}" / "seen.json").read_text())
        # "40" became 40, as a flow run's parameters would; the shard came as parameters and environment.
        assert seen == {"steps": 40, "steps_type": "int", "scale": 1.0, "index": shard, "count": 3,
                        "env_index": str(shard), "devices": seen["devices"]}
        assert seen["devices"] in ("0", "1")
        log = (tmp_path / "out" / f"shard-{shard}" / "shard.log").read_text()
        assert f"INFO shard {shard} of 3 running" in log
    failure = schedule.failures[1]
    assert failure.exit_code == 1
    assert failure.tail.strip().splitlines()[-1] == "ValueError: shard 1 cannot converge"
    assert len(failure.tail) < 20_000  # twenty thousand lines of noise: only the last of them are kept


def test_an_async_flow_runs_as_shards(tmp_path, flows):
    schedule = run_flow(tmp_path, f"{flows}:later", {}, ShardSettings(count=2, gpus_per_shard=0, shards_per_gpu=2))
    assert schedule.ok
    assert [(tmp_path / "out" / f"shard-{i}" / "async.txt").read_text() for i in range(2)] == ["0/2", "1/2"]


@pytest.mark.parametrize("function, parameters, message", [
    ("plain", {"steps": 3}, "The flow {flows}:plain cannot receive its shard: plain takes no shard_index or "
                            "shard_count parameter, which each shard of a sharded flow receives; add them "
                            "(def plain(..., shard_index: int, shard_count: int)) or remove work.shards"),
    ("typed", {"steps": 3, "shard_index": 0}, "The flow {flows}:typed is given shard_index in its parameters; "
                                              "e31 gives each shard its own"),
    ("typed", {"steps": "many"}, "The flow {flows}:typed refuses the job's parameters: "),
    ("typed", {}, "The flow {flows}:typed refuses the job's parameters: "),
    ("absent", {}, "The flow {flows}:absent cannot be loaded: "),
])
def test_a_flow_that_cannot_shard_fails_once_naming_the_flow_and_the_fix(flows, function, parameters, message):
    with pytest.raises(FlowCannotShard) as caught:
        check_flow(f"{flows}:{function}", parameters, 4)
    assert str(caught.value).startswith(message.format(flows=flows))


def test_a_flow_that_can_shard_passes_the_check(flows):
    check_flow(f"{flows}:typed", {"steps": "3"}, 4)


@pytest.mark.parametrize("flow, parameters, message", [
    (["flows.py:sim"], {}, "flow = ['flows.py:sim']: is not a flow entrypoint"),
    ("flows.py:sim", [1, 2], "parameters = [1, 2]: is not a mapping of the flow's parameters"),
])
def test_a_hand_written_deployments_odd_parameters_are_refused_before_any_shard(monkeypatch, flow, parameters,
                                                                                message):
    monkeypatch.setenv("E31_SHARDS", ShardSettings(count=2).to_text())
    with pytest.raises(FlowCannotShard, match=message.replace("[", r"\[").replace("]", r"\]")):
        run_flow_shards.fn(flow, parameters)


def test_e31s_flow_shards_without_shards_says_what_to_do(monkeypatch):
    monkeypatch.delenv("E31_SHARDS", raising=False)
    with pytest.raises(FlowCannotShard, match="this job has no work.shards; set it"):
        run_flow_shards.fn("flows.py:sim", {})
