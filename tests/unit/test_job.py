"""Unit tests for e31_prefect.model.job: parsing, validation messages, job files, anchoring, plans.

Job files are written into pytest's ``tmp_path``; nothing talks to Prefect. Each bad input
must give a :class:`JobError` whose problems name the job file's own field, and whose text
shows the value as written and what to do about it.
"""

from __future__ import annotations

import copy
import textwrap
from datetime import datetime, time, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from e31_prefect.model.job import Job, parse_job
from e31_prefect.model.job_file import anchor_url, load_job_file
from e31_prefect.model.job_plan import plan, plan_problems
from e31_prefect.model.job_values import MISSING, OUTPUT_PLACEHOLDERS, JobError, Problem

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
        "is not a job field; the fields here are gpus, gpu_type, cpus, memory, disk, max_duration, until_done, "
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
    assert (problem.field, problem.value) == ("request", MISSING)
    # What to write, not only that something is missing.
    assert str(problem) == ("request: is required: say what the job rents and for how long, "
                            "e.g. request: {gpus: 1, max_duration: 2h}")


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



@pytest.mark.parametrize("clock", ["06:45", "12:00", "21:59", "23:30"])
def test_plan_start_now_keeps_a_time_of_day_deadline_of_the_declared_night(clock):
    """The README's job (22:00, done by 07:00, 20 minutes) run with --now at any hour: it starts now and is due
    at the 07:00 that follows its declared start, so it is never refused for a 07:00 its start never aimed at."""
    job = timed_job(max_duration="20m", start="22:00", deadline="07:00")
    now = datetime.combine(NOW.date(), time.fromisoformat(clock), tzinfo=job.tz)
    the_plan = plan(job, now, start_now=True)
    declared = plan(job, now)
    assert the_plan.start == now and the_plan.deadline == declared.deadline
    assert the_plan.deadline.astimezone(job.tz).time() == time(7, 0) and the_plan.deadline > declared.start
    assert plan_problems(job, the_plan) == []


def test_plan_start_now_without_a_declared_start_still_refuses_a_deadline_too_soon():
    job = timed_job(max_duration="20m", deadline="07:00")
    now = datetime.combine(NOW.date(), time(6, 45), tzinfo=job.tz)
    [problem] = plan_problems(job, plan(job, now, start_now=True))
    assert problem.field == "request.deadline"

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
    from e31_prefect.model.job_file import code_root

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


# -- hostile job files ------------------------------------------------------------------------
# Each is refused with one line per problem naming the field and the value, and nothing but a
# JobError escapes. A check that let one through would hang (the alias bomb) or raise another error.


def lines_of(problems: list[Problem]) -> list[str]:
    lines = [str(problem) for problem in problems]
    assert all("\n" not in line for line in lines), lines
    return lines


def raw_file(folder: Path, text: str | bytes, name: str = "j.yaml") -> Path:
    path = folder / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


COMMAND_JOB = "work: {command: [echo, hi]}\nrequest: {max_duration: 1h}\n"
ALIAS_BOMB = (
    "work:\n  command: [echo]\n  parameters:\n    a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    + "".join(f"    {b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True))
    + "request: {max_duration: 1h}\n"
)


def test_an_alias_bomb_is_refused_at_its_first_anchor(tmp_path: Path):
    # Expanded, these nine lines are 9**9 strings: reading them must stop before building anything.
    [problem] = load_problems(raw_file(tmp_path, ALIAS_BOMB))
    assert str(problem) == (
        "work.parameters.a = '&a': is a YAML anchor; job files use no anchors (&) or aliases (*): write each value out"
    )


@pytest.mark.parametrize(("text", "field", "written"), [
    ("work: {command: [echo], env: *x}\nrequest: {max_duration: 1h}\n", "work.env", "*x"),
    ("base: &base {max_duration: 1h}\nwork: {command: [echo]}\nrequest: {<<: *base}\n", "base", "&base"),
], ids=["alias", "merge-key"])
def test_anchors_and_aliases_are_refused(tmp_path: Path, text, field, written):
    [problem] = load_problems(raw_file(tmp_path, text))
    assert (problem.field, problem.value) == (field, written)
    assert "write each value out" in problem.fix


