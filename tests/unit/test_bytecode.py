"""A worker compiles e31's own modules once, so each run's supervisor (a new interpreter) loads them."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import e31_prefect
from e31_prefect.host.bytecode import PACKAGE, compile_own_modules


def test_every_module_a_supervisor_imports_has_current_bytecode_after_the_workers_start():
    package = Path(e31_prefect.__file__).parent
    assert package.resolve() == PACKAGE
    cached = Path(importlib.util.cache_from_source(str(package / "host" / "supervisor.py")))
    shutil.rmtree(cached.parent, ignore_errors=True)  # as an editable install with PYTHONDONTWRITEBYTECODE has it
    assert compile_own_modules()
    for module in ("supervisor.py", "host/supervisor.py", "host/gateway.py", "host/supervised_work.py"):
        source = package / module
        compiled = Path(importlib.util.cache_from_source(str(source)))
        # Current as Python judges it: the source's modification time (seconds), recorded in the header.
        assert int.from_bytes(compiled.read_bytes()[8:12], "little") == int(source.stat().st_mtime), module


def test_a_package_folder_it_may_not_write_changes_nothing_and_fails_nothing(tmp_path):
    read_only = tmp_path / "e31_prefect"
    read_only.mkdir()
    (read_only / "__init__.py").write_text("")
    read_only.chmod(0o555)
    try:
        assert compile_own_modules(read_only) is (os.geteuid() == 0)  # root writes anywhere; others are told no
    finally:
        read_only.chmod(0o755)
