#!/usr/bin/env bash
# Make sure a local Docker registry with a password answers (Debian's docker-registry), print how to reach it.
#   eval "$(scripts/registry.sh)"   # exports E31_REGISTRY (host:port), E31_REGISTRY_USER, E31_REGISTRY_PASSWORD
# For the tests of private images: a job's image pulled with a DockerRegistryCredentials block. The engine
# talks to it over plain HTTP, as Docker allows for registries on 127.0.0.0/8.
set -euo pipefail

# Below the kernel's ephemeral range (32768-60999 here): a port in it can be taken at any moment by a
# connection's own end or by a test server bound to port 0 (CI once found 55000 taken that way).
port=${E31_REGISTRY_PORT:-30500}
root=${E31_REGISTRY_ROOT:-/var/lib/e31-registry}
user=e31
password=${E31_REGISTRY_PASSWORD:-e31-registry-password}

answers() { [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/v2/")" = 401 ]; }

if ! answers; then
  if ! command -v docker-registry >/dev/null 2>&1 || ! command -v htpasswd >/dev/null 2>&1; then
    echo "installing docker-registry ..." >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-registry apache2-utils >&2
  fi
  mkdir -p "$root/data"
  htpasswd -Bbn "$user" "$password" > "$root/htpasswd"
  cat > "$root/config.yml" <<CONFIG
version: 0.1
log: {level: warn}
storage: {filesystem: {rootdirectory: $root/data}, delete: {enabled: true}}
http: {addr: 127.0.0.1:$port}
auth: {htpasswd: {realm: e31, path: $root/htpasswd}}
CONFIG
  setsid docker-registry serve "$root/config.yml" >/tmp/e31-registry.log 2>&1 < /dev/null &
  for _ in $(seq 1 60); do answers && break; sleep 0.5; done
  answers || { echo "the registry did not start; see /tmp/e31-registry.log" >&2; exit 1; }
fi
echo "export E31_REGISTRY=127.0.0.1:$port E31_REGISTRY_USER=$user E31_REGISTRY_PASSWORD=$password"