@pytest.mark.parametrize("nested", [
    "{x: " + "[" * 100 + "]" * 100 + "}",
    "\n" + "".join(" " * (4 + i) + f"k{i}:\n" for i in range(100)) + " " * 104 + "end",
], ids=["flow", "block"])
def test_deep_nesting_is_refused_naming_where(tmp_path: Path, nested):
    [problem] = load_problems(raw_file(tmp_path, f"work:\n  command: [echo]\n  parameters: {nested}\n"
                                                 "request: {max_duration: 1h}\n"))
    assert problem.field.startswith("work.parameters")
    assert problem.fix == "nests lists and mappings more than 32 deep; flatten it"


def test_nesting_past_the_yaml_parsers_own_limit_is_a_job_error(tmp_path: Path):
    [problem] = load_problems(raw_file(tmp_path, "work: {parameters: " + "[" * 10_000 + "]" * 10_000 + "}\n"))
    assert problem.field == "job file"


def test_a_non_utf8_file_names_the_byte_and_line(tmp_path: Path):
    path = raw_file(tmp_path, b"request: {max_duration: 1h}\nwork: {command: [echo, \xff\xfe]}\n")
    [problem] = load_problems(path)
    assert problem.field == "job file" and problem.value == str(path)
    assert str(problem).endswith(": is not UTF-8 text (byte 0xff on line 2); save it as UTF-8")


@pytest.mark.parametrize(("where", "field"), [
    ("request: {max_duration: 1h, gpus: NUMBER}", "request.gpus"),
    ("request: {max_duration: NUMBER}", "request.max_duration"),
    ("request: {max_duration: 1h}\ndata: [{from: s3://b/x, size: NUMBER}]", "data.size"),
    ("request: {max_duration: 1h}\nwork: {command: [echo], parameters: {seed: NUMBER}}", "work.parameters.seed"),
], ids=["gpus", "max_duration", "size", "parameter"])
@pytest.mark.parametrize("number", ["9" * 5000, "-" + "9" * 5000, "9223372036854775808", "1e999", "-9e400"],
                         ids=["5000-digits", "minus-5000-digits", "2**63", "1e999", "-9e400"])
def test_numbers_beyond_64_bits_are_refused_as_written(tmp_path: Path, where, field, number):
    text = where.replace("NUMBER", number)
    if "work:" not in text:
        text += "\nwork: {command: [echo]}"
    [problem] = load_problems(raw_file(tmp_path, text + "\n"))
    assert (problem.field, problem.value) == (field, number)
    assert "is out of range; a number in a job file fits in 64 bits" in problem.fix


def test_numbers_at_the_64_bit_bounds_still_read_as_numbers(tmp_path: Path):
    job = load_job_file(raw_file(tmp_path, "work: {command: [echo], parameters: {big: 9223372036854775807, "
                                           "small: -9223372036854775808, inf: .inf}}\nrequest: {max_duration: 1h}\n"))
    assert job.work.parameters == {"big": 2**63 - 1, "small": -(2**63), "inf": float("inf")}


@pytest.mark.parametrize("deadline", ["0001-01-01T00:00:00Z", "'0001-01-01T00:30:00+01:00'", "9999-12-31T23:59:59Z"])
def test_a_deadline_out_of_range_is_shown_as_written(tmp_path: Path, deadline):
    [problem] = load_problems(raw_file(tmp_path, f"work: {{command: [echo]}}\n"
                                                 f"request: {{max_duration: 1h, deadline: {deadline}}}\n"))
    assert (problem.field, problem.value) == ("request.deadline", deadline.strip("'"))
    assert problem.fix.endswith("is out of range; give a date between 1970 and 9000")


def test_a_date_yaml_would_read_as_impossible_is_text_the_deadline_refuses(tmp_path: Path):
    [problem] = load_problems(raw_file(tmp_path, "work: {command: [echo]}\n"
                                                 "request: {max_duration: 1h, deadline: 2026-13-45}\n"))
    assert (problem.field, problem.value) == ("request.deadline", "2026-13-45")


def test_a_key_given_twice_is_refused_naming_the_key_and_both_lines(tmp_path: Path):
    [problem] = load_problems(raw_file(tmp_path, "work:\n  command: [echo]\n  env:\n    SEED: 1\n    SEED: 2\n"
                                                 "request: {max_duration: 1h}\n"))
    assert str(problem) == "work.env.SEED: is given twice (lines 4 and 5); keep one"


