"""What the e31 side of prefect-docker's own worker tests is given, and how each of its results is classed.

    scripts/prefect-docker-conformance.sh [UPSTREAM]        # runs both sides, then: python THIS table RESULTS

Imported in the scratch folder as ``e31_conformance`` (the e31 variant of upstream's test file imports its
``DockerWorker`` and ``DockerWorkerJobConfiguration`` from here), and run as a script to print the table.

The e31 side's configuration is what a pool made by ``e31 pool migrate DOCKER_POOL E31_POOL --gpus 0
--max-duration 5m`` gives a run of a prefect-docker deployment: the smallest valid e31 job (no GPU, a
five-minute limit) as the pool's default request, and DockerWorker's image as its default image (a run's
``image`` is its job's image on any e31 pool). Upstream's tests build the configuration object themselves
instead of through a pool's template, so the pool's defaults are the class's defaults here.

Each test is classed by comparing its result on the stock ``DockerWorker`` (the control) with e31's:

- ``conforms``: the same result;
- ``refused``: e31 refused the run by name (an ``InvalidJob`` naming the setting, or a Docker error quoted in
  a ``NotStarted`` state instead of raised), which its output shows;
- ``silent``: a difference no message names, listed in :data:`KNOWN` with the reason and the row of
  docs/operating.md's DockerWorker table that names it (a row the docs lack makes it ``unnamed``);
- ``bug``: any other difference, until someone explains it here.
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# Words of e31's refusals, as a run's state or the worker's log says them.
REFUSALS = ("The run's worker settings are not valid", "The job is not valid", "is not an e31 setting",
            "The work did not start")

# Silent differences, by the start of upstream's test name: (why, the phrase of docs/operating.md's table row).
KNOWN: dict[str, tuple[str, str]] = {
    "test_task_infra_pid_includes_host_and_container_id": (
        "the infrastructure id is e31:HOST:FLOW_RUN_ID", "e31:HOST:FLOW_RUN_ID"),
    "test_task_status_receives_result_identifier": (
        "task_status gets the infrastructure id once the work started", "e31:HOST:FLOW_RUN_ID"),
    "test_container_result": ("containers are removed after the run", "removed once e31 read how it ended"),
    "test_container_name_collision": ("containers are removed after the run", "removed once e31 read how it ended"),
    "test_container_metadata": ("containers are removed after the run", "removed once e31 read how it ended"),
    "test_stream_container_logs": ("output goes to the run's log", "the run's output log"),
    "test_logs_warning_when_container_marked_for_removal": ("output goes to the run's log", "the run's output log"),
    "test_logs_when_unexpected_docker_error": ("output goes to the run's log", "the run's output log"),
    "test_uses_label_setting": ("every container also gets an e31.job label", "`e31.job` label"),
    "test_uses_env_setting": ("the worker's environment never reaches the container",
                              "never the worker's environment"),
    "test_allows_unsetting_environment_variables": ("the worker's environment never reaches the container",
                                                    "never the worker's environment"),
}


# -- the e31 side's configuration (imported as e31_conformance in the scratch folder) -------------

def _e31_side() -> tuple[Any, Any]:
    from prefect.utilities.dockerutils import get_prefect_image_name
    from pydantic import Field

    from e31_prefect.surface.worker_configuration import E31JobConfiguration
    from e31_prefect.worker import E31Worker

    class MigratedJobConfiguration(E31JobConfiguration):
        """A run of a prefect-docker deployment on a pool made by e31 pool migrate --gpus 0 --max-duration 5m:
        the pool's defaults are its request and DockerWorker's image."""

        image: str | None = Field(default_factory=get_prefect_image_name)
        request: Any = Field(default_factory=lambda: {"gpus": 0, "max_duration": "5m"})

    return E31Worker, MigratedJobConfiguration


if __name__ != "__main__":
    DockerWorker, DockerWorkerJobConfiguration = _e31_side()


# -- the table --------------------------------------------------------------------------------------

def results(folder: Path) -> dict[str, tuple[str, str]]:
    """Each test of one side: its outcome and all it printed (failure, captured output and logs)."""
    found = {line.split("::", 1)[1]: ("no result (chunk timed out?)", "")
             for line in (folder / "ids").read_text().splitlines() if "::" in line}
    for report in folder.glob("*.xml"):
        for case in ET.parse(report).iter("testcase"):
            classname = case.get("classname", "").split(".")
            test = "::".join([*classname[1:], case.get("name", "")])  # "test_worker.Class" -> "Class::name"
            outcome, text = "passed", []
            for child in case:
                text.append((child.get("message") or "") + "\n" + (child.text or ""))
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                    if child.tag == "error" and "teardown" in (child.get("message") or ""):
                        outcome = "passed, error at teardown"
            found[test] = (outcome, "\n".join(text))
    return found


def classify(test: str, control: str, e31: str, printed: str, docs: str) -> tuple[str, str]:
    """A test's class and why (see the module's docstring)."""
    if e31 == control:
        return "conforms", ""
    refusal = next((words for words in REFUSALS if words in printed), None)
    if refusal:
        named = re.search(r"(?m)^\s*([\w.]+(?: = [^:\n]{0,60})?): (?:is not an e31 setting|would|mounts|e31 sets)",
                          printed)
        return "refused", named.group(1) if named else refusal
    name = test.split("::")[-1]
    known = next((why for prefix, why in KNOWN.items() if name.startswith(prefix)), None)
    if known is None:
        return "bug", "a difference nobody has explained: read its log"
    reason, row = known
    return ("silent", reason) if row in docs else ("unnamed", f"{reason}; docs/operating.md lacks {row!r}")


def table(scratch: Path, docs_file: Path) -> int:
    """Print each test's results and class, then the totals; 1 if any bug or unnamed difference."""
    control, e31 = results(scratch / "results" / "control"), results(scratch / "results" / "e31")
    docs = docs_file.read_text()
    rows = []
    for test in sorted(control.keys() | e31.keys()):
        (a, _), (b, printed) = control.get(test, ("-", "")), e31.get(test, ("-", ""))
        rows.append((test, a, b, *classify(test, a, b, printed, docs)))
    width = max(len(row[0]) for row in rows)
    print(f"{'test':<{width}}  {'control':<10}  {'e31':<10}  {'class':<9}  why")
    for row in rows:
        print(f"{row[0]:<{width}}  {row[1]:<10}  {row[2]:<10}  {row[3]:<9}  {row[4]}")
    totals = {name: sum(row[3] == name for row in rows) for name in ("conforms", "refused", "silent", "unnamed",
                                                                    "bug")}
    print(f"\n{len(rows)} tests: " + ", ".join(f"{count} {name}" for name, count in totals.items()))
    return 1 if totals["bug"] or totals["unnamed"] else 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["table"] or len(sys.argv) != 4:
        sys.exit("usage: prefect_docker_conformance.py table SCRATCH DOCS_FILE")
    sys.exit(table(Path(sys.argv[2]), Path(sys.argv[3])))
