"""The E31 job: work, data, request and output, as one pydantic model.

``e31 validate job.yaml`` reads a job file through :func:`load_job_file`.

The same model is the job file, the work pool's job variables and what the
``@e31`` decorator builds, so each path means the same thing. Parsing and
validation are pure; the only I/O is reading the job file and checking that a
flow entrypoint exists (:func:`load_job_file`).
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import shlex
import string
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path, PurePosixPath
from typing import Annotated, Any
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from e31_prefect import timing

SUPPORTED_SCHEMES = ("file", "s3")
OUTPUT_PLACEHOLDERS = ("flow_run.id", "flow_run.name", "date", "job")
JOB_VARIABLE_KEYS = ("team", "timezone", "work", "data", "request", "output", "storage")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")

def job_name(text: str) -> str:
    """Any name (a flow's, say) as a valid job name: letters, digits, '.', '_' and '-'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:63] or "flow"


Duration = Annotated[
    timedelta,
    BeforeValidator(timing.parse_duration),
    PlainSerializer(timing.format_duration, return_type=str),
]


MISSING = object()


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a job: which field, what value (or ``MISSING``), and what to do about it."""

    field: str
    value: Any
    fix: str

    def __str__(self) -> str:
        if self.value is MISSING:
            return f"{self.field or 'job'}: {self.fix}"
        return f"{self.field or 'job'} = {_show(self.value)}: {self.fix}"


class JobError(ValueError):
    """A job that cannot run as written; ``problems`` has one entry per thing to fix."""

    def __init__(self, problems: list[Problem], source: str | None = None):
        self.problems = problems
        self.source = source
        super().__init__("\n".join(str(p) for p in problems))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _cross(problems: list[Problem]) -> PydanticCustomError:
    # Cross-field problems travel inside one pydantic error so each keeps its own field name.
    summary = "; ".join(map(str, problems))
    return PydanticCustomError("e31_cross", "{summary}", {"summary": summary, "problems": problems})


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?$", re.IGNORECASE)
SIZE_HINT = "write bytes or a size such as 512m, 16g or 2Gi"


def parse_bytes(value: str | int) -> int:
    """Bytes in ``1048576``, ``512m``, ``16g``, ``2Gi``, ``1.5g`` (powers of 1024, as Docker reads them)."""
    match = _SIZE.match(str(value).strip())
    if not match:
        raise ValueError(f"is not a size; {SIZE_HINT}")
    number, unit = match.groups()
    return int(float(number) * 1024 ** " kmgt".index(unit.lower() or " "))


def parse_memory(value: str | int) -> int:
    """A memory limit in bytes (at least the 6 MiB a container needs)."""
    size = parse_bytes(value)
    if size < 6 * 1024 * 1024:
        raise ValueError("is below the 6 MiB a container needs; write e.g. 512m")
    return size


def check_url(url: str) -> str:
    """Refuse a URL whose scheme no E31 store speaks; plain paths are local files."""
    scheme = urlsplit(url).scheme
    if scheme and len(scheme) > 1 and scheme not in SUPPORTED_SCHEMES:
        raise ValueError(
            f"the {scheme}:// scheme is not supported; use one of "
            + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
            + " or a path relative to the job file"
        )
    return url


def check_relative_path(path: str) -> str:
    """Refuse a path that would leave the directory it is meant to stay in."""
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or path.startswith("~"):
        raise ValueError("must be a relative path inside its directory, without '..' or a leading '/'")
    if str(pure) in ("", "."):
        raise ValueError("must name a file or folder, not the directory itself")
    return str(pure)


class Work(BaseModel):
    """What runs: a Prefect flow entrypoint or a plain command, with its parameters and environment."""

    model_config = ConfigDict(extra="forbid")

    flow: str | None = Field(
        default=None,
        title="Flow entrypoint",
        description="A Prefect flow as path/to/file.py:function, relative to the job file. "
        "Leave empty in a deployment: its entrypoint is the flow.",
        examples=["flows/retrain.py:retrain"],
    )
    command: list[str] | None = Field(
        default=None,
        title="Command",
        description="A plain command, run by e31's built-in command flow in the job's folder "
        "(instead of a flow).",
        examples=[["python", "sim.py", "--n", "10000"]],
    )
    parameters: dict[str, Any] = Field(
        default_factory=dict,
        title="Flow parameters",
        description="Parameters passed to the flow.",
        examples=[{"epochs": 3}],
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        title="Job environment",
        description="Environment variables the work sees.",
        examples=[{"SEED": "7"}],
    )
    image: str | None = Field(
        default=None,
        title="Image",
        description="Container image for the docker runtime; without one the job runs as a local process.",
        examples=["ghcr.io/acme/trainer:2026.12"],
    )

    @field_validator("command", mode="before")
    @classmethod
    def _split_command(cls, value: Any) -> Any:
        if isinstance(value, str):
            return shlex.split(value)
        if isinstance(value, list):
            # YAML reads 10000 as a number; a command line is text. Anything else was not meant.
            for item in value:
                if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                    raise ValueError(f"item {item!r} is not text; quote each argument, e.g. \"--n\"")
            return [str(item) for item in value]
        return value

    @field_validator("command")
    @classmethod
    def _command_not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("is empty; give the program and its arguments, e.g. [python, sim.py]")
        return value

    @field_validator("flow")
    @classmethod
    def _flow_shape(cls, value: str | None) -> str | None:
        if value is not None and (":" not in value or not value.rsplit(":", 1)[1].isidentifier()):
            raise ValueError("is not a flow entrypoint; write path/to/file.py:flow_function")
        return value

    @field_validator("env", mode="before")
    @classmethod
    def _env_as_strings(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): str(v) for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _flow_or_command(self) -> Work:
        if self.flow and self.command:
            raise _cross([Problem("work", {"flow": self.flow, "command": self.command},
                                  "give either flow or command, not both")])
        return self


class DataInput(BaseModel):
    """One input staged into the job's data dir before any GPU is rented."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    source: Annotated[str, BeforeValidator(str)] = Field(
        alias="from",
        title="From",
        description="Where the input lives: s3://bucket/key, s3://bucket/prefix/, file:// or a path "
        "relative to the job file.",
        examples=["s3://datasets/footage/2026-12-01/"],
    )
    to: str | None = Field(
        default=None,
        title="To",
        description="Path under the job's data dir; defaults to the source's last name.",
        examples=["train.csv"],
    )
    size: int | None = Field(
        default=None, ge=0, title="Expected size", description="Bytes the input must have.", examples=[1048576]
    )
    sha256: str | None = Field(
        default=None,
        title="Expected SHA-256",
        description="Hex digest the input must have.",
        examples=["9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"],
    )

    @field_validator("source")
    @classmethod
    def _check_source(cls, value: str) -> str:
        return check_url(value)

    @field_validator("to")
    @classmethod
    def _check_to(cls, value: str | None) -> str | None:
        return None if value is None else check_relative_path(value)

    @field_validator("sha256")
    @classmethod
    def _check_digest(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", value):
            raise ValueError("is not a SHA-256 hex digest (64 hex characters)")
        return value.lower() if value else value

    @property
    def target(self) -> str:
        """The path under the data dir this input lands at."""
        return self.to or PurePosixPath(urlsplit(self.source).path.rstrip("/")).name or "input"


class Request(BaseModel):
    """How much compute, for how long, from when and by when."""

    model_config = ConfigDict(extra="forbid")

    gpus: int = Field(default=0, title="GPUs", description="How many GPUs the job rents.", examples=[1])
    gpu_type: str | None = Field(
        default=None,
        title="GPU type",
        description="Only devices whose name contains this (case-insensitive) are rented.",
        examples=["H100"],
    )
    cpus: float | None = Field(
        default=None, gt=0, title="CPUs", description="CPU cores a container may use (docker runtime).",
        examples=[8],
    )
    memory: str | None = Field(
        default=None,
        title="Memory",
        description="Memory limit of a container, no swap (docker runtime): bytes or 512m, 16g, 2Gi.",
        examples=["16g"],
    )
    max_duration: Duration | None = Field(
        default=None,
        title="Time limit",
        description="Hard time limit: the run is stopped and fails TimedOut when it is reached.",
        examples=["2h"],
    )
    until_done: bool = Field(
        default=False,
        title="Until done",
        description="Run with no time limit of its own (stopped at the deadline, if any).",
        examples=[True],
    )
    expected_duration: Duration | None = Field(
        default=None,
        title="Expected duration",
        description="For until-done jobs: how long it usually takes, used to judge the deadline.",
        examples=["40m"],
    )
    start: Annotated[str, BeforeValidator(str)] | None = Field(
        default=None,
        title="Earliest start",
        description="HH:MM (the next occurrence) or an ISO datetime with a zone.",
        examples=["22:00"],
    )
    deadline: Annotated[str, BeforeValidator(str)] | None = Field(
        default=None,
        title="Deadline",
        description="When the job must be finished: +9h (after the scheduled start), HH:MM "
        "(the next occurrence after the scheduled start) or an ISO datetime with a zone.",
        examples=["07:00"],
    )
    priority: int = Field(
        default=0, title="Priority", description="Higher goes first among runs with equal slack.", examples=[0]
    )

    @field_validator("gpus")
    @classmethod
    def _gpus_not_negative(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be 0 or more; use gpus: 0 for a CPU-only job")
        return value

    @field_validator("start")
    @classmethod
    def _check_start(cls, value: str | None) -> str | None:
        return None if value is None else timing.check_start(value)

    @field_validator("memory", mode="before")
    @classmethod
    def _check_memory(cls, value: Any) -> Any:
        if value is not None:
            parse_memory(value)
            return str(value)
        return value

    @property
    def memory_bytes(self) -> int | None:
        """The memory limit in bytes."""
        return None if self.memory is None else parse_memory(self.memory)

    @field_validator("deadline")
    @classmethod
    def _check_deadline(cls, value: str | None) -> str | None:
        return None if value is None else timing.check_deadline(value)

    @model_validator(mode="after")
    def _consistent(self) -> Request:
        problems = []
        if self.gpu_type and self.gpus == 0:
            problems.append(Problem("request.gpu_type", self.gpu_type,
                                    "names a GPU type but gpus is 0; set gpus: 1 or more, or remove gpu_type"))
        if self.max_duration and self.until_done:
            problems.append(Problem("request.until_done", True,
                                    "conflicts with max_duration; keep one: a hard time limit or until_done"))
        if not self.max_duration and not self.until_done:
            problems.append(Problem("request.max_duration", MISSING,
                                    "is missing; set a hard time limit (e.g. max_duration: 2h) "
                                    "or until_done: true with an expected_duration"))
        if self.expected_duration and not self.until_done:
            problems.append(Problem("request.expected_duration", timing.format_duration(self.expected_duration),
                                    "only applies to until_done jobs; use max_duration for a time limit"))
        if problems:
            raise _cross(problems)
        return self

    @property
    def time_limit(self) -> timedelta | None:
        """The hard limit on a run's length (None for an until-done job)."""
        return self.max_duration

    @property
    def admission_duration(self) -> timedelta:
        """How long before its deadline a run must start."""
        return timing.admission_duration(self.max_duration, self.expected_duration)


class Output(BaseModel):
    """Where the job's output dir is sent after the run, and what it must contain."""

    model_config = ConfigDict(extra="forbid")

    to: str | None = Field(
        default=None,
        title="Output destination",
        description="URL or path the output dir is uploaded to; may use {flow_run.id}, "
        "{flow_run.name}, {date} and {job}.",
        examples=["s3://results/{job}/{flow_run.name}/"],
    )
    expect: list[str] = Field(
        default_factory=list,
        title="Expected files",
        description="Paths under the output dir that must exist, or the run fails.",
        examples=[["model.json", "metrics.json"]],
    )

    @field_validator("to")
    @classmethod
    def _check_to(cls, value: str | None) -> str | None:
        if value is None:
            return None
        for _, name, _, _ in string.Formatter().parse(value):
            if name is not None and name not in OUTPUT_PLACEHOLDERS:
                raise ValueError(
                    f"uses {{{name}}}; the placeholders are "
                    + ", ".join("{" + p + "}" for p in OUTPUT_PLACEHOLDERS)
                )
        return check_url(value)

    @field_validator("expect")
    @classmethod
    def _check_expect(cls, value: list[str]) -> list[str]:
        return [check_relative_path(v) for v in value]


class Job(BaseModel):
    """A whole E31 job: the single source of truth for job files, job variables and ``@e31``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(title="Job name", description="Also the name of its Prefect deployment.")
    team: str | None = Field(
        default=None, title="Team", description="Who pays: used by the meter.", examples=["vision"]
    )
    timezone: str | None = Field(
        default=None,
        title="Time zone",
        description="IANA zone for HH:MM starts and deadlines; the machine's zone when empty.",
        examples=["Europe/Paris"],
    )
    work: Work = Field(default_factory=Work, title="Work", description="What runs.")
    data: list[DataInput] = Field(
        default_factory=list, title="Data", description="Inputs staged for the job, read-only."
    )
    request: Request = Field(title="Request", description="GPUs, time limit, start and deadline.")
    output: Output = Field(default_factory=Output, title="Output", description="Where outputs go.")
    storage: str | None = Field(
        default=None,
        title="Storage block",
        description="The E31 Storage block whose credentials read the data and send the outputs "
        "(`e31 blocks apply blocks/` creates it); empty: s3fs's default credential chain on the worker.",
        examples=["e31-store"],
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError("must start with a letter or digit and use only letters, digits, '.', '_', '-'")
        return value

    @field_validator("storage")
    @classmethod
    def _check_storage(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[a-z0-9][a-z0-9-]*", value):
            raise ValueError("is not a block name; block names use only lowercase letters, digits and '-'")
        return value

    @field_validator("timezone")
    @classmethod
    def _check_zone(cls, value: str | None) -> str | None:
        if value:
            timing.zone(value)
        return value

    @model_validator(mode="after")
    def _targets_unique(self) -> Job:
        seen: dict[str, str] = {}
        for item in self.data:
            if item.target in seen:
                raise _cross([Problem("data.to", item.target,
                                      f"is used by both {seen[item.target]} and {item.source}; give each its own to")])
            seen[item.target] = item.source
        return self

    @property
    def tz(self):
        """The zone the job's times of day are read in."""
        return timing.zone(self.timezone)

    def to_job_variables(self) -> dict[str, Any]:
        """The job as a deployment's job variables (its name is the deployment's name)."""
        dumped = self.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_defaults=False)
        return {key: dumped[key] for key in JOB_VARIABLE_KEYS if key in dumped}

    @classmethod
    def from_job_variables(cls, variables: dict[str, Any], name: str) -> Job:
        """Rebuild the job from job variables; raises :class:`JobError` naming each bad field."""
        values = {key: variables[key] for key in JOB_VARIABLE_KEYS if variables.get(key) is not None}
        return parse_job({"name": name, **values}, source="job variables")


def parse_job(data: Any, source: str | None = None) -> Job:
    """Validate raw job data, raising :class:`JobError` with one problem per bad field."""
    if not isinstance(data, dict):
        raise JobError([Problem("job", data, "a job is a mapping with work, data, request and output")], source)
    try:
        return Job.model_validate(data)
    except ValidationError as exc:
        raise JobError(problems_from(exc), source) from None


def problems_from(exc: ValidationError) -> list[Problem]:
    """Turn pydantic's errors into problems that name the job file's own field names."""
    problems: list[Problem] = []
    for error in exc.errors():
        if error["type"] == "e31_cross":
            problems.extend(error["ctx"]["problems"])
            continue
        loc = [str(part) for part in error["loc"] if not isinstance(part, int)]
        field = ".".join(loc)
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "is not a job field" + _suggestion(loc)
        elif error["type"] == "missing":
            problems.append(Problem(field, MISSING, "is required"))
            continue
        problems.append(Problem(field, error.get("input"), message))
    return problems


_FIELDS_BY_PARENT: dict[str, type[BaseModel]] = {
    "": Job, "work": Work, "data": DataInput, "request": Request, "output": Output,
}


def _suggestion(loc: list[str]) -> str:
    parent = _FIELDS_BY_PARENT.get(".".join(loc[:-1]))
    if parent is None:
        return ""
    names = [info.alias or name for name, info in parent.model_fields.items()]
    close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.5)
    if close:
        return f"; did you mean {close[0]}?"
    return "; the fields here are " + ", ".join(names)


