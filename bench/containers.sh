#!/usr/bin/env bash
# Image sizes, build times and start times of rlvr-ops's containers (docs/benchmarks.md, "Containers").
#   bash bench/containers.sh BENTO_TAG [--fresh]      (as root; BENTOML_HOME: the Bento's store)
# Builds, with an empty layer cache, the policy image of BENTO_TAG and the code-location image, then
# each again from podman's layer cache (nothing changed: the base and the package layers reused); starts each
# image and times it to /readyz (policy) and to a passing `dagster api grpc-health-check` (code
# location). --fresh rebuilds the base image first. Removes what it built, except the base image.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 BENTO_TAG [--fresh]" >&2; exit 2; }
bento=$1
export CONTAINERS_CONF="$PWD/deploy/container/containers.conf" BENTOML_DO_NOT_TRACK=True
py=.venv/bin/python
policy=localhost/rlvr-bench-policy:latest code=localhost/rlvr-bench-code-location:latest

seconds() { local start=$SECONDS; "$@" >/dev/null 2>"$log" || { tail -40 "$log" >&2; exit 1; }; echo $((SECONDS - start)); }
size_mb() { podman image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f", $1 / 1e6}'; }
log=$(mktemp)
trap 'rm -f "$log"; podman rm -f rlvr-bench-policy rlvr-bench-code >/dev/null 2>&1 || true' EXIT

podman rmi -f "$policy" "$code" >/dev/null 2>&1 || true
podman image prune -f >/dev/null  # the dangling layers of earlier builds: no cache for the cold builds
if [ "${2:-}" = --fresh ]; then
  podman rmi -f "$(bash deploy/container/base-image.sh 2>/dev/null)" rlvr-base:bookworm-py311 >/dev/null 2>&1 || true
  echo "base image (debootstrap): $(seconds bash deploy/container/base-image.sh) s"
fi
base=$(bash deploy/container/base-image.sh)
echo "base image $base: $(size_mb "$base") MB"

echo "policy image, cold: $(seconds $py deploy/container/build_images.py policy "$bento" --tag "$policy") s, $(size_mb "$policy") MB"
echo "policy image, cached (same Bento): $(seconds $py deploy/container/build_images.py policy "$bento" --tag "$policy") s"
echo "code-location image, cold: $(seconds $py deploy/container/build_images.py code-location --tag "$code") s, $(size_mb "$code") MB"
echo "code-location image, cached (same tree): $(seconds $py deploy/container/build_images.py code-location --tag "$code") s"

port=3900 start=$SECONDS
export RLVR_API_KEYS="${RLVR_API_KEYS:-$($py -c 'import secrets; print(secrets.token_urlsafe(32))')}"  # the service serves no one without a key
bash deploy/container/run-policy.sh "$policy" "$(mktemp -d)/traffic" $port rlvr-bench-policy >/dev/null
until curl -sf -o /dev/null "http://127.0.0.1:$port/readyz"; do sleep 0.5; done
echo "policy container, start to /readyz 200: $((SECONDS - start)) s"

start=$SECONDS
podman run -d --name rlvr-bench-code -p 127.0.0.1:3901:4000 "$code" >/dev/null
until .venv/bin/dagster api grpc-health-check -h 127.0.0.1 -p 3901 >/dev/null 2>&1; do sleep 1; done
echo "code-location container, start to a passing grpc-health-check: $((SECONDS - start)) s"
podman rmi -f "$policy" "$code" >/dev/null 2>&1 || true
