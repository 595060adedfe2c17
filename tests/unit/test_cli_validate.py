"""``e31 validate`` of hostile job files: exit 2, a header line, one line per problem, no traceback.

Each file goes through ``cli.main`` in process; the alias bomb, which hung the command on main,
also goes through the real command line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from e31_prefect import cli
from tests.unit.test_job import ALIAS_BOMB, COMMAND_JOB

REPO = Path(__file__).resolve().parents[2]

HOSTILE: dict[str, tuple[str | bytes, str]] = {
    "alias-bomb": (ALIAS_BOMB, "work.parameters.a = '&a': is a YAML anchor"),
    "deep-nesting": ("work: {parameters: " + "[" * 10_000 + "]" * 10_000 + "}\n", "job file = "),
    "non-utf8": (b"work: {command: [echo, \xff]}\nrequest: {max_duration: 1h}\n", "job file = "),
    "5000-digits": ("work: {command: [echo]}\nrequest: {max_duration: 1h, gpus: " + "9" * 5000 + "}\n",
                    "request.gpus = '9999"),
    "year-1": ("work: {command: [echo]}\nrequest: {max_duration: 1h, deadline: 0001-01-01T00:00:00Z}\n",
               "request.deadline = '0001-01-01T00:00:00Z': "),
    "duplicate-key": ("work:\n  command: [echo]\n  env: {SEED: 1, SEED: 2}\nrequest: {max_duration: 1h}\n",
                      "work.env.SEED: is given twice"),
    "nul": ('work: {command: [echo, "a\\0b"]}\nrequest: {max_duration: 1h}\n', "work.command = 'a\\x00b': "),
    "glob": (COMMAND_JOB + "output: {expect: ['*.json']}\n", "output.expect = '*.json': is a pattern"),
    "overlap": (COMMAND_JOB + "data: [{from: s3://b/d/, to: x}, {from: s3://b/f, to: x/y}]\n",
                "data.to = 'x/y': is inside x, where s3://b/d/ is staged"),
}


@pytest.mark.parametrize(("text", "line"), HOSTILE.values(), ids=HOSTILE)
def test_validate_refuses_a_hostile_job_file_one_line_per_problem(tmp_path: Path, capsys, text, line):
    path = tmp_path / "job.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    assert cli.main(["validate", str(path)]) == cli.EXIT_INVALID
    out, err = capsys.readouterr()
    header, *problems = err.splitlines()
    assert (out, header) == ("", f"{path}: the job is not valid")
    assert problems and all(problem.startswith("  ") for problem in problems), err
    assert any(problem.strip().startswith(line) for problem in problems), err


def test_validate_still_prints_a_valid_job(tmp_path: Path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(COMMAND_JOB)
    assert cli.main(["validate", str(path)]) == 0
    assert "command:" in capsys.readouterr().out


def test_the_e31_validate_command_refuses_an_alias_bomb_without_a_traceback(tmp_path: Path):
    path = tmp_path / "bomb.yaml"
    path.write_text(ALIAS_BOMB)
    # The timeout only keeps a regression from hanging the suite; the assertions are about what is said.
    result = subprocess.run([sys.executable, "-m", "e31_prefect.cli", "validate", str(path)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == cli.EXIT_INVALID, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[1:] == [
        "  work.parameters.a = '&a': is a YAML anchor; "
        "job files use no anchors (&) or aliases (*): write each value out"
    ]
