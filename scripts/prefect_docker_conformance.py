"""What the e31 side of prefect-docker's own worker tests is given, and how each of its results is classed.

    scripts/prefect-docker-conformance.sh [UPSTREAM]        # runs both sides, then: python THIS table SCRATCH REPO
    python scripts/prefect_docker_conformance.py table /tmp/prefect-docker-conformance . --markdown  # the docs' rows

Imported in the scratch folder as ``e31_conformance`` (the e31 variant of upstream's test file imports its
``DockerWorker`` and ``DockerWorkerJobConfiguration`` from here), and run as a script to print the table.

The e31 side's configuration is what a pool made by ``e31 pool migrate DOCKER_POOL E31_POOL --gpus 0
--max-duration 5m`` gives a run of a prefect-docker deployment: the smallest valid e31 job (no GPU, a
five-minute limit) as the pool's default request, and DockerWorker's image as its default image (a run's
``image`` is its job's image on any e31 pool). Upstream's tests build the configuration object themselves
instead of through a pool's template, so the pool's defaults are the class's defaults here.

Each test is classed by comparing its result on the stock ``DockerWorker`` (the control) with e31's:

- ``conforms``: the same result, and e31 refused nothing;
- ``named``: e31 refused the run by name (``InvalidJob`` naming each setting), or ended it quoting the
  engine's error (``NotStarted``) or raised naming what it takes instead, as its output shows;
- ``silent``: a difference no message names, listed in :data:`KNOWN` with why and the words of the row of
  docs/operating.md's table of prefect-docker's settings that names it (``unnamed`` while the table lacks them);
- ``harness``: a difference upstream's mock makes, listed in :data:`KNOWN` with the test of
  tests/integration/test_docker_conformance.py that checks the same on the real engine, on both workers
  (upstream mocks the Docker client in the worker's process; e31's supervisor, another process, watches the
  container on the real engine, where the mocked one does not exist, and ends the run ``NotStarted``);
- ``bug``: any other difference, until someone explains it here.
"""

from __future__ import annotations

import re
import sys
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# What e31 says as it refuses a run, or ends it on the engine's error, by name (not "The work did not start: the
# job's process ended", which is how a mocked container ends: see harness).
REFUSED = re.compile(r"The run's worker settings are not valid:\n|The job is not valid:\n")
NAMED = re.compile(r"is not an e31 run's infrastructure id|The work did not start: \w+(Error|Exception)\b")
INTEGRATION = "tests/integration/test_docker_conformance.py"
GATEWAY = ("a job reaches Prefect through its run's gateway: e31 neither rewrites PREFECT_API_URL nor adds a "
           "host-gateway host, nor warns about either", "through its run's gateway")