# -- job files --------------------------------------------------------------------------------


class JobFileLoader(yaml.SafeLoader):
    """YAML with plain numbers only: ``22:00``, ``0755`` and ``0x10`` stay text, only true/false are booleans.

    YAML 1.1 (PyYAML's default) would read ``start: 22:00`` as 1320, ``0755`` as 493 and ``yes`` as
    True, silently changing a job's times and command lines.
    """


_YAML_1_1_ONLY = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool")
JobFileLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _YAML_1_1_ONLY]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
JobFileLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
JobFileLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"),
    list("-+0123456789"))
JobFileLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?|[-+]?[0-9]+[eE][-+]?[0-9]+"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+.0123456789"))



def load_job_file(path: str | Path) -> Job:
    """Read, validate and anchor a job file: relative paths become absolute ``file://`` URLs.

    Raises :class:`JobError` listing every problem, including a flow
    entrypoint that does not exist.
    """
    path = Path(path)
    source = str(path)
    try:
        data = yaml.load(path.read_text(), Loader=JobFileLoader)
    except FileNotFoundError:
        raise JobError([Problem("job file", source, "does not exist; check the path")], source) from None
    except yaml.YAMLError as exc:
        raise JobError([Problem("job file", source, f"is not valid YAML: {exc}".replace("\n", " "))], source) from None
    if isinstance(data, dict):
        data.setdefault("name", path.stem)
    job = parse_job(data, source)
    problems = _work_problems(job.work, path.parent.resolve())
    if problems:
        raise JobError(problems, source)
    return anchor(job, path.parent.resolve())


