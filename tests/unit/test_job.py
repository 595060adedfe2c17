"""Unit tests for e31_prefect.job: parsing, validation messages, job files, anchoring, plans.

Job files are written into pytest's ``tmp_path``; nothing talks to Prefect. Each bad input
must give a :class:`JobError` whose problems name the job file's own field, and whose text
shows the value as written and what to do about it.
"""

from __future__ import annotations

import copy
import textwrap
from datetime import datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from e31_prefect.job import (
    MISSING,
    OUTPUT_PLACEHOLDERS,
    Job,
    JobError,
    Problem,
    anchor_url,
    load_job_file,
    parse_job,
    plan,
    plan_problems,
)

UTC = timezone.utc
PARIS = ZoneInfo("Europe/Paris")

FLOW_SOURCE = textwrap.dedent(
    """\
    from prefect import flow


    @flow
    def retrain(epochs: int = 1):
        return epochs


    async def evaluate():
        return None
    """
)

VALID_JOB = textwrap.dedent(
    """\
    name: retrain-tonight
    team: vision
    timezone: Europe/Paris
    work:
      flow: flows/retrain.py:retrain
      parameters: {epochs: 3}
      env: {SEED: 7}
    data:
      - from: file://./data/train.csv
        to: train.csv
      - from: ./data/frames/
      - from: s3://datasets/footage/2026-12-01/
        sha256: 9F86D081884C7D659A2FEAA0C55AD015A3BF4F1B2B0B822CD15D6C15B0F00A08
    request:
      gpus: 1
      gpu_type: H100
      max_duration: 20m
      start: "22:00"
      deadline: "07:00"
      priority: 2
    output:
      to: file://./outputs/{job}/{flow_run.name}/
      expect: [model.json, metrics.json]
    """
)


def base_job(**request) -> dict:
    """A minimal valid job as raw data (a command, a one-hour limit), with request overrides."""
    return {
        "name": "j",
        "work": {"command": ["true"]},
        "request": {"max_duration": "1h", **request},
    }


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def job_folder(tmp_path: Path) -> Path:
    write(tmp_path, "flows/retrain.py", FLOW_SOURCE)
    return tmp_path


def problems_of(data) -> list[Problem]:
    with pytest.raises(JobError) as caught:
        parse_job(data)
    return caught.value.problems


def only_problem(data) -> Problem:
    problems = problems_of(data)
    assert len(problems) == 1, problems
    return problems[0]


# -- a valid job ------------------------------------------------------------------------------


def test_valid_job_file_loads_with_every_field(job_folder: Path):
    job = load_job_file(write(job_folder, "retrain.yaml", VALID_JOB))
    base = job_folder.resolve()
    assert job.name == "retrain-tonight"
    assert job.team == "vision"
    assert job.tz == PARIS
    assert job.work.flow == "flows/retrain.py:retrain"
    assert job.work.command is None
    assert job.work.parameters == {"epochs": 3}
    assert job.work.env == {"SEED": "7"}
    assert [d.source for d in job.data] == [
        f"file://{base}/data/train.csv",
        f"file://{base}/data/frames/",
        "s3://datasets/footage/2026-12-01/",
    ]
    assert [d.target for d in job.data] == ["train.csv", "frames", "2026-12-01"]
    assert job.data[2].sha256 == "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    assert job.request.gpus == 1
    assert job.request.gpu_type == "H100"
    assert job.request.max_duration == timedelta(minutes=20)
    assert job.request.time_limit == timedelta(minutes=20)
    assert job.request.admission_duration == timedelta(minutes=20)
    assert (job.request.start, job.request.deadline, job.request.priority) == ("22:00", "07:00", 2)
    assert job.output.to == f"file://{base}/outputs/{{job}}/{{flow_run.name}}/"
    assert job.output.expect == ["model.json", "metrics.json"]


def test_job_name_defaults_to_the_file_stem(job_folder: Path):
    text = VALID_JOB.replace("name: retrain-tonight\n", "")
    assert load_job_file(write(job_folder, "nightly-retrain.yaml", text)).name == "nightly-retrain"


def test_job_name_in_the_file_wins_over_the_stem(job_folder: Path):
    assert load_job_file(write(job_folder, "other.yaml", VALID_JOB)).name == "retrain-tonight"


