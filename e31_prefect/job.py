"""The E31 job: work, data, request and output, as one pydantic model.

``e31 validate job.yaml`` reads a job file through :func:`load_job_file`.

The same model is the job file, the work pool's job variables and what the
``@e31`` decorator builds, so each path means the same thing. Parsing and
validation are pure; the only I/O is reading the job file and checking that a
flow entrypoint exists (:func:`load_job_file`).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import math
import os
import re
import shlex
import string
from collections import deque
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
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from e31_prefect import timing
from e31_prefect.shards import (
    SHARD_PARAMETERS,
    ShardSettings,
    expected_array_duration,
    missing_parameters_fix,
    missing_shard_parameters,
    slot_count,
)

SUPPORTED_SCHEMES = ("file", "s3")
OUTPUT_PLACEHOLDERS = ("flow_run.id", "flow_run.name", "date", "job")
JOB_VARIABLE_KEYS = ("team", "timezone", "work", "data", "request", "output", "storage")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
MAX_GPUS = 1024  # a job runs on one host's devices
MAX_CPUS = 1024
MAX_ARGUMENT_BYTES = 128 * 1024 - 1  # Linux's MAX_ARG_STRLEN less the NUL: longer and exec fails after renting
MAX_INT = 2**63 - 1  # what JSON job variables and every store downstream can hold
MAX_SHARDS = 100_000  # Slurm's default MaxArraySize is 1001; ten thousand simulations fit with room to spare
MAX_SHARD_RETRIES = 10
MAX_SHARDS_PER_GPU = 64
NUL_FIX = "contains a NUL character (\\0), which no command, path or variable can carry; remove it"

def job_name(text: str) -> str:
    """Any name Prefect accepts (a flow's, a deployment's such as ``My Deployment 1``, a flow run's) as a
    valid job name: letters, digits, '.', '_' and '-'. A valid one is kept as it is."""
    if _NAME.match(text):
        return text
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
        # A field may come from a key of the file; a newline in it must not split the problem's line.
        field = self.field if self.field.isprintable() else repr(self.field)
        if self.value is MISSING:
            return f"{field or 'job'}: {self.fix}"
        return f"{field or 'job'} = {_show(self.value)}: {self.fix}"


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
    size = float(number) * 1024 ** " kmgt".index(unit.lower() or " ")
    if not size <= MAX_INT:  # a thousand-digit number reads as infinity, which no int holds
        raise ValueError(f"is too large; {SIZE_HINT}")
    return int(size)


def parse_memory(value: str | int) -> int:
    """A memory limit in bytes (at least the 6 MiB a container needs)."""
    size = parse_bytes(value)
    if size < 6 * 1024 * 1024:
        raise ValueError("is below the 6 MiB a container needs; write e.g. 512m")
    return size


MIN_DISK_BYTES = 8 * 1024 * 1024


def parse_disk(value: str | int) -> int:
    """A disk bound in bytes (at least the 8 MiB a filesystem of its own needs)."""
    size = parse_bytes(value)
    if size < MIN_DISK_BYTES:
        raise ValueError("is below the 8 MiB an output disk needs; write e.g. 512m or 20g")
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


def _shown(value: Any) -> Any:
    """A value as the job file writes it (a duration as 30s, not a timedelta)."""
    return timing.format_duration(value) if isinstance(value, timedelta) else value


def _too_long(text: str, what: str) -> str | None:
    """Why ``text`` cannot be one argument or variable of a Linux process, or None when it can."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size <= MAX_ARGUMENT_BYTES:
        return None
    return f"is {size} bytes; Linux passes at most 128 KiB per {what}: put it in a file and stage it as data"


_SHARD_COUNTS = {  # field: lowest, highest, what to do outside them
    "shards": (1, MAX_SHARDS, f"must be from 1 to {MAX_SHARDS}; a job of more pieces is several jobs, or pieces "
               "that each loop over many items"),
    "gpus_per_shard": (0, MAX_GPUS, f"must be from 0 (CPU-only shards) to {MAX_GPUS}"),
    "shards_per_gpu": (1, MAX_SHARDS_PER_GPU, f"must be from 1 to {MAX_SHARDS_PER_GPU} shards at once per GPU"),
    "shard_retries": (0, MAX_SHARD_RETRIES, f"must be from 0 to {MAX_SHARD_RETRIES}; a shard failing more often "
                      "fails for a reason a retry will not fix"),
}


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
        description="Parameters passed to the flow (each shard of a sharded flow also receives shard_index "
        "and shard_count).",
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

    shards: int | None = Field(
        default=None,
        title="Shards",
        description="Run the command or flow this many times, as shards of one job (a Slurm job array): one "
        "rent, one meter, shards spread over the rented GPUs, each with E31_SHARD_INDEX set (a flow also "
        f"receives shard_index and shard_count as parameters). At most {MAX_SHARDS}.",
        examples=[10000],
    )
    gpus_per_shard: int | None = Field(
        default=None,
        title="GPUs per shard",
        description="GPUs each shard sees (default 1; 0 for CPU-only shards of a job renting no GPU).",
        examples=[1],
    )
    shards_per_gpu: int | None = Field(
        default=None,
        title="Shards at once per GPU",
        description="How many shards share a GPU at once (default 1); for CPU-only shards, how many run at once.",
        examples=[2],
    )
    shard_retries: int | None = Field(
        default=None,
        title="Shard retries",
        description=f"How many times a failed shard is run again, on any free slot (default 0, at most "
        f"{MAX_SHARD_RETRIES}).",
        examples=[2],
    )
    allow_failed_shards: int | float | None = Field(
        default=None,
        title="Failed shards allowed",
        description="How many shards may still fail (after retries) with the job Completed: a count (3) or a "
        "fraction of the shards (0.01). Default 0: every shard must succeed.",
        examples=[0.01],
    )
    expected_shard_duration: Duration | None = Field(
        default=None,
        title="Expected shard duration",
        description="How long one shard usually takes: an until-done job's expected duration is then its shards "
        "spread over its slots, used to judge the deadline.",
        examples=["30s"],
    )
    reduce: list[str] | None = Field(
        default=None,
        title="Reduce command",
        description="A command run once after all shards, in the same rent, to combine their outputs "
        "(each shard writes under shard-<index>/ of the output dir).",
        examples=[["python", "sims/summarize.py"]],
    )

    @field_validator("command", "reduce", mode="before")
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

    @field_validator("command", "reduce")
    @classmethod
    def _command_runnable(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("is empty; give the program and its arguments, e.g. [python, sim.py]")
        field = f"work.{info.field_name}"
        problems = [Problem(field, item, fix) for item in value or [] if (fix := _too_long(item, "argument"))]
        if problems:
            raise _cross(problems)
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
        if not isinstance(value, dict):
            return value
        env = {str(k): v for k, v in value.items()}
        problems = []
        for name, text in env.items():
            if not name or "=" in name:
                # The runtime writes NAME=value: an empty name or one with '=' would set some other variable.
                problems.append(Problem("work.env", name, "is not a variable name; use letters, digits and '_'"))
            elif text is None or isinstance(text, (dict, list)):
                problems.append(Problem(f"work.env.{name}", text,
                                        "is not text; write the value, quoted if need be (\"\" for empty)"))
            elif fix := _too_long(f"{name}={text}", "variable"):
                problems.append(Problem(f"work.env.{name}", text, fix))
        if problems:
            raise _cross(problems)
        return {name: str(text) for name, text in env.items()}

    @field_validator("shards", "gpus_per_shard", "shards_per_gpu", "shard_retries", mode="before")
    @classmethod
    def _count_in_range(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return value
        # pydantic would read true as 1 and 2.0 as 2: neither is how anyone writes a count.
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("is not a whole number; write a count such as 4")
        low, high, fix = _SHARD_COUNTS[info.field_name or ""]
        if not low <= value <= high:
            raise ValueError(fix)
        return value

    @field_validator("allow_failed_shards", mode="before")
    @classmethod
    def _count_or_fraction(cls, value: Any) -> Any:
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("is not a count or a fraction; write e.g. 3 (shards) or 0.01 (of the shards)")
        if isinstance(value, float) and not 0 <= value < 1:  # also refuses NaN and infinity
            raise ValueError("is a fraction of the shards, so at least 0 and below 1; write a count (3) "
                             "or a fraction (0.01)")
        if isinstance(value, int) and value < 0:
            raise ValueError("must be 0 or more shards")
        return value

    @model_validator(mode="after")
    def _flow_or_command(self) -> Work:
        if self.flow and self.command:
            raise _cross([Problem("work", {"flow": self.flow, "command": self.command},
                                  "give either flow or command, not both")])
        problems = self.shard_problems()
        if problems:
            raise _cross(problems)
        return self

    def shard_problems(self) -> list[Problem]:
        """What is wrong with the work's shard fields on their own (the request's GPUs are checked by the job)."""
        problems = []
        if self.shards is not None and self.flow:
            # Each shard of a flow receives these two: a job's own value would be silently replaced.
            problems += [Problem(f"work.parameters.{name}", self.parameters[name], "is given to each shard by "
                                 "e31 (from 0 to shards - 1, and the shard count); remove it")
                         for name in SHARD_PARAMETERS if name in self.parameters]
        if isinstance(self.allow_failed_shards, int) and self.shards and self.allow_failed_shards >= self.shards:
            problems.append(Problem("work.allow_failed_shards", self.allow_failed_shards,
                                    f"allows all {self.shards} shards to fail, so the job could never fail; "
                                    "allow fewer"))
        if self.shards is None:
            given = [name for name in ("gpus_per_shard", "shards_per_gpu", "shard_retries", "allow_failed_shards",
                                       "expected_shard_duration", "reduce") if getattr(self, name) is not None]
            problems += [Problem(f"work.{name}", _shown(getattr(self, name)), "only applies to a sharded job; set "
                                 "work.shards (e.g. shards: 100) or remove it") for name in given]
        return problems


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
        default=None, ge=0, le=MAX_INT, title="Expected size", description="Bytes the input must have.",
        examples=[1048576],
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

    @model_validator(mode="after")
    def _has_a_name(self) -> DataInput:
        if self.to is None and self.target == "..":
            raise _cross([Problem("data.from", self.source,
                                  "ends in '..', which names nothing to stage it as; add to: NAME")])
        return self

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
        default=None, title="CPUs", description="CPU cores a container may use (docker runtime).",
        examples=[8],
    )
    memory: str | None = Field(
        default=None,
        title="Memory",
        description="Memory limit of a container, no swap (docker runtime): bytes or 512m, 16g, 2Gi.",
        examples=["16g"],
    )
    disk: str | None = Field(
        default=None,
        title="Disk",
        description="Disk the job may write in its output dir, enforced while it runs (a full disk fails "
        "its writes and ends the run DiskLimit, keeping what was written): bytes or 512m, 16g, 2Gi. "
        "Unset: the pool's default_disk.",
        examples=["20g"],
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
    def _gpus_in_range(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be 0 or more; use gpus: 0 for a CPU-only job")
        if value > MAX_GPUS:
            raise ValueError(f"is more than {MAX_GPUS}; a job rents the GPUs of one host")
        return value

    @field_validator("cpus")
    @classmethod
    def _cpus_in_range(cls, value: float | None) -> float | None:
        if value is not None and not 0 < value <= MAX_CPUS:  # also refuses NaN and infinity
            raise ValueError(f"must be more than 0 and at most {MAX_CPUS} cores, e.g. 8")
        return value

    @field_validator("start")
    @classmethod
    def _check_start(cls, value: str | None) -> str | None:
        return None if value is None else timing.check_start(value)

    @field_validator("memory", "disk", mode="before")
    @classmethod
    def _check_size(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            (parse_memory if info.field_name == "memory" else parse_disk)(value)
            return str(value)
        return value

    @property
    def disk_bytes(self) -> int | None:
        """The disk bound in bytes (None: the pool's default applies)."""
        return None if self.disk is None else parse_disk(self.disk)

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
        problems, paths = [], []
        for item in value:
            if any(c in item for c in "*?["):
                # Checked by exact name after the run (staging.missing_outputs): a pattern would never exist.
                problems.append(Problem("output.expect", item,
                                        "is a pattern; expect lists exact paths: name each file, e.g. metrics.json"))
                continue
            try:
                paths.append(check_relative_path(item))
            except ValueError as exc:
                problems.append(Problem("output.expect", item, str(exc)))
        if problems:
            raise _cross(problems)
        return paths


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

    @model_validator(mode="before")
    @classmethod
    def _no_nul(cls, data: Any) -> Any:
        problems = nul_problems(data)
        if problems:
            raise _cross(problems)
        return data

    @model_validator(mode="after")
    def _shards_fit_the_time_limit(self) -> Job:
        request, per_shard = self.request, self.work.expected_shard_duration
        if per_shard is None or request.max_duration is None or self.expected_duration <= request.max_duration:
            return self
        raise _cross([Problem("work.expected_shard_duration", timing.format_duration(per_shard),
                              f"makes {self.work.shards} shards over {self.shard_slots} slot(s) take "
                              f"{timing.format_duration(self.expected_duration)}, beyond max_duration "
                              f"{timing.format_duration(request.max_duration)}; rent more GPUs, run more shards "
                              "per GPU, or raise the time limit")])

    @property
    def shard_slots(self) -> int:
        """How many of the job's shards run at once (1 for a job without shards)."""
        settings = ShardSettings.of(self)
        if settings is None:
            return 1
        return slot_count(self.request.gpus, settings.gpus_per_shard, settings.shards_per_gpu)

    @property
    def expected_duration(self) -> timedelta | None:
        """How long the job usually takes: the request's, else its shards' spread over its slots."""
        work = self.work
        if self.request.expected_duration is not None or work.expected_shard_duration is None or not work.shards:
            return self.request.expected_duration
        return expected_array_duration(work.shards, self.shard_slots, work.expected_shard_duration)

    @property
    def admission_duration(self) -> timedelta:
        """How long before its deadline a run must start (its time limit, else its expected duration)."""
        return timing.admission_duration(self.request.max_duration, self.expected_duration)

    @model_validator(mode="after")
    def _shards_fit_the_request(self) -> Job:
        work, gpus = self.work, self.request.gpus
        if work.shards is None or work.gpus_per_shard is None:
            return self
        if work.gpus_per_shard > gpus:
            raise _cross([Problem("work.gpus_per_shard", work.gpus_per_shard,
                                  f"is more than the job's request.gpus ({gpus}); rent at least "
                                  f"{work.gpus_per_shard} GPU(s) or give each shard fewer")])
        if work.gpus_per_shard == 0 and gpus:
            raise _cross([Problem("work.gpus_per_shard", 0, f"leaves the job's {gpus} rented GPU(s) unused; "
                                  "give each shard 1 or more, or rent gpus: 0")])
        if work.gpus_per_shard and gpus % work.gpus_per_shard:
            # The leftover devices would be billed and never used.
            raise _cross([Problem("work.gpus_per_shard", work.gpus_per_shard,
                                  f"does not divide request.gpus ({gpus}): {gpus % work.gpus_per_shard} GPU(s) would "
                                  "be rented and sit idle; rent a multiple of it")])
        return self

    @model_validator(mode="after")
    def _targets_apart(self) -> Job:
        # Staging one input onto or inside another's target would overwrite or mix the two.
        owners: dict[str, str] = {}
        problems = []
        for item in self.data:
            if item.target in owners:
                problems.append(Problem("data.to", item.target, f"is used by both {owners[item.target]} "
                                        f"and {item.source}; give each its own to"))
            owners.setdefault(item.target, item.source)
        for item in self.data:
            parts = PurePosixPath(item.target).parts
            folder = next((f for f in ("/".join(parts[:n]) for n in range(1, len(parts))) if f in owners), None)
            if folder is not None:
                problems.append(Problem("data.to", item.target,
                                        f"is inside {folder}, where {owners[folder]} is staged; "
                                        f"give {item.source} a path outside it"))
        if problems:
            raise _cross(problems)
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


def nul_problems(data: Any) -> list[Problem]:
    """A problem for each text (key or value) in raw job data holding a NUL character.

    Walked without recursion, so a deeply nested parameter cannot exhaust the stack.
    """
    problems: list[Problem] = []
    todo: deque[tuple[str, Any]] = deque([("", data)])
    while todo:
        field, value = todo.popleft()
        if isinstance(value, str) and "\0" in value:
            problems.append(Problem(field, value, NUL_FIX))
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and "\0" in key:
                    problems.append(Problem(field, key, NUL_FIX))
                todo.append((f"{field}.{key}" if field else str(key), item))
        elif isinstance(value, (list, tuple)):
            todo.extend((field, item) for item in value)
    return problems


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


MAX_JOB_FILE_BYTES = 256 * 1024  # a job file is a few KiB; printing a valid one this big takes ~0.4 s
MAX_DEPTH = 32
MAX_VALUES = 10_000


class JobFileResolver(yaml.resolver.Resolver):
    """Which plain scalars are null, true/false or decimal numbers; everything else is text as written.

    YAML 1.1 (PyYAML's default) would read ``start: 22:00`` as 1320, ``0755`` as 493, ``yes`` as True
    and ``2026-12-03`` as a date, silently changing a job's times and command lines.
    """


_TAG = "tag:yaml.org,2002:"
_STR, _INT, _FLOAT, _BOOL, _NULL = (_TAG + name for name in ("str", "int", "float", "bool", "null"))
JobFileResolver.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag == _NULL]
    for first, resolvers in yaml.resolver.Resolver.yaml_implicit_resolvers.items()
}
JobFileResolver.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
JobFileResolver.add_implicit_resolver(_INT, re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"), list("-+0123456789"))
JobFileResolver.add_implicit_resolver(
    _FLOAT,
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?|[-+]?[0-9]+[eE][-+]?[0-9]+"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+.0123456789"))
_RESOLVER = JobFileResolver()
_PARSER = yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader  # only its parser is used; C is ~20x faster
_PLAIN_TAGS = (None, "!", _STR, _TAG + "seq", _TAG + "map")


@dataclass
class _Open:
    """A mapping or list being read: its value so far, its field, and a mapping's key awaiting its value."""

    value: dict[Any, Any] | list[Any]
    field: str
    key: Any = MISSING
    lines: dict[Any, int] = dataclasses.field(default_factory=dict)  # the line each key was first given on

    def child(self) -> str:
        """The field of the next value read into this one."""
        if self.key is MISSING:
            return self.field
        return f"{self.field}.{self.key}" if self.field else str(self.key)

    def add(self, value: Any, line: int, problems: list[Problem]) -> None:
        """Take the next value read: a list's item, or a mapping's key and then that key's value."""
        if isinstance(self.value, list):
            self.value.append(value)
        elif self.key is MISSING:
            self.key = value
            if value in self.lines:
                problems.append(Problem(self.child(), MISSING,
                                        f"is given twice (lines {self.lines[value]} and {line}); keep one"))
            self.lines.setdefault(value, line)
        else:
            self.value[self.key] = value
            self.key = MISSING


def read_job_yaml(text: str, source: str) -> Any:
    """The data in a job file's YAML, read in time and memory bounded by the text's length.

    Each of these is a problem naming its field: anchors and aliases (a few lines of aliases expand to
    billions of values), tags other than ``!!str``, nesting deeper than ``MAX_DEPTH``, more than
    ``MAX_VALUES`` values, keys that are not text, a key given twice and numbers beyond 64 bits.
    Raises :class:`JobError`, or ``yaml.YAMLError`` for text that is not YAML.
    """
    problems: list[Problem] = []
    stack: list[_Open] = []
    documents: list[Any] = []
    count = 0
    for event in yaml.parse(text, Loader=_PARSER):  # events, not nodes: nothing is built before it is checked
        if isinstance(event, (yaml.StreamStartEvent, yaml.StreamEndEvent,
                              yaml.DocumentStartEvent, yaml.DocumentEndEvent)):
            continue
        where = stack[-1].child() if stack else ""
        if isinstance(event, yaml.CollectionEndEvent):
            value = stack.pop().value
        else:
            count += 1
            stop = _limit_problem(event, where, count, len(stack), stack[-1] if stack else None)
            if stop:
                raise JobError([stop], source)
            if event.tag not in _PLAIN_TAGS:
                problems.append(Problem(where, event.tag.replace(_TAG, "!!"), "is a YAML tag; job files use none "
                                        "but !!str: write plain text, numbers, true/false, lists and mappings"))
            if isinstance(event, yaml.CollectionStartEvent):
                stack.append(_Open({} if isinstance(event, yaml.MappingStartEvent) else [], where))
                continue
            value = _scalar(event, where, problems)
        if stack:
            stack[-1].add(value, event.start_mark.line + 1, problems)
        else:
            documents.append(value)
    if len(documents) > 1:
        problems.append(Problem("job file", source, f"holds {len(documents)} YAML documents; a job file is one"))
    if problems:
        raise JobError(problems, source)
    return documents[0] if documents else None


def _limit_problem(event: yaml.Event, where: str, count: int, depth: int, parent: _Open | None) -> Problem | None:
    # What stops the reading at once: going on could take unbounded time or memory.
    if isinstance(event, yaml.AliasEvent) or event.anchor is not None:
        written, kind = ("*", "alias") if isinstance(event, yaml.AliasEvent) else ("&", "anchor")
        return Problem(where, written + event.anchor, f"is a YAML {kind}; job files use no anchors (&) "
                       "or aliases (*): write each value out")
    if count > MAX_VALUES:
        return Problem(where, MISSING, f"goes past {MAX_VALUES} values in one job file; "
                       "keep large parameters in a file staged as data")
    if isinstance(event, yaml.CollectionStartEvent):
        if parent is not None and isinstance(parent.value, dict) and parent.key is MISSING:
            return Problem(where, MISSING, "has a list or mapping as a key; keys are text")
        if depth >= MAX_DEPTH:
            return Problem(where, MISSING, f"nests lists and mappings more than {MAX_DEPTH} deep; flatten it")
    return None


def _scalar(event: yaml.ScalarEvent, where: str, problems: list[Problem]) -> Any:
    """A scalar as the job means it: text, unless written plain as null, true/false or a decimal number."""
    text = event.value
    tag = _RESOLVER.resolve(yaml.ScalarNode, text, event.implicit) if event.tag in (None, "!") else _STR
    if tag == _NULL:
        return None
    if tag == _BOOL:
        return text.lower() == "true"
    if tag == _INT:
        # Checked by length first: Python will not even read an integer past 4,300 digits.
        if len(text.lstrip("+-")) <= 19 and -MAX_INT - 1 <= int(text) <= MAX_INT:
            return int(text)
    elif tag == _FLOAT:
        number = float(text.lower().replace(".inf", "inf").replace(".nan", "nan"))
        if not math.isinf(number) or "inf" in text.lower():
            return number
    else:
        return text
    problems.append(Problem(where, text, f"is out of range; a number in a job file fits in 64 bits (±{MAX_INT}): "
                            "quote it to pass it as text"))
    return text


def load_job_file(path: str | Path) -> Job:
    """Read, validate and anchor a job file: relative paths become absolute ``file://`` URLs.

    Raises :class:`JobError` listing every problem, including a flow entrypoint that does not exist,
    in time and memory bounded by ``MAX_JOB_FILE_BYTES`` whatever the file holds.
    """
    path = Path(path)
    source = str(path)
    try:
        data = read_job_yaml(_job_file_text(path, source), source)
    except yaml.YAMLError as exc:
        raise JobError([Problem("job file", source, f"is not valid YAML: {exc}".replace("\n", " "))], source) from None
    if isinstance(data, dict):
        data.setdefault("name", path.stem)
    job = parse_job(data, source)
    problems = _work_problems(job.work, path.parent.resolve())
    if problems:
        raise JobError(problems, source)
    return anchor(job, path.parent.resolve())


def _job_file_text(path: Path, source: str) -> str:
    # Read no more than the cap, so /dev/zero or a huge file costs no more than a large job file.
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_JOB_FILE_BYTES + 1)
    except FileNotFoundError:
        raise JobError([Problem("job file", source, "does not exist; check the path")], source) from None
    except OSError as exc:
        raise JobError([Problem("job file", source, f"cannot be read ({exc.strerror or exc}); "
                                "give the path of a YAML job file")], source) from None
    if len(raw) > MAX_JOB_FILE_BYTES:
        raise JobError([Problem("job file", source, f"is larger than {MAX_JOB_FILE_BYTES // 1024} KiB; a job "
                                "file describes a job: keep large parameters in a file staged as data")], source)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise JobError([Problem("job file", source, f"is not UTF-8 text (byte 0x{raw[exc.start]:02x} on line "
                                f"{line}); save it as UTF-8")], source) from None


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
    try:
        if not source.is_file():
            return [Problem("work.flow", work.flow, f"{source} does not exist; give a path relative to the job file")]
        tree = ast.parse(source.read_bytes(), filename=str(source))
    except OSError as exc:  # a name too long, a file the user may not read
        return [Problem("work.flow", work.flow, f"{source} cannot be read ({exc.strerror or exc}); "
                        "give a path relative to the job file")]
    except SyntaxError as exc:
        return [Problem("work.flow", work.flow, f"{source.name} does not parse: {exc.msg} (line {exc.lineno})")]
    except (ValueError, RecursionError, MemoryError) as exc:  # how CPython's parser says "nested too deep"
        return [Problem("work.flow", work.flow, f"{source.name} does not parse: {exc or 'nested too deep'}")]
    defined = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if work.image and code_root(base, source) is None:
        return [Problem("work.flow", work.flow, f"its container would have to see all of "
                        f"{os.path.commonpath([base, source.parent])} to reach {source}; keep the flow in the job's "
                        "folder or in a project folder holding both")]
    if function not in defined:
        hint = difflib.get_close_matches(function, sorted(defined), n=1)
        return [Problem("work.flow", work.flow, f"{source.name} defines no function {function}"
                        + (f"; did you mean {hint[0]}?" if hint else ""))]
    if work.shards is not None:
        # Known from the source, so refused here rather than after renting: each shard would fail alike.
        missing = missing_shard_parameters(_keyword_parameters(defined[function]))
        if missing:
            return [Problem("work.flow", work.flow, missing_parameters_fix(work.flow, missing))]
    return []


def _keyword_parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The names a function defined in source takes by keyword."""
    return [a.arg for a in (*function.args.args, *function.args.kwonlyargs)]


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
        latest_start=timing.latest_start(deadline, job.admission_duration),
        time_limit=job.request.time_limit,
    )


def plan_problems(job: Job, the_plan: Plan) -> list[Problem]:
    """A job whose deadline comes before its start plus its time limit can never be met."""
    if the_plan.latest_start is None or the_plan.latest_start >= the_plan.start:
        return []
    assert the_plan.deadline is not None
    need = timing.format_duration(job.admission_duration)
    deadline, start = (moment.astimezone(job.tz).isoformat() for moment in (the_plan.deadline, the_plan.start))
    return [Problem(
        "request.deadline", job.request.deadline,
        f"is {deadline}, before the start {start} plus {need}; "
        "move the deadline later, start earlier, or shorten the time limit",
    )]
