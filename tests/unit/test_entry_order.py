"""The order of a job entry's steps after its hand-over: a sharded command's shards start in the flow's folder
before Prefect's engine begins to load the flow (loading it takes a while on a busy host, every GPU idle)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from e31_prefect import job_entry


def test_the_shards_start_in_the_flows_folder_before_the_engine_runs(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    steps: list[tuple[str, str]] = []
    for quiet in ("prepare_engine", "_say_before_reporting", "take_report_seconds"):
        monkeypatch.setattr(job_entry, quiet, lambda: None)
    monkeypatch.setattr(job_entry, "wait_for_api", lambda url: None)
    monkeypatch.setattr(job_entry, "prepare_api", lambda stack: None)
    monkeypatch.setattr(job_entry, "start_shards", lambda: steps.append(("shards", os.getcwd())))
    monkeypatch.setattr(job_entry.runpy, "run_module", lambda name, **_: steps.append((name, os.getcwd())))
    for handed_elsewhere in (job_entry.WORK_ENDED_VARIABLE, job_entry.HAND_OVER_VARIABLE,
                             job_entry.API_SOCKET_VARIABLE):
        monkeypatch.delenv(handed_elsewhere, raising=False)
    monkeypatch.setenv(job_entry.FLOW_FOLDER_VARIABLE, str(tmp_path))
    monkeypatch.chdir("/")
    job_entry.main()
    assert steps == [("shards", str(tmp_path)), ("prefect.engine", str(tmp_path))]
    assert job_entry.FLOW_FOLDER_VARIABLE not in os.environ  # e31's word to the entry, not the job's