def test_command_as_a_string_is_split_like_a_shell(tmp_path: Path):
    job = load_job_file(write(tmp_path, "sims.yaml", """\
        work:
          command: python sims/monte_carlo.py --n "10 000"
        request:
          until_done: true
          expected_duration: 5m
          deadline: +2h
        """))
    assert job.work.command == ["python", "sims/monte_carlo.py", "--n", "10 000"]
    assert job.request.time_limit is None
    assert job.request.admission_duration == timedelta(minutes=5)


def test_command_numbers_are_read_as_arguments(tmp_path: Path):
    job = load_job_file(write(tmp_path, "sims.yaml", """\
        work: {command: [python, sim.py, --n, 10000, --lr, 0.5]}
        request: {max_duration: 1h}
        """))
    assert job.work.command == ["python", "sim.py", "--n", "10000", "--lr", "0.5"]


@pytest.mark.parametrize(
    ("written", "argument"), [("0755", "0755"), ("yes", "yes"), ("off", "off"), ("0x10", "0x10")]
)
def test_command_items_are_the_text_as_written(tmp_path: Path, written: str, argument: str):
    job = load_job_file(write(tmp_path, "j.yaml", f"""\
        work: {{command: [tool, {written}, run.sh]}}
        request: {{max_duration: 1h}}
        """))
    assert job.work.command == ["tool", argument, "run.sh"]


@pytest.mark.parametrize("item", [{"--n": 5}, None, ["a", "b"]])
def test_command_item_that_is_not_a_scalar_is_a_job_error(item):
    data = base_job()
    data["work"] = {"command": ["python", "x.py", item]}
    assert only_problem(data).field == "work.command"


def test_async_flow_function_counts_as_defined(job_folder: Path):
    text = VALID_JOB.replace("flows/retrain.py:retrain", "flows/retrain.py:evaluate")
    job = load_job_file(write(job_folder, "eval.yaml", text))
    assert job.work.flow == "flows/retrain.py:evaluate"


# -- anchoring local paths --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("data/x.csv", "file://{base}/data/x.csv"),
        ("./data/x.csv", "file://{base}/data/x.csv"),
        ("file://./data/x.csv", "file://{base}/data/x.csv"),
        ("file://data/dir/", "file://{base}/data/dir/"),
        ("../shared/x.csv", "file://{parent}/shared/x.csv"),
        ("/srv/data/x.csv", "file:///srv/data/x.csv"),
        ("file:///srv/data/x.csv", "file:///srv/data/x.csv"),
        ("s3://bucket/key.csv", "s3://bucket/key.csv"),
        ("s3://bucket/prefix/", "s3://bucket/prefix/"),
    ],
)
def test_anchor_url(tmp_path: Path, url: str, expected: str):
    base = tmp_path.resolve()
    assert anchor_url(url, base) == expected.format(base=base, parent=base.parent)


def test_relative_paths_are_anchored_to_the_job_files_folder_not_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    folder = tmp_path / "project" / "jobs"
    write(folder, "j.yaml", """\
        work: {command: [echo, hi]}
        data: [{from: inputs/a.csv}]
        request: {max_duration: 1h}
        output: {to: ./out/}
        """)
    monkeypatch.chdir(tmp_path)
    job = load_job_file(Path("project/jobs/j.yaml"))
    assert job.data[0].source == f"file://{folder.resolve()}/inputs/a.csv"
    assert job.output.to == f"file://{folder.resolve()}/out/"


# -- job variables ----------------------------------------------------------------------------


def test_job_variables_round_trip_to_the_same_job(job_folder: Path):
    job = load_job_file(write(job_folder, "retrain.yaml", VALID_JOB))
    variables = job.to_job_variables()
    assert "name" not in variables
    assert set(variables) == {"team", "timezone", "work", "data", "request", "output"}
    assert variables["request"]["max_duration"] == "20m"
    assert variables["data"][0] == {
        "from": f"file://{job_folder.resolve()}/data/train.csv",
        "to": "train.csv",
    }
    assert Job.from_job_variables(variables, job.name) == job


