"""The E31 job: work, data, request and output, as one pydantic model.

``e31 validate job.yaml`` reads a job file through :func:`load_job_file`.

The same model is the job file, the work pool's job variables and what the
``@e31`` decorator builds, so each path means the same thing. Parsing and
validation are pure; the only I/O is reading the job file and checking that a
flow entrypoint exists (:func:`load_job_file`).
"""

from __future__ import annotations

import difflib
import re
import string
from collections import deque
from datetime import timedelta
from pathlib import PurePosixPath
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from e31_prefect.model import timing
from e31_prefect.model.job_values import (
    _NAME,
    JOB_VARIABLE_KEYS,
    MAX_CPUS,
    MAX_GPUS,
    MAX_INT,
    MISSING,
    NUL_FIX,
    OUTPUT_PLACEHOLDERS,
    Duration,
    JobError,
    Problem,
    _cross,
    check_relative_path,
    check_url,
    parse_disk,
    parse_memory,
)
from e31_prefect.model.job_work import Work
from e31_prefect.model.shards import (
    ShardSettings,
    expected_array_duration,
    slot_count,
)


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


# A missing field whose fix is more than adding it: what to write.
REQUIRED_FIXES = {
    "request": "is required: say what the job rents and for how long, e.g. request: {gpus: 1, max_duration: 2h}",
}


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
            problems.append(Problem(field, MISSING, REQUIRED_FIXES.get(field, "is required")))
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


