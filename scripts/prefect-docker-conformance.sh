#!/usr/bin/env bash
# Run prefect-docker's own worker tests against the e31 worker, with the stock DockerWorker as the control.
#   scripts/prefect-docker-conformance.sh [UPSTREAM]     # then read the per-test table it prints
# UPSTREAM: a prefect-docker checkout (the folder holding tests/test_worker.py), or a git dir of Prefect's
# monorepo (default: /work/.mirror/PrefectHQ+prefect/repo, its HEAD). A maintainer's tool, not part of CI:
# issue 22's "done when" is that every difference it shows is the stock result or a refusal the README names.
#
# Upstream's code is never copied into this repository: it goes to a scratch folder (E31_CONFORMANCE_DIR,
# default /tmp/prefect-docker-conformance), once as it is (control) and once with its worker import
# pointing at E31Worker and E31JobConfiguration. Both run in the current Python (the project's venv), in
# chunks of node ids (E31_CONFORMANCE_CHUNK tests, each chunk at most E31_CONFORMANCE_TIMEOUT seconds), so
# one slow chunk does not hold back the rest. pytest-asyncio (which upstream's tests need and this project
# does not) is installed into the scratch folder. Needs a Docker engine (DOCKER_HOST) for the few tests
# that use a real one. Prints: test id, control result, e31 result, and whether they differ.
set -euo pipefail

upstream=${1:-/work/.mirror/PrefectHQ+prefect/repo}
scratch=${E31_CONFORMANCE_DIR:-/tmp/prefect-docker-conformance}
chunk=${E31_CONFORMANCE_CHUNK:-40}
limit=${E31_CONFORMANCE_TIMEOUT:-1200}
python=${PYTHON:-python}
in_monorepo=src/integrations/prefect-docker/tests

mkdir -p "$scratch"
if [ -f "$upstream/tests/test_worker.py" ]; then
  cp "$upstream/tests/test_worker.py" "$upstream/tests/conftest.py" "$scratch/"
elif git --git-dir="$upstream" rev-parse --verify -q HEAD >/dev/null; then
  for name in test_worker.py conftest.py; do
    git --git-dir="$upstream" show "HEAD:$in_monorepo/$name" > "$scratch/$name"
  done
  echo "upstream: $(git --git-dir="$upstream" rev-parse --short HEAD) ($in_monorepo)" >&2
else
  echo "no prefect-docker tests at $upstream: give a prefect-docker checkout or a git dir of PrefectHQ/prefect" >&2
  exit 2
fi
cd "$scratch"
echo "installed: $("$python" -c 'import importlib.metadata as m; print("prefect", m.version("prefect"), "prefect-docker", m.version("prefect-docker"))')" >&2

# The e31 variant: the same file, its worker and job configuration being e31's (the import is its only change).
"$python" - <<'PY'
from pathlib import Path

source = Path("test_worker.py").read_text()
stock = "from prefect_docker.worker import (\n    CONTAINER_LABELS,\n    DockerWorker,\n    DockerWorkerJobConfiguration,\n)"
if stock not in source:
    raise SystemExit("upstream's worker import changed; update the e31 variant's replacement in this script")
Path("test_worker_e31.py").write_text(source.replace(stock, (
    "from prefect_docker.worker import CONTAINER_LABELS\n"
    "from e31_prefect.worker import E31Worker as DockerWorker\n"
    "from e31_prefect.worker import E31JobConfiguration as DockerWorkerJobConfiguration")))
PY

cat > pytest.ini <<'INI'
[pytest]
asyncio_mode = auto
asyncio_default_fixture_loop_scope = session
markers =
    service(arg): a service integration test
    enable_api_log_handler: api log handler
    clear_db: clear db
INI

if ! PYTHONPATH="$scratch/deps" "$python" -c 'import pytest_asyncio' 2>/dev/null; then
  "$python" -m pip install -q --no-deps --target "$scratch/deps" 'pytest-asyncio>=1.1,<1.5' >&2
fi

run_variant() {  # $1: control or e31; $2: the test file
  local variant=$1 file=$2 part=0 at
  local -a ids
  rm -rf "results/$variant" && mkdir -p "results/$variant"
  # Node ids one a line, as pytest prints them (they hold backslashes and brackets: never word-split them).
  mapfile -t ids < <(PYTHONPATH="$scratch/deps" "$python" -m pytest -p no:cacheprovider --collect-only -q "$file" \
                     | grep '::')
  printf '%s\n' "${ids[@]}" > "results/$variant/ids"
  for ((at = 0; at < ${#ids[@]}; at += chunk)); do
    part=$((part + 1))
    local -a group=("${ids[@]:at:chunk}")
    echo "$variant: chunk $part (${#group[@]} tests)" >&2
    # A temporary E31_HOME: the e31 worker's ledger and workspaces never touch the user's.
    E31_HOME="$scratch/home-$variant-$part" PYTHONPATH="$scratch/deps" timeout "$limit" \
      "$python" -m pytest -n 0 -p no:cacheprovider --tb=native -q -rfE "${group[@]}" \
      --junitxml "results/$variant/$part.xml" > "results/$variant/$part.log" 2>&1 || true
  done
}

run_variant control test_worker.py
run_variant e31 test_worker_e31.py

"$python" - <<'PY'
"""The per-test table: each test id, its result on the stock worker and on e31."""
import xml.etree.ElementTree as ET
from pathlib import Path


def results(variant: str, file: str) -> dict[str, str]:
    found = {line.split("::", 1)[1]: "no result (chunk timed out?)"
             for line in Path(f"results/{variant}/ids").read_text().splitlines() if "::" in line}
    for report in Path(f"results/{variant}").glob("*.xml"):
        for case in ET.parse(report).iter("testcase"):
            classname = case.get("classname", "").split(".")
            test = "::".join([*classname[1:], case.get("name", "")])  # "test_worker.Class" -> "Class::name"
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                    if child.tag == "error" and "teardown" in (child.get("message") or ""):
                        outcome = "passed, error at teardown"
            found[test] = outcome
    return found


control, e31 = results("control", "test_worker.py"), results("e31", "test_worker_e31.py")
width = max(map(len, control)) if control else 10
print(f"{'test':<{width}}  {'control':<10}  {'e31':<10}  differs")
for test in sorted(control.keys() | e31.keys()):
    a, b = control.get(test, "-"), e31.get(test, "-")
    print(f"{test:<{width}}  {a:<10}  {b:<10}  {'DIFF' if a != b else ''}")
differ = sum(control.get(t) != e31.get(t) for t in control.keys() | e31.keys())
print(f"\n{len(control)} tests; {differ} differ. Logs: {Path('results').resolve()}/<variant>/<chunk>.log")
PY