# The differences no message names, by the start of upstream's test name: (class, why, where it is named or checked).
KNOWN: dict[str, tuple[str, str, str]] = {
    "test_uses_label_setting": ("silent", "every container also gets e31's e31.job label", "`e31.job`"),
    "test_uses_env_setting": ("silent", "the container's environment is Prefect's for the run (less the worker's "
                              "credentials, server settings and home), the job's and e31's", "its API URL"),
    "test_replaces_localhost_api_with_dockerhost": ("silent", *GATEWAY),
    "test_adds_docker_host_gateway_on_linux": ("silent", *GATEWAY),
    "test_warns_if_docker_version_does_not_support_host_gateway_on_linux": ("silent", *GATEWAY),
    "test_task_infra_pid_includes_host_and_container_id": ("silent", "the infrastructure id is e31:HOST:FLOW_RUN_ID",
                                                           "e31:HOST:FLOW_RUN_ID"),
    "test_stream_container_logs": ("silent", "the container's output goes to the run's log, not the worker's",
                                   "not the worker's console"),
    "test_logs_warning_when_container_marked_for_removal": (
        "silent", "the run's supervisor reads the output: prefect-docker's streaming warnings never appear",
        "streaming warnings never appear"),
    "test_logs_when_unexpected_docker_error": (
        "silent", "the run's supervisor reads the output: prefect-docker's streaming warnings never appear",
        "streaming warnings never appear"),
    "test_task_status_receives_result_identifier": (
        "harness", "task_status gets the infrastructure id once the work started; here it never starts",
        "test_initiate_run_returns_once_started_and_the_run_lives_on"),
    "test_emits_events": ("harness", "created is emitted; running and exited need a container the engine has",
                          "test_container_events_created_running_exited_about_the_container_and_its_run"),
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

    with warnings.catch_warnings():  # it takes the place of E31Worker as type "e31", which Prefect warns of
        warnings.simplefilter("ignore", UserWarning)

        class MigratedWorker(E31Worker):
            """The e31 worker of such a pool: a run's configuration is built with the pool's defaults."""

            job_configuration = MigratedJobConfiguration

    return MigratedWorker, MigratedJobConfiguration


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


def classify(test: str, control: str, e31: str, printed: str, docs: str, checks: str) -> tuple[str, str]:
    """A test's class and why (see the module's docstring). ``docs``: docs/operating.md; ``checks``: the
    integration tests that check on the real engine what upstream's mock cannot."""
    refused = REFUSED.search(printed)
    if refused:  # a pass after a refusal says nothing: the run never got as far as the test looks
        return "named", printed[refused.end():].split("\n", 1)[0].strip()[:70]
    if e31 == control:
        return "conforms", ""
    named = NAMED.search(printed)
    if named:
        return "named", named.group(0)
    name = test.split("::")[-1]
    known = next((entry for prefix, entry in KNOWN.items() if name.startswith(prefix)), None)
    if known is None:
        return "bug", "a difference nobody has explained: read its log"
    kind, why, where = known
    if kind == "harness":
        return ("harness", f"{why} ({where})") if f"def {where}(" in checks else (
            "bug", f"{why}; {INTEGRATION} lacks {where}")
    return ("silent", why) if where in docs else ("unnamed", f"{why}; docs/operating.md lacks {where!r}")


def settings_table(operating: Path) -> str:
    """The section of docs/operating.md that names prefect-docker's settings on an e31 pool."""
    text = operating.read_text()
    start = text.index("## prefect-docker's settings on an e31 pool")
    return text[start:text.index("\n#", start + 1)]


def table(scratch: Path, repo: Path, markdown: bool = False) -> int:
    """Print each test's results and class, then the totals; 1 if any bug or unnamed difference.

    ``markdown``: only the tests that do not conform, as the rows of docs/operating.md's table.
    """
    control, e31 = results(scratch / "results" / "control"), results(scratch / "results" / "e31")
    docs, checks = settings_table(repo / "docs" / "operating.md"), (repo / INTEGRATION).read_text()
    rows = []
    for test in sorted(control.keys() | e31.keys()):
        (a, _), (b, printed) = control.get(test, ("-", "")), e31.get(test, ("-", ""))
        rows.append((test, a, b, *classify(test, a, b, printed, docs, checks)))
    classes = ("conforms", "named", "silent", "harness", "unnamed", "bug")
    totals = {name: sum(row[3] == name for row in rows) for name in classes}
    if markdown:
        print("| upstream test | DockerWorker | e31 | class | why |\n| --- | --- | --- | --- | --- |")
        for test, a, b, kind, why in sorted(rows, key=lambda row: (classes.index(row[3]), row[0])):
            if kind != "conforms":
                shown = why.split(": ", 1)[0] if kind == "named" and " = " in why else why
                print(f"| `{test.split('::')[-1]}` | {a} | {b} | {kind} | {shown.replace('|', '/')} |")
    else:
        width = max(len(row[0]) for row in rows)
        print(f"{'test':<{width}}  {'control':<10}  {'e31':<10}  {'class':<9}  why")
        for row in rows:
            print(f"{row[0]:<{width}}  {row[1]:<10}  {row[2]:<10}  {row[3]:<9}  {row[4]}")
    print(f"\n{len(rows)} tests: " + ", ".join(f"{count} {name}" for name, count in totals.items()))
    return 1 if totals["bug"] or totals["unnamed"] else 0


if __name__ == "__main__":
    arguments = [argument for argument in sys.argv[1:] if argument != "--markdown"]
    if arguments[:1] != ["table"] or len(arguments) != 3:
        sys.exit("usage: prefect_docker_conformance.py table SCRATCH REPO [--markdown]")
    sys.exit(table(Path(arguments[1]), Path(arguments[2]), "--markdown" in sys.argv))
