#!/usr/bin/env bash
# Make sure a Docker engine answers, and print the DOCKER_HOST to use.
#   eval "$(scripts/docker-engine.sh)"
# An engine that already answers (a developer's own) is reused. Otherwise Debian's docker.io
# is installed if missing and dockerd is started on its own socket with no bridge (no iptables
# needed), on overlay2 where the kernel mounts overlayfs, else on vfs (slow: every container
# copies its whole image).
set -euo pipefail

if docker info >/dev/null 2>&1; then
  echo "export DOCKER_HOST=${DOCKER_HOST:-unix:///var/run/docker.sock}"
  exit 0
fi
SOCKET=/run/e31-docker.sock
if DOCKER_HOST=unix://$SOCKET docker info >/dev/null 2>&1; then
  echo "export DOCKER_HOST=unix://$SOCKET"
  exit 0
fi
if ! command -v dockerd >/dev/null 2>&1; then
  echo "installing docker.io ..." >&2
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >&2
fi
driver=vfs
probe=$(mktemp -d)
mkdir -p "$probe"/{lower,upper,work,merged}
if mount -t overlay overlay -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" \
     "$probe/merged" 2>/dev/null; then
  umount "$probe/merged"
  driver=overlay2
fi
rm -rf "$probe"
mkdir -p "/var/lib/e31-docker-$driver"
rm -f /run/e31-docker.pid
setsid dockerd --data-root "/var/lib/e31-docker-$driver" --storage-driver "$driver" \
  --iptables=false --bridge=none -H "unix://$SOCKET" \
  --pidfile /run/e31-docker.pid >/tmp/e31-dockerd.log 2>&1 < /dev/null &
for _ in $(seq 1 60); do
  if DOCKER_HOST=unix://$SOCKET docker info >/dev/null 2>&1; then
    echo "export DOCKER_HOST=unix://$SOCKET"
    exit 0
  fi
  sleep 1
done
echo "dockerd did not start; see /tmp/e31-dockerd.log" >&2
tail -20 /tmp/e31-dockerd.log >&2
exit 1
