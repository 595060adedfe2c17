#!/usr/bin/env bash
# Run prefect-docker's own worker tests against the e31 worker, with the stock DockerWorker as the control,
# and class each e31 result: conforms, named (refused or failed by name), silent (a difference
# docs/operating.md names), harness (upstream's mock; checked on the real engine instead) or bug.
#   scripts/prefect-docker-conformance.sh [UPSTREAM]     # then read the per-test table and the totals it prints
# UPSTREAM: a prefect-docker checkout (the folder holding tests/test_worker.py), or a git dir of Prefect's
# monorepo (default: /work/.mirror/PrefectHQ+prefect/repo, its HEAD). A maintainer's tool, not part of CI:
# it exits 1 while a difference is a bug or one the docs do not name (issues 22 and 34).
#
# Upstream's code is never copied into this repository: it goes to a scratch folder (E31_CONFORMANCE_DIR,
# default /tmp/prefect-docker-conformance), once as it is (control) and once with its worker import pointing
# at scripts/prefect_docker_conformance.py (copied there as e31_conformance.py): E31Worker, and the job
# configuration a run of a prefect-docker deployment gets on a pool made by `e31 pool migrate` (the smallest
# valid e31 job, its image the job's). Both run in the current Python (the project's venv), in chunks of node
# ids (E31_CONFORMANCE_CHUNK tests, each chunk at most E31_CONFORMANCE_TIMEOUT seconds), so one slow chunk does
# not hold back the rest. pytest-asyncio (which upstream's tests need and this project does not) is installed
# into the scratch folder. Upstream's test server is given E31_CONFORMANCE_SERVER_SECONDS (default 180) to
# start, not its 30: on a loaded machine it times out, and every test of the chunk errors on both sides.
# Needs a Docker engine (DOCKER_HOST) for the few tests that use a real one.
set -euo pipefail

upstream=${1:-/work/.mirror/PrefectHQ+prefect/repo}
scratch=${E31_CONFORMANCE_DIR:-/tmp/prefect-docker-conformance}
chunk=${E31_CONFORMANCE_CHUNK:-40}
limit=${E31_CONFORMANCE_TIMEOUT:-1200}
python=${PYTHON:-python}
here=$(cd "$(dirname "$0")" && pwd)
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=${E31_CONFORMANCE_SERVER_SECONDS:-180}
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
cp "$here/prefect_docker_conformance.py" e31_conformance.py
"$python" - <<'PY'
from pathlib import Path

source = Path("test_worker.py").read_text()
stock = "from prefect_docker.worker import (\n    CONTAINER_LABELS,\n    DockerWorker,\n    DockerWorkerJobConfiguration,\n)"
if stock not in source:
    raise SystemExit("upstream's worker import changed; update the e31 variant's replacement in this script")
Path("test_worker_e31.py").write_text(source.replace(stock, (
    "from prefect_docker.worker import CONTAINER_LABELS\n"
    "from e31_conformance import DockerWorker, DockerWorkerJobConfiguration")))
# The test server's start-up time, from the setting above (both variants share this conftest).
conftest = Path("conftest.py").read_text()
if "prefect_test_harness():" not in conftest:
    raise SystemExit("upstream's test harness call changed; update its start-up timeout in this script")
Path("conftest.py").write_text(conftest.replace("prefect_test_harness():",
                                                "prefect_test_harness(server_startup_timeout=None):"))
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
  mapfile -t ids < <(PYTHONPATH="$scratch:$scratch/deps" "$python" -m pytest -p no:cacheprovider --collect-only -q "$file" \
                     | grep '::')
  printf '%s\n' "${ids[@]}" > "results/$variant/ids"
  for ((at = 0; at < ${#ids[@]}; at += chunk)); do
    part=$((part + 1))
    local -a group=("${ids[@]:at:chunk}")
    echo "$variant: chunk $part (${#group[@]} tests)" >&2
    # A temporary E31_HOME: the e31 worker's ledger and workspaces never touch the user's.
    E31_HOME="$scratch/home-$variant-$part" PYTHONPATH="$scratch:$scratch/deps" timeout "$limit" \
      "$python" -m pytest -n 0 -p no:cacheprovider --tb=native -q -rfE -o junit_logging=all "${group[@]}" \
      --junitxml "results/$variant/$part.xml" > "results/$variant/$part.log" 2>&1 || true
  done
}

# E31_CONFORMANCE_VARIANTS="e31": run e31's side again only, against the control's last results.
for variant in ${E31_CONFORMANCE_VARIANTS:-control e31}; do
  run_variant "$variant" "$([ "$variant" = control ] && echo test_worker.py || echo test_worker_e31.py)"
done

echo "Logs: $scratch/results/<variant>/<chunk>.log" >&2
exec "$python" "$here/prefect_docker_conformance.py" table "$scratch" "$here/.."
