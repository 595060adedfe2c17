"""Where a flow run's work executes: a local process, or a container on the host's Docker engine.

Both runtimes stop the work at its time limit or when asked (cancellation), and say how it ended.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunOutcome:
    """How a run's work ended: its exit code, and whether the worker stopped it and why."""

    exit_code: int
    timed_out: bool = False
    stopped: bool = False
    out_of_memory: bool = False
