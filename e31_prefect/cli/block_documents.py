"""Block documents as YAML files, applied to the Prefect server: ``e31 blocks apply blocks/``.

A block document names its block type and its name; its other keys are the
block's fields. A secret field is never written in the file: it names the
environment variable it is read from, ``{env: VARIABLE}``, and any other
field may do the same::

    type: e31-storage
    name: e31-store
    endpoint_url: https://minio.example.com:9000
    region: us-east-1
    access_key_id: {env: E31_STORE_KEY_ID}
    secret_access_key: {env: E31_STORE_SECRET}

Reading the files (:func:`read_block_files`) is checked completely before
anything is applied, so a bad file changes nothing on the server.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import ValidationError

from e31_prefect.model.job_values import MISSING, Problem

if TYPE_CHECKING:
    from prefect.blocks.core import Block

BLOCK_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
YAML_SUFFIXES = (".yaml", ".yml")


class BlockFileError(ValueError):
    """Block files that cannot be applied; ``problems`` lists each, prefixed with its file."""

    def __init__(self, problems: list[tuple[str, Problem]]):
        self.problems = problems
        super().__init__("\n".join(f"{source}: {problem}" for source, problem in problems))


@dataclass(frozen=True)
class BlockDocument:
    """One block read from a file, its secrets resolved from the environment, ready to save."""

    source: str
    name: str
    block: Block
    variables: dict[str, str]  # field path -> the environment variable it was read from

    @property
    def type_name(self) -> str:
        """The block type's display name, e.g. ``E31 Storage``."""
        return self.block.get_block_type_name()


def block_files(paths: Iterable[Path]) -> list[Path]:
    """The YAML files named, and those under the folders named, in order."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in YAML_SUFFIXES)
        else:
            found.append(path)
    return found


def read_block_files(paths: Iterable[Path], env: Mapping[str, str]) -> list[BlockDocument]:
    """Every block document in the files and folders named; :class:`BlockFileError` lists every problem."""
    documents: list[BlockDocument] = []
    problems: list[tuple[str, Problem]] = []
    files = block_files(paths)
    if not files:
        named = ", ".join(str(p) for p in paths)
        raise BlockFileError([(named, Problem("blocks", MISSING, "no .yaml block files here; check the path"))])
    for path in files:
        source = str(path)
        try:
            loaded = list(yaml.safe_load_all(path.read_text()))
        except FileNotFoundError:
            problems.append((source, Problem("file", MISSING, "does not exist; check the path")))
            continue
        except yaml.YAMLError as exc:
            problems.append((source, Problem("file", MISSING, f"is not valid YAML: {exc}".replace("\n", " "))))
            continue
        for data in (d for d in loaded if d is not None):
            try:
                documents.append(parse_block_document(data, env, source))
            except BlockFileError as exc:
                problems += exc.problems
    seen: dict[tuple[str, str], str] = {}
    for document in documents:
        key = (document.block.get_block_type_slug(), document.name)
        if key in seen:
            problems.append((document.source, Problem("name", document.name,
                                                      f"is also given in {seen[key]}; give each block its own name")))
        seen[key] = document.source
    if problems:
        raise BlockFileError(problems)
    return documents


def parse_block_document(data: Any, env: Mapping[str, str], source: str) -> BlockDocument:
    """One block document: its type, name and fields, secrets read from ``env``."""

    def fail(*found: Problem) -> BlockFileError:
        return BlockFileError([(source, p) for p in found])

    if not isinstance(data, dict):
        raise fail(Problem("document", MISSING, "a block document is a mapping with type, name and its fields"))
    data = dict(data)
    slug, name = data.pop("type", None), data.pop("name", None)
    problems = []
    if slug is None:
        problems.append(Problem("type", MISSING, "is required, e.g. type: e31-storage"))
    if name is None:
        problems.append(Problem("name", MISSING, "is required: the name jobs use to refer to the block"))
    elif not isinstance(name, str) or not BLOCK_NAME.match(name):
        problems.append(Problem("name", name, "must use only lowercase letters, digits and '-'"))
    if problems:
        raise fail(*problems)
    block_class = block_type(str(slug))
    if block_class is None:
        raise fail(Problem("type", slug, _unknown_type(str(slug))))

    fields = {info.alias or field: info for field, info in block_class.model_fields.items()}
    secret_patterns = block_class.model_json_schema().get("secret_fields", [])
    variables: dict[str, str] = {}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            problems.append(Problem(str(key), MISSING, f"is not a field of {slug}" + (
                f"; did you mean {close[0]}?" if close else "; its fields are " + ", ".join(fields))))
            continue
        try:
            values[key] = _resolve(value, str(key), secret_patterns, env, variables)
        except _FieldProblem as exc:
            problems.append(exc.problem)
    if problems:
        raise fail(*problems)
    try:
        block = block_class(**values)
    except ValidationError as exc:
        raise fail(*_validation_problems(exc, variables)) from None
    return BlockDocument(source=source, name=name, block=block, variables=variables)


class _FieldProblem(Exception):
    def __init__(self, problem: Problem):
        self.problem = problem


def _is_env_reference(value: Any) -> bool:
    return isinstance(value, dict) and list(value) == ["env"]


def _is_secret(path: str, patterns: list[str]) -> bool:
    return any(path == p or fnmatch.fnmatchcase(path, p) for p in patterns)


def _resolve(value: Any, path: str, patterns: list[str], env: Mapping[str, str], variables: dict[str, str]) -> Any:
    """A field's value with ``{env: VARIABLE}`` read from ``env``; a secret written in the file is refused."""
    if _is_env_reference(value):
        variable = value["env"]
        if not isinstance(variable, str) or not variable:
            raise _FieldProblem(Problem(path, value, "names no environment variable; write {env: VARIABLE}"))
        if variable not in env:
            raise _FieldProblem(Problem(path, value, f"the environment variable {variable} is not set; "
                                                     f"set it where you run `e31 blocks apply`"))
        variables[path] = variable
        return env[variable]
    if value is None:
        return None
    if isinstance(value, dict):
        return {k: _resolve(v, f"{path}.{k}", patterns, env, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, f"{path}.{i}", patterns, env, variables) for i, v in enumerate(value)]
    if _is_secret(path, patterns):
        raise _FieldProblem(Problem(path, MISSING, (
            f"is a secret written in the file; no secret is ever written in a file: write "
            f"{path.rsplit('.', 1)[-1]}: {{env: VARIABLE}} and set VARIABLE where you run `e31 blocks apply`")))
    return value