def test_a_section_given_twice_is_refused(tmp_path: Path):
    problems = load_problems(raw_file(tmp_path, COMMAND_JOB + "request: {max_duration: 2h}\n"))
    assert lines_of(problems) == ["request: is given twice (lines 2 and 3); keep one"]


@pytest.mark.parametrize(("work", "field", "value"), [
    ('{command: ["echo", "a\\0b"]}', "work.command", "a\0b"),
    ("{command: \"echo a\\0b\"}", "work.command", "echo a\0b"),
    ('{command: [echo], env: {SEED: "7\\0"}}', "work.env.SEED", "7\0"),
    ('{command: [echo], env: {"A\\0B": x}}', "work.env", "A\0B"),
    ('{flow: "flow\\0.py:f"}', "work.flow", "flow\0.py:f"),
    ('{command: [echo], parameters: {deep: [{x: "\\0"}]}}', "work.parameters.deep.x", "\0"),
], ids=["command-item", "command-line", "env-value", "env-name", "flow", "parameter"])
def test_a_nul_character_is_refused_wherever_it_is(tmp_path: Path, work, field, value):
    [problem] = load_problems(raw_file(tmp_path, f"work: {work}\nrequest: {{max_duration: 1h}}\n"))
    assert (problem.field, problem.value) == (field, value)
    assert "NUL character" in problem.fix
    assert "\\x00" in str(problem)  # shown escaped, on its one line


def test_a_nul_character_in_job_variables_is_refused_before_any_run():
    variables = parse_job(base_job()).to_job_variables()
    variables["work"]["command"] = ["echo", "a\0b"]
    with pytest.raises(JobError) as caught:
        Job.from_job_variables(variables, "j")
    assert [p.field for p in caught.value.problems] == ["work.command"]


@pytest.mark.parametrize("name", ["", "A=B", "=X"])
def test_an_env_name_that_is_not_a_variable_name(name):
    data = base_job()
    data["work"]["env"] = {name: "x"}
    assert str(only_problem(data)) == f"work.env = {name!r}: is not a variable name; use letters, digits and '_'"


@pytest.mark.parametrize("value", [None, [1], {"x": 1}])
def test_an_env_value_that_is_not_text(value):
    data = base_job()
    data["work"]["env"] = {"SEED": value}
    problem = only_problem(data)
    assert (problem.field, problem.value) == ("work.env.SEED", value)


@pytest.mark.parametrize(("where", "field"), [("command", "work.command"), ("env", "work.env.BIG")])
def test_an_argument_or_variable_longer_than_linux_passes(where, field):
    data = base_job()
    big = "x" * (128 * 1024)
    data["work"] = {"command": ["echo", big]} if where == "command" else {"command": ["true"], "env": {"BIG": big}}
    problem = only_problem(data)
    assert (problem.field, problem.value) == (field, big)
    assert "Linux passes at most 128 KiB" in problem.fix


@pytest.mark.parametrize("pattern", ["*.json", "out/?.txt", "[ab].json", "**/model.pt"])
def test_an_expect_pattern_is_refused_asking_for_each_file(pattern):
    data = base_job()
    data["output"] = {"expect": ["model.json", pattern]}
    assert str(only_problem(data)) == (
        f"output.expect = {pattern!r}: is a pattern; expect lists exact paths: name each file, e.g. metrics.json"
    )


@pytest.mark.parametrize("order", [1, -1])
def test_an_input_inside_another_inputs_target_is_refused_naming_both(order):
    data = base_job()
    data["data"] = [{"from": "s3://b/frames/", "to": "x"}, {"from": "s3://b/labels.csv", "to": "x/y.csv"}][::order]
    assert str(only_problem(data)) == (
        "data.to = 'x/y.csv': is inside x, where s3://b/frames/ is staged; give s3://b/labels.csv a path outside it"
    )


def test_inputs_side_by_side_or_sharing_a_prefix_are_fine():
    data = base_job()
    data["data"] = [{"from": "s3://b/x/", "to": "x"}, {"from": "s3://b/xy", "to": "xy"},
                    {"from": "s3://b/z", "to": "d/z"}, {"from": "s3://b/w", "to": "d/w"}]
    assert [item.target for item in parse_job(data).data] == ["x", "xy", "d/z", "d/w"]