def test_job_variables_round_trip_of_an_until_done_command_job():
    job = parse_job({
        "name": "sims",
        "work": {"command": ["python", "sim.py"]},
        "request": {"until_done": True, "expected_duration": "PT40M", "deadline": "+2h"},
    })
    variables = job.to_job_variables()
    assert variables["request"] == {
        "gpus": 0, "until_done": True, "expected_duration": "40m", "deadline": "+2h", "priority": 0,
    }
    assert Job.from_job_variables(variables, "sims") == job


def test_from_job_variables_names_bad_fields():
    with pytest.raises(JobError) as caught:
        variables = {"request": {"max_duration": "2hh"}, "work": {"command": ["x"]}}
        Job.from_job_variables(variables, "j")
    assert caught.value.source == "job variables"
    assert [p.field for p in caught.value.problems] == ["request.max_duration"]


@pytest.mark.parametrize(("limit", "written"), [(0.5, "0.5s"), (90.5, "1m30.5s"), ("1h0.25s", "1h0.25s")])
def test_job_variables_round_trip_of_a_fractional_time_limit(limit, written):
    job = parse_job(base_job(max_duration=limit))
    variables = job.to_job_variables()
    assert variables["request"]["max_duration"] == written
    assert Job.from_job_variables(variables, "j") == job


@pytest.mark.parametrize("limit", [1.234567, 90.123456, 0.000001])
def test_job_variables_round_trip_of_a_microsecond_time_limit(limit):
    job = parse_job(base_job(max_duration=limit))
    assert Job.from_job_variables(job.to_job_variables(), "j") == job


# -- bad input: one problem each --------------------------------------------------------------


def test_unknown_field_suggests_the_close_name():
    problem = only_problem(base_job(gpu=1))
    assert (problem.field, problem.value) == ("request.gpu", 1)
    assert str(problem) == "request.gpu = 1: is not a job field; did you mean gpus?"


@pytest.mark.parametrize(
    ("where", "key", "suggestion"),
    [(None, "reqest", "request"), ("work", "flw", "flow"), ("output", "expects", "expect")],
)
def test_unknown_field_suggestion_in_each_section(where, key, suggestion):
    data = base_job()
    (data.setdefault(where, {}) if where else data)[key] = "x"
    problem = only_problem(data)
    assert problem.field == (f"{where}.{key}" if where else key)
    assert problem.fix == f"is not a job field; did you mean {suggestion}?"


def test_unknown_data_field_suggests_the_alias_from():
    data = base_job()
    data["data"] = [{"frm": "s3://b/x"}]
    fields = {p.field: p for p in problems_of(data)}
    assert fields["data.frm"].fix == "is not a job field; did you mean from?"
    assert (fields["data.from"].value, fields["data.from"].fix) == (MISSING, "is required")
    assert str(fields["data.from"]) == "data.from: is required"


def test_unknown_field_without_a_close_name_lists_the_fields():
    problem = only_problem(base_job(zzzzz=1))
    assert problem.fix == (
        "is not a job field; the fields here are gpus, gpu_type, cpus, memory, max_duration, until_done, "
        "expected_duration, start, deadline, priority"
    )


def test_negative_gpus():
    problem = only_problem(base_job(gpus=-1))
    assert str(problem) == "request.gpus = -1: must be 0 or more; use gpus: 0 for a CPU-only job"


def test_gpu_type_with_zero_gpus():
    problem = only_problem(base_job(gpu_type="H100"))
    assert str(problem) == (
        "request.gpu_type = 'H100': names a GPU type but gpus is 0; "
        "set gpus: 1 or more, or remove gpu_type"
    )


def test_malformed_duration():
    problem = only_problem(base_job(max_duration="2hh"))
    assert problem.field == "request.max_duration"
    assert str(problem) == (
        "request.max_duration = '2hh': '2hh' is not a duration; "
        "write a duration such as 90m, 2h, 1h30m, PT2H or a number of seconds"
    )


@pytest.mark.parametrize("field", ["start", "deadline"])
def test_malformed_time(field):
    problem = only_problem(base_job(**{field: "25:00"}))
    assert problem.field == f"request.{field}"
    assert problem.value == "25:00"
    assert "'25:00' is not a time; write a time of day such as 22:00" in str(problem)