def _validation_problems(exc: ValidationError, variables: dict[str, str]) -> list[Problem]:
    problems = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if field in variables or field.split(".", 1)[0] in variables:
            # Never echo a value read from the environment: it may be a secret.
            variable = variables.get(field) or variables[field.split(".", 1)[0]]
            problems.append(Problem(field, MISSING, f"the value of {variable} {message[0].lower() + message[1:]}"))
        else:
            # A mapping may hold a credential written by mistake: name the field, not its contents.
            shown = error.get("input", MISSING)
            problems.append(Problem(field, MISSING if isinstance(shown, (dict, list)) else shown, message))
    return problems


def block_type(slug: str) -> type[Block] | None:
    """The block class registered under ``slug`` (Prefect's own, e31's and installed collections')."""
    from prefect.blocks.core import Block, UnknownBlockType

    try:
        return Block.get_block_class_from_key(slug)
    except (UnknownBlockType, KeyError):
        return None


def _unknown_type(slug: str) -> str:
    from prefect.blocks.core import Block
    from prefect.utilities.dispatch import get_registry_for_type

    known = sorted(get_registry_for_type(Block) or {})
    close = difflib.get_close_matches(slug, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else "e31's own is e31-storage"
    return f"is not a block type known here; {hint}"


async def apply_blocks(documents: list[BlockDocument]) -> list[str]:
    """Create or update each block on the Prefect server; one line per block saying what was done."""
    from prefect import get_client

    lines = []
    async with get_client() as client:
        for document in documents:
            slug = document.block.get_block_type_slug()
            try:
                await client.read_block_document_by_name(document.name, slug, include_secrets=False)
                verb = "Updated"
            except Exception:
                verb = "Created"
            await document.block.asave(document.name, overwrite=True, client=client)
            read_from = ", ".join(f"{field} from ${variable}" for field, variable in document.variables.items())
            lines.append(f"{verb} {document.type_name} block {document.name!r} ({document.source})"
                         + (f"; {read_from}" if read_from else ""))
    return lines
