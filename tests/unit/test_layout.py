"""The package's layout (docs/layout.md): each part imports only itself and the parts below it, no
modules import each other in a cycle, and no module is over 600 lines.

Every ``e31_prefect`` import counts, wherever it is written: at the top, inside a function, under
``TYPE_CHECKING``. The checks read the source with :mod:`ast`; nothing is imported.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "e31_prefect"
MAX_LINES = 600

# The parts, lowest first. A module may import its own part and the parts before it, never one after.
PARTS: list[tuple[str, tuple[str, ...]]] = [
    # What a job's own process imports: no e31 module (job_entry also runs as a file mounted in images
    # without e31), so every part may import them.
    ("job side", ("e31_prefect.dirs", "e31_prefect.job_entry")),
    ("model", ("e31_prefect.model",)),
    ("host", ("e31_prefect.host",)),
    ("data", ("e31_prefect.data",)),
    ("planning", ("e31_prefect.planning",)),
    ("runtimes", ("e31_prefect.runtimes",)),
    ("flows", ("e31_prefect.flows",)),
    ("surface", ("e31_prefect.surface",)),
    ("cli", ("e31_prefect.cli",)),
    # Names stored outside this code (the entry point, deployments' entrypoints, supervisors' command
    # lines) and the package's public names: they point into the parts, and nothing in them imports them.
    ("stable names", ("e31_prefect", "e31_prefect.worker", "e31_prefect.supervisor", "e31_prefect.command_flow",
                      "e31_prefect.flow_shards")),
]
# Imports against the direction, each with its reason.
ALLOWED_UPWARD = {
    ("e31_prefect.job_entry", "e31_prefect.flows.shard_runner"):
        "optional: where e31 is installed in the job's image, a sharded command's shards start at the hand-over",
}


@dataclass(frozen=True)
class Import:
    """One ``e31_prefect`` import: which module makes it, where, and which module it reaches."""

    module: str
    where: str  # file:line, the file from the package's folder on
    target: str


def modules(root: Path) -> dict[str, Path]:
    """Every module under ``root`` (a package folder) by its dotted name; a package by its own name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path], root: Path) -> list[Import]:
    """The package's modules that a module imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from package import module` reaches the module; `from module import name` the module.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in known and "." in target:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target in known and target.split(".")[0] == root.name and target != name:
                found.append(Import(name, f"{path.relative_to(root.parent)}:{node.lineno}", target))
    return found


def part_of(module: str, parts: list[tuple[str, tuple[str, ...]]]) -> int | None:
    """The rank of the module's part (0 the lowest), by the longest prefix naming it; None for none."""
    best: tuple[int, int] | None = None
    for rank, (_, prefixes) in enumerate(parts):
        for prefix in prefixes:
            inside = module == prefix or (module.startswith(prefix + ".") and "." in prefix)
            if inside and (best is None or len(prefix) > best[1]):
                best = (rank, len(prefix))
    return None if best is None else best[0]


def layout_problems(root: Path, parts: list[tuple[str, tuple[str, ...]]] = PARTS,
                    allowed: dict[tuple[str, str], str] = ALLOWED_UPWARD, max_lines: int = MAX_LINES) -> list[str]:
    """What breaks the layout under ``root``, one line each naming the module, the import and the rule."""
    known = modules(root)
    problems = []
    edges: dict[str, list[Import]] = {}
    for name, path in known.items():
        rank = part_of(name, parts)
        if rank is None:
            problems.append(f"{name} is in no part: put it in one of {', '.join(p for p, _ in parts)} "
                            "(tests/unit/test_layout.py PARTS, docs/layout.md)")
        lines = len(path.read_text().splitlines())
        if lines > max_lines:
            problems.append(f"{name} has {lines} lines, over {max_lines}: split it by concern")
        for found in imports(name, path, known, root):
            edges.setdefault(name, []).append(found)
            target_rank = part_of(found.target, parts)
            if None not in (rank, target_rank) and target_rank > rank and (name, found.target) not in allowed:
                problems.append(
                    f"{found.where}: {name} imports {found.target}, but {parts[rank][0]} may not import "
                    f"{parts[target_rank][0]} (a part above it): pass what it needs, or a Protocol")
    problems += [f"import cycle: {cycle}" for cycle in cycles(edges)]
    return problems