def test_two_inputs_with_the_same_to_are_refused():
    data = base_job()
    data["data"] = [{"from": "s3://b/d/", "to": "x"}, {"from": "s3://b/f", "to": "./x"}]
    assert str(only_problem(data)) == "data.to = 'x': is used by both s3://b/d/ and s3://b/f; give each its own to"


def test_an_input_named_dot_dot_needs_a_to():
    data = base_job()
    data["data"] = [{"from": "s3://b/.."}]
    assert str(only_problem(data)) == (
        "data.from = 's3://b/..': ends in '..', which names nothing to stage it as; add to: NAME"
    )


def test_a_job_file_over_the_size_cap(tmp_path: Path):
    path = raw_file(tmp_path, COMMAND_JOB + "#" * (256 * 1024))
    [problem] = load_problems(path)
    assert problem.field == "job file"
    assert problem.fix.startswith("is larger than 256 KiB")


def test_a_device_or_folder_instead_of_a_job_file():
    for path, fix in ((Path("/dev/zero"), "is larger than 256 KiB"), (Path("/"), "cannot be read")):
        with pytest.raises(JobError) as caught:
            load_job_file(path)
        assert caught.value.problems[0].fix.startswith(fix)


def test_too_many_values_stop_the_reading(tmp_path: Path):
    [problem] = load_problems(raw_file(tmp_path, "work: {command: [echo], parameters: {ids: [" + "1," * 20_000
                                       + "]}}\nrequest: {max_duration: 1h}\n"))
    assert problem.field == "work.parameters.ids"
    assert problem.fix.startswith("goes past 10000 values in one job file")


@pytest.mark.parametrize("tagged", ["!!binary /w==", "!!python/object:os.system x", "!!set {a}", "!custom x",
                                    "!!int '5'", "!!timestamp 2026-12-03"])
def test_yaml_tags_are_refused(tmp_path: Path, tagged):
    [problem] = load_problems(raw_file(tmp_path, f"work: {{command: [echo], parameters: {{x: {tagged}}}}}\n"
                                                 "request: {max_duration: 1h}\n"))
    assert problem.field == "work.parameters.x"
    assert "is a YAML tag" in problem.fix


def test_a_str_tag_and_a_key_that_is_not_text(tmp_path: Path):
    job = load_job_file(raw_file(tmp_path, "work: {command: [echo, !!str 0755]}\nrequest: {max_duration: 1h}\n"))
    assert job.work.command == ["echo", "0755"]
    [problem] = load_problems(raw_file(tmp_path, "work: {command: [echo], parameters: {[a]: 1}}\n"
                                                 "request: {max_duration: 1h}\n"))
    assert (problem.field, problem.fix) == ("work.parameters", "has a list or mapping as a key; keys are text")


def test_several_yaml_documents(tmp_path: Path):
    [problem] = load_problems(raw_file(tmp_path, COMMAND_JOB + "---\n" + COMMAND_JOB))
    assert problem.fix == "holds 2 YAML documents; a job file is one"


def test_a_key_with_a_newline_keeps_its_problem_on_one_line():
    data = base_job()
    data["work"]["sneaky\nkey"] = 1
    [line] = lines_of(problems_of(data))
    assert line.startswith("'work.sneaky\\nkey' = 1: is not a job field")


@pytest.mark.parametrize(("request_", "field"), [
    ({"gpus": 10**30}, "request.gpus"), ({"gpus": 1025}, "request.gpus"),
    ({"cpus": float("inf")}, "request.cpus"), ({"cpus": float("nan")}, "request.cpus"), ({"cpus": 0}, "request.cpus"),
    ({"memory": "9" * 400 + "g"}, "request.memory"), ({"memory": 2**70}, "request.memory"),
])
def test_request_numbers_out_of_range(request_, field):
    assert only_problem(base_job(**request_)).field == field


def test_a_time_zone_name_too_long_for_a_file_name():
    data = base_job()
    data["timezone"] = "Europe/" + "x" * 5000
    assert only_problem(data).fix == f"{data['timezone']!r} is not a time zone; use an IANA name such as Europe/Paris"