def test_naive_iso_start_asks_for_a_zone():
    problem = only_problem(base_job(start="2026-12-03T07:00:00"))
    assert str(problem) == (
        "request.start = '2026-12-03T07:00:00': '2026-12-03T07:00:00' has no time zone; "
        "add one, e.g. 2026-12-03T07:00:00+00:00"
    )


def test_malformed_relative_deadline():
    problem = only_problem(base_job(deadline="+2hh"))
    assert (problem.field, problem.value) == ("request.deadline", "+2hh")
    assert "'2hh' is not a duration" in problem.fix


def test_missing_time_limit():
    problem = only_problem({"name": "j", "work": {"command": ["true"]}, "request": {"gpus": 1}})
    assert (problem.field, problem.value) == ("request.max_duration", MISSING)
    assert str(problem) == (
        "request.max_duration: is missing; set a hard time limit (e.g. max_duration: 2h) "
        "or until_done: true with an expected_duration"
    )


def test_time_limit_and_until_done_conflict():
    problem = only_problem(base_job(until_done=True))
    assert problem.field == "request.until_done"
    assert problem.fix == "conflicts with max_duration; keep one: a hard time limit or until_done"


def test_expected_duration_only_for_until_done():
    problem = only_problem(base_job(expected_duration="90m"))
    assert str(problem) == (
        "request.expected_duration = '1h30m': only applies to until_done jobs; "
        "use max_duration for a time limit"
    )


@pytest.mark.parametrize("bad_to", ["../x", "/abs", "a/../../x", "~/x", "."])
def test_data_to_must_stay_in_the_data_dir(bad_to):
    data = base_job()
    data["data"] = [{"from": "s3://bucket/x", "to": bad_to}]
    problem = only_problem(data)
    assert (problem.field, problem.value) == ("data.to", bad_to)
    assert repr(bad_to) in str(problem)


def test_data_to_escape_message():
    data = base_job()
    data["data"] = [{"from": "s3://bucket/x", "to": "../x"}]
    assert str(only_problem(data)) == (
        "data.to = '../x': must be a relative path inside its directory, "
        "without '..' or a leading '/'"
    )


@pytest.mark.parametrize(("section", "key"), [("data", "from"), ("output", "to")])
def test_unsupported_url_scheme(section, key):
    data = base_job()
    if section == "data":
        data["data"] = [{"from": "gs://bucket/x"}]
    else:
        data["output"] = {"to": "gs://bucket/x"}
    problem = only_problem(data)
    assert str(problem) == (
        f"{section}.{key} = 'gs://bucket/x': the gs:// scheme is not supported; "
        "use one of file://, s3:// or a path relative to the job file"
    )


def test_two_inputs_landing_on_the_same_name():
    data = base_job()
    data["data"] = [{"from": "a/x.csv"}, {"from": "s3://b/x.csv"}]
    assert str(only_problem(data)) == (
        "data.to = 'x.csv': is used by both a/x.csv and s3://b/x.csv; give each its own to"
    )


def test_bad_sha256():
    data = base_job()
    data["data"] = [{"from": "s3://b/x", "sha256": "zz"}]
    assert str(only_problem(data)) == (
        "data.sha256 = 'zz': is not a SHA-256 hex digest (64 hex characters)"
    )


def test_output_placeholders_are_accepted():
    data = base_job()
    every = "/".join("{" + p + "}" for p in OUTPUT_PLACEHOLDERS)
    data["output"] = {"to": f"s3://results/{every}/"}
    assert parse_job(data).output.to == "s3://results/{flow_run.id}/{flow_run.name}/{date}/{job}/"


@pytest.mark.parametrize("placeholder", ["user", "flow_run.start", "0", ""])
def test_unknown_output_placeholder(placeholder):
    data = base_job()
    data["output"] = {"to": f"s3://results/{{{placeholder}}}/"}
    problem = only_problem(data)
    assert problem.field == "output.to"
    assert problem.fix == (
        f"uses {{{placeholder}}}; the placeholders are "
        "{flow_run.id}, {flow_run.name}, {date}, {job}"
    )


def test_output_expect_must_stay_in_the_output_dir():
    data = base_job()
    data["output"] = {"expect": ["ok.json", "../x"]}
    assert only_problem(data).field == "output.expect"