def anchor(job: Job, base: Path) -> Job:
    """Make every local path in the job absolute, relative to ``base`` (the job file's folder)."""
    data = [item.model_copy(update={"source": anchor_url(item.source, base)}) for item in job.data]
    output = job.output
    if output.to:
        output = output.model_copy(update={"to": anchor_url(output.to, base)})
    return job.model_copy(update={"data": data, "output": output})


def anchor_url(url: str, base: Path) -> str:
    """``s3://...`` stays as it is; a path or ``file://`` URL becomes an absolute ``file://`` URL."""
    scheme = urlsplit(url).scheme
    if scheme and len(scheme) > 1 and scheme != "file":
        return url
    local = url.removeprefix("file://")
    trailing = "/" if local.endswith("/") else ""
    resolved = (base / Path(local).expanduser()).resolve()
    return f"file://{resolved}{trailing}"


def flow_file(work: Work, base: Path) -> tuple[Path, str]:
    """The flow's source file (absolute) and function name."""
    assert work.flow
    relative, function = work.flow.rsplit(":", 1)
    return (base / relative).resolve(), function


def code_root(job_folder: Path, flow_source: Path) -> Path | None:
    """The folder a job's container must see for its flow: its folder, or the nearest one holding both it
    and the flow's file (a repository with jobs/ and flows/); None when that would be a top-level folder."""
    root = Path(os.path.commonpath([job_folder, flow_source.parent]))
    return root if len(root.parts) >= 3 else None  # /, /home: far more of the host than the job's project


