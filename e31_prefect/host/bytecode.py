"""e31's own modules compiled to bytecode once per worker start, as pip does for a package it installs.

Each run's supervisor is a new interpreter that imports e31's host modules. Where they have no current
bytecode (an editable install, a source tree, ``PYTHONDONTWRITEBYTECODE`` in the worker's environment), it
compiles them at every start: about 65 ms of host CPU a run, for nothing. Compiling them once, where the
package's folder is writable, spares that; where it is not (a read-only install), nothing changes.
"""

from __future__ import annotations

import compileall
import contextlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # e31_prefect, this module's package's package


def compile_own_modules(package: Path = PACKAGE) -> bool:
    """Write current bytecode for every module of the e31_prefect package (an up-to-date one is only read).
    True where every module has it."""
    with contextlib.suppress(OSError):
        return bool(compileall.compile_dir(package, quiet=2))
    return False