def test_flow_and_command_together():
    data = base_job()
    data["work"] = {"flow": "f.py:main", "command": ["python", "x.py"]}
    problem = only_problem(data)
    assert problem.field == "work"
    assert str(problem) == (
        "work = {'flow': 'f.py:main', 'command': ['python', 'x.py']}: "
        "give either flow or command, not both"
    )


@pytest.mark.parametrize("flow", ["f.py", "f.py:", "f.py:not-a-name"])
def test_flow_must_be_an_entrypoint(flow):
    data = base_job()
    data["work"] = {"flow": flow}
    problem = only_problem(data)
    assert (problem.field, problem.value) == ("work.flow", flow)
    assert problem.fix == "is not a flow entrypoint; write path/to/file.py:flow_function"


def test_empty_command():
    data = base_job()
    data["work"] = {"command": []}
    problem = only_problem(data)
    assert problem.field == "work.command"
    assert problem.fix.startswith("is empty")


@pytest.mark.parametrize("name", ["-lead", "has space", "a/b", "x" * 64])
def test_bad_job_name(name):
    data = base_job()
    data["name"] = name
    assert only_problem(data).field == "name"


def test_unknown_time_zone():
    data = base_job()
    data["timezone"] = "Mars/Olympus"
    assert str(only_problem(data)) == (
        "timezone = 'Mars/Olympus': 'Mars/Olympus' is not a time zone; "
        "use an IANA name such as Europe/Paris"
    )


@pytest.mark.parametrize("not_a_mapping", [[], "job", None, 3])
def test_a_job_must_be_a_mapping(not_a_mapping):
    problem = only_problem(not_a_mapping)
    assert problem.field == "job"
    assert problem.fix == "a job is a mapping with work, data, request and output"


def test_request_is_required():
    problem = only_problem({"name": "j", "work": {"command": ["x"]}})
    assert (problem.field, problem.value, problem.fix) == ("request", MISSING, "is required")
    assert str(problem) == "request: is required"


def test_a_written_null_is_shown_as_none_not_as_missing():
    problem = only_problem({"name": "j", "work": {"command": ["x"]}, "request": None})
    assert problem.value is None
    assert str(problem).startswith("request = None: ")


@pytest.mark.parametrize(
    ("huge", "shown"),
    [("inf", "'inf'"), (1e20, "1e+20"), (float("inf"), "inf"), ("367d", "'367d'")],
)
def test_huge_duration_is_a_job_error(huge, shown):
    problem = only_problem(base_job(max_duration=huge))
    assert problem.field == "request.max_duration"
    assert str(problem) == (
        f"request.max_duration = {shown}: {shown} is longer than a year; "
        "write a duration such as 90m, 2h, 1h30m, PT2H or a number of seconds"
    )


@pytest.mark.parametrize(("nan", "shown"), [("nan", "'nan'"), (float("nan"), "nan")])
def test_nan_duration_is_a_job_error(nan, shown):
    problem = only_problem(base_job(max_duration=nan))
    assert str(problem) == (
        f"request.max_duration = {shown}: {shown} is not a positive duration; "
        "write a duration such as 90m, 2h, 1h30m, PT2H or a number of seconds"
    )


# -- several problems at once -----------------------------------------------------------------


def test_several_problems_give_several_lines():
    data = {
        "name": "j",
        "work": {"command": ["true"]},
        "data": [{"from": "gs://x"}],
        "request": {"gpus": -1, "gpu": 2, "max_duration": "2hh"},
    }
    with pytest.raises(JobError) as caught:
        parse_job(data, source="jobs/j.yaml")
    error = caught.value
    assert error.source == "jobs/j.yaml"
    assert sorted(p.field for p in error.problems) == [
        "data.from", "request.gpu", "request.gpus", "request.max_duration",
    ]
    lines = str(error).splitlines()
    assert len(lines) == 4
    assert lines == [str(p) for p in error.problems]


def test_several_cross_field_problems_each_keep_their_field():
    problems = problems_of({
        "name": "j",
        "work": {"command": ["true"]},
        "request": {"gpu_type": "H100", "until_done": True, "max_duration": "1h"},
    })
    assert [p.field for p in problems] == ["request.gpu_type", "request.until_done"]


