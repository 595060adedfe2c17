"""A job's entry forked from the warm interpreter sets Prefect's logging up again only where the run's environment
would give it another setup than the interpreter's (a level, a logging file): never the interpreter's by mistake."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# As the warm interpreter and then a job's entry do, in one process of its own (logging is process-wide).
FORKED_ENTRY = textwrap.dedent("""
    import json, logging, os, sys
    from e31_prefect import job_entry
    job_entry.prepare_engine()
    job_entry.remember_logging()
    import prefect.logging.configuration as configuration
    calls = []
    real = configuration.setup_logging
    configuration.setup_logging = lambda **kw: (calls.append(kw), real(**kw))[1]
    os.environ.update(json.loads(sys.argv[1]))
    job_entry.read_settings_again()
    print(json.dumps({"set_up_again": len(calls), "prefect": logging.getLogger("prefect").getEffectiveLevel()}))
    """)


def entry_with(tmp_path: Path, env: dict[str, str]) -> dict[str, int]:
    interpreter_home = tmp_path / "interpreter"
    interpreter_home.mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, "-c", FORKED_ENTRY, json.dumps(env)], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PREFECT_HOME": str(interpreter_home)}, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_run_whose_environment_changes_nothing_of_logging_keeps_the_interpreters_setup(tmp_path):
    run_home = tmp_path / "run"
    run_home.mkdir()
    seen = entry_with(tmp_path, {"PREFECT_HOME": str(run_home), "PREFECT_API_URL": "http://127.0.0.1:9/api"})
    assert seen == {"set_up_again": 0, "prefect": 20}


@pytest.mark.parametrize("variable", ["PREFECT_LOGGING_LEVEL", "PREFECT_LOGGING_LOGGERS_PREFECT_LEVEL"])
def test_a_logging_variable_of_the_run_sets_logging_up_again(tmp_path, variable):
    assert entry_with(tmp_path, {variable: "DEBUG"}) == {"set_up_again": 1, "prefect": 10}


def test_a_logging_file_in_the_runs_prefect_home_is_read(tmp_path):
    run_home = tmp_path / "run"
    run_home.mkdir()
    (run_home / "logging.yml").write_text(textwrap.dedent("""
        version: 1
        disable_existing_loggers: false
        loggers:
          prefect: {level: WARNING}
        """))
    assert entry_with(tmp_path, {"PREFECT_HOME": str(run_home)}) == {"set_up_again": 1, "prefect": 30}
