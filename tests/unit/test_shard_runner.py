"""e31_prefect.flows.shard_runner with real processes (no Prefect): each shard's devices, folder, log and retries;
the runner as a process of its own, and started early."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from e31_prefect.flows.shard_runner import (
    NoDevicesForShards,
    ShardProcess,
    ShardsRunnerFailed,
    run_shards,
    start_early,
    take_early,
)
from e31_prefect.host.ledger import process_running
from e31_prefect.model.shards import SHARDS_VARIABLE, ShardSettings

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


def test_quiet_shards_leave_nothing_a_talking_one_its_log_and_a_writing_one_its_files(tmp_path):
    script = tmp_path / "quiet.py"
    script.write_text("import os\nindex = os.environ['E31_SHARD_INDEX']\n"
                      "if index == '5': print('only five talks')\n"
                      "if index == '7': open(os.path.join(os.environ['E31_OUTPUT_DIR'], 'x.npy'), 'w').close()\n")
    schedule = run_shards([sys.executable, str(script)], ShardSettings(count=20), {**os.environ,
                          "CUDA_VISIBLE_DEVICES": "0,1"}, tmp_path / "out")
    assert schedule.ok and schedule.succeeded == 20
    left = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*"))
    # No slot files, no empty logs, no empty folders.
    assert left == ["shard-5", "shard-5/shard.log", "shard-7", "shard-7/x.npy"]
    assert (tmp_path / "out" / "shard-5" / "shard.log").read_text() == "only five talks\n"


def test_what_a_shard_leaves_running_writes_to_its_own_log_not_the_next_shards(tmp_path):
    script = tmp_path / "leave.sh"
    # Shard 0 starts a process that speaks after shard 0 exited, while shard 1 runs on the same (only) slot.
    script.write_text('if [ "$E31_SHARD_INDEX" = 0 ]; then (sleep 1; echo "late from 0") & exit 0; fi\n'
                      'sleep 2; echo "shard $E31_SHARD_INDEX"\n')
    schedule = run_shards(["sh", str(script)], ShardSettings(count=2), {**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
                          tmp_path / "out")
    assert schedule.ok
    assert (tmp_path / "out" / "shard-0" / "shard.log").read_text() == "late from 0\n"
    assert (tmp_path / "out" / "shard-1" / "shard.log").read_text() == "shard 1\n"


def runner_env(tmp_path: Path, settings: ShardSettings, devices: str = "0,1", out: str = "out",
               **extra: str) -> dict[str, str]:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": devices, "E31_OUTPUT_DIR": str(tmp_path / out),
            SHARDS_VARIABLE: settings.to_text(), **extra}


def test_the_runner_process_reports_progress_each_failure_and_the_outcome(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    settings = ShardSettings(count=6, retries=1, allow_failed=1)
    shards = ShardProcess([sys.executable, str(script)], settings, runner_env(tmp_path, settings, FAIL_2="once",
                                                                              FAIL_4="always"))
    attempts, progress = [], []
    outcome = shards.follow(on_progress=progress.append, on_attempt=attempts.append)
    assert outcome.ok and outcome.succeeded == 5 and outcome.retried == 2 and list(outcome.failures) == [4]
    assert outcome.failures[4].tail.splitlines()[-1] == "shard 4: bad seed"
    assert sorted((a.shard, a.outcome, a.number) for a in attempts) == [(2, "retry", 1), (4, "failed", 2),
                                                                         (4, "retry", 1)]
    assert [a.failure for a in attempts if a.outcome == "failed"] == [outcome.failures[4]]
    assert progress[-1] == shards.progress and (progress[-1].done, progress[-1].failed) == (5, 1)


def test_a_runner_that_cannot_run_the_shards_says_why(tmp_path):
    settings = ShardSettings(count=2, gpus_per_shard=2)
    shards = ShardProcess(["true"], settings, runner_env(tmp_path, settings, devices="0"))
    with pytest.raises(ShardsRunnerFailed, match="each shard needs 2 GPU"):
        shards.follow()


def test_a_runner_killed_before_the_end_fails_the_shards_and_says_so(tmp_path):
    settings = ShardSettings(count=4)
    shards = ShardProcess(["sleep", "60"], settings, runner_env(tmp_path, settings))
    time.sleep(1)
    shards._process.kill()
    with pytest.raises(ShardsRunnerFailed, match="ended .* before the shards did"):
        shards.follow()


def test_shards_started_early_run_in_their_folder_and_are_taken_by_the_flow_once(tmp_path):
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "where.py").write_text("import os\nprint(os.getcwd())\n")
    command = ["python", "where.py"]
    settings = ShardSettings(count=3, command=command, folder=str(folder))
    start_early(runner_env(tmp_path, settings, out="mismatched"))
    with pytest.raises(RuntimeError, match="not the flow's"):  # the flow is given another command: said, not run
        take_early(["python", "other.py"])
    start_early(runner_env(tmp_path, settings))
    early = take_early(command)
    assert early is not None and take_early(command) is None
    assert early.follow().succeeded == 3
    assert {(tmp_path / "out" / f"shard-{i}" / "shard.log").read_text() for i in range(3)} == {f"{folder}\n"}


def test_nothing_starts_early_where_the_worker_did_not_name_the_command(tmp_path):
    start_early(runner_env(tmp_path, ShardSettings(count=3)))
    assert take_early(["true"]) is None and not (tmp_path / "out").exists()


def test_an_early_start_that_fails_fails_the_flow_that_takes_it(tmp_path):
    settings = ShardSettings(count=1, command=["true"], folder=str(tmp_path / "gone"))
    start_early(runner_env(tmp_path, settings))
    with pytest.raises(FileNotFoundError):
        take_early(["true"])


def test_a_shard_gets_the_signals_python_ignores_as_a_shell_would_give_them(tmp_path):
    # With SIGPIPE ignored (as in Python), `yes` would see a write error and say "Broken pipe".
    schedule = run_shards(["sh", "-c", "yes | head -n 1"], ShardSettings(count=1), {**os.environ,
                          "CUDA_VISIBLE_DEVICES": "0"}, tmp_path / "out")
    assert schedule.ok
    assert (tmp_path / "out" / "shard-0" / "shard.log").read_text() == "y\n"


def test_a_program_not_on_path_is_not_run_from_the_current_folder(tmp_path, monkeypatch):
    (tmp_path / "sim").write_text("#!/bin/sh\necho ran from the folder\n")
    (tmp_path / "sim").chmod(0o755)
    monkeypatch.chdir(tmp_path)
    schedule = run_shards(["sim"], ShardSettings(count=1, allow_failed=1), {"CUDA_VISIBLE_DEVICES": "0",
                                                                            "PATH": "/usr/bin:/bin"}, tmp_path / "out")
    assert schedule.failures[0].exit_code == 127 and "cannot start sim: not found on PATH" in schedule.failures[0].tail


def test_what_a_retried_attempt_leaves_running_keeps_a_log_of_its_own(tmp_path):
    script = tmp_path / "retry.sh"
    script.write_text('n=$(cat "$E31_OUTPUT_DIR/n" 2>/dev/null || echo 0); echo $((n + 1)) > "$E31_OUTPUT_DIR/n"\n'
                      'if [ "$n" = 0 ]; then echo "first try"; exit 1; fi\n'
                      '(sleep 1; echo "late from the retry") &\n')
    schedule = run_shards(["sh", str(script)], ShardSettings(count=1, retries=1), {**os.environ,
                          "CUDA_VISIBLE_DEVICES": "0"}, tmp_path / "out")
    assert schedule.ok and schedule.retried == 1
    folder = tmp_path / "out" / "shard-0"
    late = folder / "shard.log.2"
    deadline = time.monotonic() + 60  # the retry's background line comes a second after it, or later on a busy host
    while "late from the retry" not in late.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (folder / "shard.log").read_text() == "first try\n"
    assert late.read_text() == "--- e31: attempt 2 of shard 0 ---\nlate from the retry\n"


def test_shards_started_early_for_another_command_are_stopped_not_left_running(tmp_path):
    settings = ShardSettings(count=2, command=["sh", "-c", 'echo $$ > "$E31_OUTPUT_DIR/pid"; exec sleep 60'],
                             folder=str(tmp_path))
    start_early(runner_env(tmp_path, settings))
    pid_files = [tmp_path / "out" / f"shard-{i}" / "pid" for i in range(2)]
    deadline = time.monotonic() + 30
    while not all(path.exists() and path.read_text().strip() for path in pid_files) and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int(path.read_text()) for path in pid_files]
    assert all(process_running(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="not the flow's"):
        take_early(["sh", "-c", "true"])
    deadline = time.monotonic() + 10
    while any(process_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_running(pid) for pid in pids)
