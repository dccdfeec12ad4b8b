#!/usr/bin/env bash
# Start a policy image (deploy/container/build_images.py policy) as a detached podman container:
#   run-policy.sh IMAGE TRAFFIC_DIR [PORT] [NAME] [podman run options...]
# It serves on 127.0.0.1:PORT (default 3000) and writes its traffic logs into the host folder
# TRAFFIC_DIR, mounted at /data/rlvr/traffic (RLVR_TRAFFIC_DIR), where the monitoring assets on the host
# read them (TRAFFIC_DIR = $RLVR_HOME/traffic). A container of the same NAME (default rlvr-policy) is
# replaced. Further options go to `podman run` (a GPU: --device nvidia.com/gpu=all). Prints the container's id.
# API keys (deploy/README.md, Security): RLVR_API_KEYS (comma-separated) or RLVR_API_KEYS_FILE, a host file
# of one key a line (`make container` makes one); RLVR_METRICS_TOKEN for /metrics; RLVR_RATE_PER_KEY,
# RLVR_BURST_PER_KEY, RLVR_CONCURRENCY_PER_KEY. Without a key it starts nothing, unless
# RLVR_ALLOW_UNAUTHENTICATED=1: then the service answers anyone who reaches the port.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 IMAGE TRAFFIC_DIR [PORT] [NAME] [podman run options...]" >&2; exit 2; }
image=$1 traffic_dir=$2 port=${3:-3000} name=${4:-rlvr-policy}
shift $(($# < 4 ? $# : 4))
export CONTAINERS_CONF="${CONTAINERS_CONF:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/containers.conf}"

# The keys go in through the environment (`--env NAME` copies this script's value: never on a command
# line); a keys file becomes one comma-separated list, without its comment lines.
if [ -n "${RLVR_API_KEYS_FILE:-}" ]; then
  [ -r "$RLVR_API_KEYS_FILE" ] || { echo "$0: RLVR_API_KEYS_FILE=$RLVR_API_KEYS_FILE is not a readable file" >&2; exit 2; }
  RLVR_API_KEYS="${RLVR_API_KEYS:+$RLVR_API_KEYS,}$({ grep -v '^[[:space:]]*#' "$RLVR_API_KEYS_FILE" || true; } | paste -sd, -)"
fi
if [ -z "$(printf %s "${RLVR_API_KEYS:-}" | tr -d ', \t')" ]; then
  if [ "${RLVR_ALLOW_UNAUTHENTICATED:-}" != 1 ]; then
    echo "$0: no API key: set RLVR_API_KEYS or RLVR_API_KEYS_FILE (make container makes one in \$RLVR_HOME/api-key)," \
      "or RLVR_ALLOW_UNAUTHENTICATED=1 to serve anyone who reaches the port (deploy/README.md, Security)" >&2
    exit 2
  fi
  unset RLVR_API_KEYS
fi
export RLVR_API_KEYS
env_opts=()
for variable in RLVR_API_KEYS RLVR_METRICS_TOKEN RLVR_RATE_PER_KEY RLVR_BURST_PER_KEY RLVR_CONCURRENCY_PER_KEY; do
  if [ -n "${!variable:-}" ]; then
    export "${variable?}"
    env_opts+=(--env "$variable")
  fi
done

# The service runs as the image's user, uid 1034 (as under compose and Kubernetes): it gets the folder
# (not the files already in it; each server process starts a log file of its own).
mkdir -p "$traffic_dir"
chown 1034:1034 "$traffic_dir"
exec podman run --detach --replace --name "$name" \
  --publish "127.0.0.1:$port:3000" \
  --env RLVR_HOME=/data/rlvr --env RLVR_TRAFFIC_DIR=/data/rlvr/traffic \
  "${env_opts[@]}" \
  --volume "$(realpath "$traffic_dir"):/data/rlvr/traffic" \
  "$@" "$image"
