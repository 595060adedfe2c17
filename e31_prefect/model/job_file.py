"""A job file, read as hostile YAML: bounded, plain values only, anchored to its folder.

``e31 validate job.yaml`` reads a job file through :func:`load_job_file`. Its only I/O is reading the
file and checking that a flow entrypoint exists.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from e31_prefect.model.job import Job, parse_job
from e31_prefect.model.job_values import MAX_INT, MISSING, JobError, Problem
from e31_prefect.model.job_work import Work
from e31_prefect.model.shards import missing_parameters_fix, missing_shard_parameters

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
