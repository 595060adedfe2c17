"""The values a job's fields hold: names, sizes, URLs, paths, limits, and the Problem a field has (pure).

Every part of the job (:mod:`e31_prefect.model.job`, :mod:`e31_prefect.model.job_work`,
:mod:`e31_prefect.model.job_file`) checks its values here and reports what is wrong as a :class:`Problem`
naming the field and the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from pathlib import PurePosixPath
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import BeforeValidator, PlainSerializer
from pydantic_core import PydanticCustomError

from e31_prefect.model import timing

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