def cycles(edges: dict[str, list[Import]]) -> list[str]:
    """One cycle for each group of modules that import each other, as ``a (file:line) -> b (file:line) -> a``:
    the shortest through the group's first module by name."""
    found = []
    for group in _groups(edges):
        start = min(group)
        came: dict[str, Import] = {}
        queue = [start]
        while queue and start not in came:  # breadth first inside the group, back to the start
            module = queue.pop(0)
            for step in edges.get(module, []):
                if step.target in group and step.target not in came:
                    came[step.target] = step
                    queue.append(step.target)
        loop = [came[start]]
        while loop[-1].module != start:
            loop.append(came[loop[-1].module])
        loop.reverse()
        others = sorted(group - {s.module for s in loop})
        found.append(" -> ".join(f"{s.module} ({s.where})" for s in loop) + f" -> {start}"
                     + (f"; in cycles with these too: {', '.join(others)}" if others else ""))
    return found


def _groups(edges: dict[str, list[Import]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for step in edges.get(module, []):
            if step.target not in index:
                visit(step.target)
                low[module] = min(low[module], low[step.target])
            elif step.target in stack:
                low[module] = min(low[module], index[step.target])
        if low[module] == index[module]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(group)

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return sorted(groups, key=min)


def test_the_package_keeps_its_layout():
    """Every part imports only the parts below it, no cycle, no module over 600 lines."""
    problems = layout_problems(PACKAGE)
    assert not problems, "\n".join(problems)


def prefect_requirements() -> set[str]:
    """The distributions Prefect itself requires (any image with Prefect has them), as import names."""
    required = [re.split(r"[ ;<>=!~\[]", line, maxsplit=1)[0] for line in importlib.metadata.requires("prefect") or []
                if "extra ==" not in line]
    return {name.lower().replace("-", "_") for name in required}


def test_the_job_entry_imports_only_the_standard_library_and_prefect():
    """It runs as a file mounted in images that do not have e31-prefect installed: the standard library,
    Prefect and what Prefect requires (certifi, for one) are all it may import."""
    tree = ast.parse((PACKAGE / "job_entry.py").read_text())
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    names += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
    allowed = {*sys.stdlib_module_names, "prefect", *prefect_requirements()}
    outside = [name for name in names if name.split(".")[0] not in allowed
               and ("e31_prefect.job_entry", name) not in ALLOWED_UPWARD]
    assert not outside, f"job_entry.py imports {outside}: it must run where only Python and Prefect are installed"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "e31_prefect"
    for name, text in {"__init__.py": "", "model/__init__.py": "", "surface/__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize("source", [
    "from e31_prefect.surface.worker import E31Worker\n",
    "from e31_prefect.surface import worker\n",
    "import e31_prefect.surface.worker\n",
    "from ..surface.worker import E31Worker\n",
    "def f():\n    from e31_prefect.surface.worker import E31Worker\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from e31_prefect.surface.worker import E31Worker\n",
])
def test_an_import_of_a_part_above_fails_naming_the_module_the_import_and_the_rule(tmp_path, source):
    root = _tree(tmp_path, {"model/job.py": source, "surface/worker.py": "E31Worker = 1\n"})
    [problem] = layout_problems(root)
    assert problem.startswith("e31_prefect/model/job.py:")
    assert ("e31_prefect.model.job imports e31_prefect.surface.worker, but model may not import surface "
            "(a part above it): pass what it needs, or a Protocol") in problem


def test_an_import_of_a_part_below_or_of_its_own_part_passes(tmp_path):
    root = _tree(tmp_path, {"model/job.py": "from e31_prefect.model import timing\n", "model/timing.py": "",
                            "surface/worker.py": "from e31_prefect.model.job import Job\n"})
    assert layout_problems(root) == []


def test_a_cycle_between_modules_of_one_part_fails_naming_each_import(tmp_path):
    root = _tree(tmp_path, {"model/job.py": "from e31_prefect.model import shards\n",
                            "model/shards.py": "def of():\n    from e31_prefect.model.job import Job\n"})
    assert layout_problems(root) == [
        "import cycle: e31_prefect.model.job (e31_prefect/model/job.py:1) -> "
        "e31_prefect.model.shards (e31_prefect/model/shards.py:2) -> e31_prefect.model.job"]


def test_a_module_over_600_lines_or_in_no_part_fails(tmp_path):
    root = _tree(tmp_path, {"model/job.py": "x = 1\n" * 601, "extra.py": "x = 1\n" * 700})
    assert layout_problems(root) == [
        "e31_prefect.extra is in no part: put it in one of job side, model, host, data, planning, runtimes, "
        "flows, surface, cli, stable names (tests/unit/test_layout.py PARTS, docs/layout.md)",
        "e31_prefect.extra has 700 lines, over 600: split it by concern",
        "e31_prefect.model.job has 601 lines, over 600: split it by concern"]