@pytest.mark.parametrize(("flow", "source", "fix"), [
    ("x" * 5000 + ".py:f", None, "cannot be read"),
    ("f.py:f", b"def f():\n    pass\x00\n", "f.py does not parse"),
    ("f.py:f", b"\xff\xfe def f(): pass\n", "f.py does not parse"),
    ("f.py:f", b"x = " + b"-" * 200_000 + b"1\n", "f.py does not parse"),
], ids=["name-too-long", "nul-byte", "not-utf8", "too-deep"])
def test_a_flow_file_that_cannot_be_read_or_parsed(tmp_path: Path, flow, source, fix):
    if source is not None:
        (tmp_path / "f.py").write_bytes(source)
    [problem] = load_problems(raw_file(tmp_path, f"work: {{flow: '{flow}'}}\nrequest: {{max_duration: 1h}}\n"))
    assert problem.field == "work.flow"
    assert fix in problem.fix


HOSTILE_VALUES = [
    None, "", "\0", "a\0b", True, 0, -1, 10**30, -(10**30), float("nan"), float("inf"), -float("inf"), 1e308,
    [], {}, [[[[]]]], {"": {"=": None}}, "9" * 5000, "*.json", "../x", "/abs", "~", "..", "s3://b/..", "gs://x",
    "0001-01-01T00:00:00Z", "9999-12-31T23:59:59+14:00", "+99999999999d", "+1e400s", "99999999999h", "PT1e9H",
    "25:61", "x" * 200_000, "{flow_run.name}/../..", "{0.__class__}", "é\u2028\ud800",
]
FIELDS = [
    ("name",), ("team",), ("timezone",), ("storage",), ("work",), ("work", "flow"), ("work", "command"),
    ("work", "parameters"), ("work", "env"), ("work", "image"), ("data",), ("request",), ("request", "gpus"),
    ("request", "gpu_type"), ("request", "cpus"), ("request", "memory"), ("request", "max_duration"),
    ("request", "until_done"), ("request", "expected_duration"), ("request", "start"), ("request", "deadline"),
    ("request", "priority"), ("output",), ("output", "to"), ("output", "expect"), ("data", "from"), ("data", "to"),
    ("data", "size"), ("data", "sha256"),
]


@pytest.mark.parametrize("path", FIELDS, ids=".".join)
def test_every_field_with_every_hostile_value_gives_a_job_or_a_job_error(path):
    # Exhaustive over fields x values: whatever parses must also plan and become job variables.
    for value in HOSTILE_VALUES:
        data = base_job(deadline="+2h")
        data["data"], data["output"] = [{"from": "s3://b/x"}], {"to": "s3://out/{job}/"}
        parent = data["data"][0] if path[0] == "data" and len(path) > 1 else data
        for key in path[:-1] if path[0] != "data" else ():
            parent = parent[key]
        parent[path[-1]] = copy.deepcopy(value)
        try:
            job = parse_job(data)
        except JobError as exc:
            lines_of(exc.problems)
            continue
        plan_problems(job, plan(job, NOW))
        Job.from_job_variables(job.to_job_variables(), job.name)


def test_mangled_job_files_give_a_job_or_a_job_error(job_folder: Path):
    # A seeded fuzz of the whole reader: random YAML punctuation, escapes and bytes spliced into a valid job.
    import random

    pieces = ["&a ", "*a", "!!binary ", "<<: ", "{", "}", "[", "]", ",", ": ", "- ", "? ", "|", ">", "#", "'", '"',
              "\\0", "\\x00", "\\ud800", "%TAG ! x\n", "---\n", "...\n", "\n", "\t", "  ", "9" * 30, "1e999", ".nan",
              "0001-01-01", "*.json", "../", "\x00", "\x85", "\ufeff"]
    rng = random.Random(31)
    for _ in range(400):
        text = VALID_JOB
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(text))
            text = text[:at] + rng.choice(pieces) + text[at + rng.choice([0, 0, 1, 3]):]
        path = job_folder / "fuzz.yaml"
        raw = text.encode("utf-8", "surrogatepass")
        path.write_bytes(raw if rng.random() < 0.9 else raw.replace(b"e", b"\xe9", 1))
        try:
            job = load_job_file(path)
        except JobError as exc:
            lines_of(exc.problems)
            continue
        Job.from_job_variables(job.to_job_variables(), job.name)