# -- job files: what only a file can get wrong ------------------------------------------------


def load_problems(path: Path) -> list[Problem]:
    with pytest.raises(JobError) as caught:
        load_job_file(path)
    assert caught.value.source == str(path)
    return caught.value.problems


def test_flow_file_that_does_not_exist(tmp_path: Path):
    path = write(tmp_path, "j.yaml", """\
        work: {flow: flows/missing.py:main}
        request: {max_duration: 1h}
        """)
    [problem] = load_problems(path)
    assert (problem.field, problem.value) == ("work.flow", "flows/missing.py:main")
    assert problem.fix == (
        f"{tmp_path.resolve()}/flows/missing.py does not exist; "
        "give a path relative to the job file"
    )


def test_flow_function_that_does_not_exist_suggests_the_close_one(job_folder: Path):
    text = VALID_JOB.replace("retrain.py:retrain", "retrain.py:retrian")
    path = write(job_folder, "j.yaml", text)
    [problem] = load_problems(path)
    assert str(problem) == (
        "work.flow = 'flows/retrain.py:retrian': "
        "retrain.py defines no function retrian; did you mean retrain?"
    )


def test_flow_function_that_does_not_exist_without_a_close_one(job_folder: Path):
    path = write(job_folder, "j.yaml", VALID_JOB.replace("retrain.py:retrain", "retrain.py:zzz"))
    [problem] = load_problems(path)
    assert problem.fix == "retrain.py defines no function zzz"


def test_flow_file_that_does_not_parse(tmp_path: Path):
    write(tmp_path, "flows/broken.py", "def main(:\n")
    path = write(tmp_path, "j.yaml", """\
        work: {flow: flows/broken.py:main}
        request: {max_duration: 1h}
        """)
    [problem] = load_problems(path)
    assert problem.field == "work.flow"
    assert problem.fix.startswith("broken.py does not parse:")
    assert "(line 1)" in problem.fix


def test_neither_flow_nor_command(tmp_path: Path):
    path = write(tmp_path, "j.yaml", "request: {max_duration: 1h}\n")
    [problem] = load_problems(path)
    assert (problem.field, problem.value) == ("work", MISSING)
    assert str(problem) == (
        "work: says nothing to run; give flow: path/to/file.py:function or command: [...]"
    )


def test_both_flow_and_command_in_a_file(job_folder: Path):
    flow = "  flow: flows/retrain.py:retrain\n"
    text = VALID_JOB.replace(flow, flow + "  command: [python, x.py]\n")
    path = write(job_folder, "j.yaml", text)
    [problem] = load_problems(path)
    assert (problem.field, problem.fix) == ("work", "give either flow or command, not both")


def test_missing_job_file(tmp_path: Path):
    [problem] = load_problems(tmp_path / "nope.yaml")
    assert str(problem) == f"job file = '{tmp_path / 'nope.yaml'}': does not exist; check the path"


def test_job_file_that_is_not_yaml(tmp_path: Path):
    [problem] = load_problems(write(tmp_path, "bad.yaml", "request: [\n"))
    assert problem.field == "job file"
    assert problem.fix.startswith("is not valid YAML:")
    assert "\n" not in problem.fix


def test_job_file_that_is_a_list(tmp_path: Path):
    [problem] = load_problems(write(tmp_path, "list.yaml", "- a\n- b\n"))
    assert (problem.field, problem.value) == ("job", ["a", "b"])


def test_a_file_with_several_problems_lists_them_all(tmp_path: Path):
    path = write(tmp_path, "j.yaml", """\
        work: {command: [echo, hi]}
        data:
          - {from: s3://b/x, to: ../x}
        request:
          gpu: 1
          gpus: -2
          max_duration: 1h
          start: "25:00"
        """)
    problems = load_problems(path)
    assert sorted(p.field for p in problems) == [
        "data.to", "request.gpu", "request.gpus", "request.start",
    ]


def test_unquoted_iso_deadline_is_read_as_the_same_instant(tmp_path: Path):
    # YAML turns an unquoted timestamp into a datetime; the job still means that instant.
    job = load_job_file(write(tmp_path, "j.yaml", """\
        work: {command: [echo, hi]}
        request: {max_duration: 1h, deadline: 2026-12-04T07:00:00+00:00}
        """))
    the_plan = plan(job, datetime(2026, 12, 3, 12, tzinfo=UTC))
    assert the_plan.deadline == datetime(2026, 12, 4, 7, tzinfo=UTC)