def _work_problems(work: Work, base: Path) -> list[Problem]:
    if not work.flow and not work.command:
        return [Problem("work", MISSING, "says nothing to run; give flow: path/to/file.py:function or command: [...]")]
    if not work.flow:
        return []
    source, function = flow_file(work, base)
    if not source.is_file():
        return [Problem("work.flow", work.flow, f"{source} does not exist; give a path relative to the job file")]
    try:
        tree = ast.parse(source.read_text(), filename=str(source))
    except SyntaxError as exc:
        return [Problem("work.flow", work.flow, f"{source.name} does not parse: {exc.msg} (line {exc.lineno})")]
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if work.image and code_root(base, source) is None:
        return [Problem("work.flow", work.flow, f"its container would have to see all of "
                        f"{os.path.commonpath([base, source.parent])} to reach {source}; keep the flow in the job's "
                        "folder or in a project folder holding both")]
    if function not in defined:
        hint = difflib.get_close_matches(function, sorted(defined), n=1)
        return [Problem("work.flow", work.flow, f"{source.name} defines no function {function}"
                        + (f"; did you mean {hint[0]}?" if hint else ""))]
    return []


# -- the schedule of one submission -------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """A job's times for one submission: when it may start, when it must end, when it must start by."""

    start: datetime
    deadline: datetime | None
    latest_start: datetime | None
    time_limit: timedelta | None


def plan(job: Job, now: datetime, *, start_now: bool = False) -> Plan:
    """Resolve the job's start and deadline as seen at ``now`` (``start_now`` ignores ``start``)."""
    tz = job.tz
    start = now if start_now else timing.resolve_start(job.request.start, now, tz)
    deadline = timing.resolve_deadline(job.request.deadline, start, tz)
    return Plan(
        start=start,
        deadline=deadline,
        latest_start=timing.latest_start(deadline, job.request.admission_duration),
        time_limit=job.request.time_limit,
    )


def plan_problems(job: Job, the_plan: Plan) -> list[Problem]:
    """A job whose deadline comes before its start plus its time limit can never be met."""
    if the_plan.latest_start is None or the_plan.latest_start >= the_plan.start:
        return []
    assert the_plan.deadline is not None
    need = timing.format_duration(job.request.admission_duration)
    deadline, start = (moment.astimezone(job.tz).isoformat() for moment in (the_plan.deadline, the_plan.start))
    return [Problem(
        "request.deadline", job.request.deadline,
        f"is {deadline}, before the start {start} plus {need}; "
        "move the deadline later, start earlier, or shorten the time limit",
    )]
