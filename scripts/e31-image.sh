#!/usr/bin/env bash
# Build (once) a local image holding Python, Prefect and this package, and print its tag.
#   E31_TEST_IMAGE=$(scripts/e31-image.sh)
# No registry is needed: the base is debootstrapped Debian, packages are host-made wheels,
# and `docker build` runs with no network. The tag is a hash of the inputs, so an image
# is rebuilt only when they change; the dependency layer is cached by docker on its own.
set -euo pipefail
cd "$(dirname "$0")/.."

# One build at a time (parallel test sessions each ask for the image at once); the others then reuse it.
exec 9>"${TMPDIR:-/tmp}/e31-image.lock"
flock 9

inputs=$( (cat constraints.txt pyproject.toml docker/Dockerfile scripts/e31-image.sh;
           find e31_prefect -name '*.py' | sort | xargs cat) | sha256sum | cut -c1-12)
tag="e31-prefect-job:$inputs"
if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "$tag"
  exit 0
fi

if ! docker image inspect e31-python-base:bookworm >/dev/null 2>&1; then
  command -v debootstrap >/dev/null 2>&1 || {
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >&2
  }
  mirror=$(grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | awk '{print $2}')
  rootfs=$(mktemp -d /var/tmp/e31-rootfs.XXXXXX)
  echo "debootstrapping a Python base image from ${mirror:-http://deb.debian.org/debian} ..." >&2
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}" >&2
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb
  tar -C "$rootfs" -c . | docker import - e31-python-base:bookworm >&2
  rm -rf "$rootfs"
fi

context=$(mktemp -d /var/tmp/e31-image.XXXXXX)
trap 'rm -rf "$context"' EXIT
mkdir -p "$context/deps" "$context/project"
cp docker/Dockerfile "$context/"
python3 -m pip wheel --quiet --no-deps -w "$context/project" . >&2
# The project's runtime dependencies at the tested versions, as wheels for the image's Python
# (Debian's 3.11.2: markers such as python_full_version < "3.11.3" must be judged for it).
python3 -m pip download --quiet --only-binary=:all: --python-version 3.11.2 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -c constraints.txt -d "$context/deps" "$context"/project/*.whl "async-timeout>=4.0.3" >&2
rm -f "$context"/deps/e31_prefect-*.whl
docker build --network none -t "$tag" "$context" >&2
# Older builds of the image are dead weight once this one exists; but another checkout on this engine may
# be testing with its own build right now, so only builds over a day old go.
cutoff=$(( $(date +%s) - 86400 ))
docker images e31-prefect-job --format '{{.Tag}}|{{.CreatedAt}}' | while IFS='|' read -r old created; do
  made=$(date -d "${created% *}" +%s 2>/dev/null || echo "$cutoff")  # "2026-12-06 04:59:51 +0000 UTC"
  if [ "$old" != "$inputs" ] && [ "$made" -lt "$cutoff" ]; then
    docker rmi "e31-prefect-job:$old" >/dev/null 2>&1 || true
  fi
done
echo "$tag"