def test_unquoted_time_of_day_in_a_job_file(tmp_path: Path):
    job = load_job_file(write(tmp_path, "j.yaml", """\
        timezone: Europe/Paris
        work: {command: [echo, hi]}
        request: {max_duration: 1h, start: 22:00, deadline: 23:30}
        """))
    assert (job.request.start, job.request.deadline) == ("22:00", "23:30")
    the_plan = plan(job, datetime(2026, 12, 3, 12, tzinfo=UTC))
    assert the_plan.start == datetime(2026, 12, 3, 21, 0, tzinfo=UTC)  # 22:00 in Paris
    assert the_plan.deadline == datetime(2026, 12, 3, 22, 30, tzinfo=UTC)  # 23:30 in Paris


def test_unquoted_clock_like_duration_in_a_job_file_is_refused_as_written(tmp_path: Path):
    # Not the base-60 number 5400 seconds: 1:30 is not a duration form, and the message says so.
    [problem] = load_problems(write(tmp_path, "j.yaml", """\
        work: {command: [echo, hi]}
        request: {max_duration: 1:30}
        """))
    assert str(problem) == (
        "request.max_duration = '1:30': '1:30' is not a duration; "
        "write a duration such as 90m, 2h, 1h30m, PT2H or a number of seconds"
    )


def test_numbers_in_a_job_file_are_still_numbers(tmp_path: Path):
    job = load_job_file(write(tmp_path, "j.yaml", """\
        work: {command: [echo, hi]}
        request: {gpus: 2, max_duration: 3600, priority: -3}
        """))
    assert (job.request.gpus, job.request.max_duration, job.request.priority) == (
        2, timedelta(hours=1), -3,
    )


# -- plan and plan_problems -------------------------------------------------------------------


def timed_job(**request) -> Job:
    data = base_job(**request)
    data["timezone"] = "Europe/Paris"
    return parse_job(data)


NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)  # 13:00 in Paris


def test_plan_of_a_night_job():
    job = timed_job(max_duration="20m", start="22:00", deadline="07:00")
    the_plan = plan(job, NOW)
    assert the_plan.start == datetime(2026, 12, 3, 21, 0, tzinfo=UTC)  # 22:00 in Paris
    assert the_plan.deadline == datetime(2026, 12, 4, 6, 0, tzinfo=UTC)  # 07:00 in Paris
    assert the_plan.latest_start == datetime(2026, 12, 4, 5, 40, tzinfo=UTC)  # 06:40 in Paris
    assert {m.tzinfo for m in (the_plan.start, the_plan.deadline, the_plan.latest_start)} == {UTC}
    assert the_plan.time_limit == timedelta(minutes=20)
    assert plan_problems(job, the_plan) == []


def test_plan_start_now_ignores_the_start():
    job = timed_job(max_duration="20m", start="22:00", deadline="+1h")
    the_plan = plan(job, NOW, start_now=True)
    assert the_plan.start == NOW
    assert the_plan.deadline == NOW + timedelta(hours=1)
    assert the_plan.latest_start == NOW + timedelta(minutes=40)


def test_plan_without_a_deadline():
    the_plan = plan(timed_job(), NOW)
    assert (the_plan.start, the_plan.deadline, the_plan.latest_start) == (NOW, None, None)
    assert plan_problems(timed_job(), the_plan) == []


def test_deadline_before_start_plus_time_limit_is_a_problem():
    job = timed_job(max_duration="2h", start="22:00", deadline="23:00")
    [problem] = plan_problems(job, plan(job, NOW))
    assert (problem.field, problem.value) == ("request.deadline", "23:00")
    assert str(problem) == (
        "request.deadline = '23:00': is 2026-12-03T23:00:00+01:00, before the start "
        "2026-12-03T22:00:00+01:00 plus 2h; "
        "move the deadline later, start earlier, or shorten the time limit"
    )


def test_deadline_exactly_start_plus_time_limit_is_fine():
    job = timed_job(max_duration="2h", start="22:00", deadline="+2h")
    assert plan_problems(job, plan(job, NOW)) == []


def test_until_done_job_is_judged_by_its_expected_duration():
    data = base_job(deadline="+30m", until_done=True, expected_duration="40m")
    del data["request"]["max_duration"]
    job = parse_job(data)
    [problem] = plan_problems(job, plan(job, NOW, start_now=True))
    assert problem.field == "request.deadline"
    assert "plus 40m" in problem.fix


def test_past_iso_deadline_is_a_problem():
    job = timed_job(deadline="2026-12-03T11:00:00Z")
    [problem] = plan_problems(job, plan(job, NOW))
    assert problem.value == "2026-12-03T11:00:00Z"


def test_nine_hour_job_does_not_fit_the_spring_forward_night():
    job = timed_job(max_duration="9h", start="22:00", deadline="07:00")
    the_plan = plan(job, datetime(2026, 3, 28, 12, 0, tzinfo=UTC))
    assert the_plan.deadline - the_plan.start == timedelta(hours=8)
    [problem] = plan_problems(job, the_plan)
    assert str(problem) == (
        "request.deadline = '07:00': is 2026-03-29T07:00:00+02:00, before the start "
        "2026-03-28T22:00:00+01:00 plus 9h; "
        "move the deadline later, start earlier, or shorten the time limit"
    )


def test_eight_hour_job_just_fits_the_spring_forward_night():
    job = timed_job(max_duration="8h", start="22:00", deadline="07:00")
    the_plan = plan(job, datetime(2026, 3, 28, 12, 0, tzinfo=UTC))
    assert the_plan.latest_start == the_plan.start == datetime(2026, 3, 28, 21, 0, tzinfo=UTC)
    assert plan_problems(job, the_plan) == []


def test_nine_and_a_half_hour_job_fits_the_fall_back_night():
    job = timed_job(max_duration="9h30m", start="22:00", deadline="07:00")
    the_plan = plan(job, datetime(2026, 10, 24, 12, 0, tzinfo=UTC))
    assert the_plan.deadline - the_plan.start == timedelta(hours=10)
    assert the_plan.latest_start == datetime(2026, 10, 24, 20, 30, tzinfo=UTC)  # 22:30 CEST
    assert plan_problems(job, the_plan) == []


def test_loading_twice_gives_equal_jobs(job_folder: Path):
    # Loading twice gives equal jobs: anchoring is a pure copy.
    path = write(job_folder, "retrain.yaml", VALID_JOB)
    first, second = load_job_file(path), load_job_file(path)
    assert first == second
    assert copy.deepcopy(first) == first


def test_a_containers_code_is_the_jobs_project_folder_never_a_top_level_one(tmp_path):
    from e31_prefect.job import code_root

    repo = tmp_path / "repo"
    assert code_root(repo / "jobs", repo / "jobs" / "flow.py") == repo / "jobs"
    assert code_root(repo / "jobs", repo / "flows" / "x.py") == repo
    assert code_root(Path("/home/me/jobs"), Path("/opt/flows/x.py")) is None
    assert code_root(Path("/home/a/jobs"), Path("/home/b/x.py")) is None


def test_an_image_job_whose_flow_the_container_could_not_see_is_refused(tmp_path):
    import os
    import tempfile

    folder = tmp_path / "jobs"
    folder.mkdir()
    top = Path(tempfile.gettempdir())  # a flow file in /tmp: its container would see all of /tmp
    flow = top / f"e31-far-{tmp_path.name}.py"
    flow.write_text("def f():\n    pass\n")
    try:
        relative = os.path.relpath(flow, folder)
        (folder / "job.yaml").write_text(f"name: far\nwork: {{flow: '{relative}:f', image: acme/x:1}}\n"
                                         "request: {max_duration: 1h}\n")
        with pytest.raises(JobError) as caught:
            load_job_file(folder / "job.yaml")
        assert f"its container would have to see all of {top} to reach {flow}" in str(caught.value)
        (folder / "job.yaml").write_text(f"name: far\nwork: {{flow: '{relative}:f'}}\nrequest: {{max_duration: 1h}}\n")
        assert load_job_file(folder / "job.yaml").work.flow, "as a process it runs where it is"
    finally:
        flow.unlink()
