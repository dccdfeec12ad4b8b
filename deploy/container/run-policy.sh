#!/usr/bin/env bash
# Start a policy image (deploy/container/build_images.py policy) as a detached podman container:
#   run-policy.sh IMAGE TRAFFIC_DIR [PORT] [NAME] [podman run options...]
# It serves on 127.0.0.1:PORT (default 3000) and writes its traffic logs into the host folder
# TRAFFIC_DIR, mounted at /data/rlvr/traffic (RLVR_TRAFFIC_DIR), where the monitoring assets on the host
# read them (TRAFFIC_DIR = $RLVR_HOME/traffic). A container of the same NAME (default rlvr-policy) is
# replaced. Further options go to `podman run` (a GPU: --device nvidia.com/gpu=all). Prints the container's id.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 IMAGE TRAFFIC_DIR [PORT] [NAME] [podman run options...]" >&2; exit 2; }
image=$1 traffic_dir=$2 port=${3:-3000} name=${4:-rlvr-policy}
shift $(($# < 4 ? $# : 4))
export CONTAINERS_CONF="${CONTAINERS_CONF:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/containers.conf}"

# The service runs as the image's user, uid 1034 (as under compose and Kubernetes): it gets the folder
# (not the files already in it; each server process starts a log file of its own).
mkdir -p "$traffic_dir"
chown 1034:1034 "$traffic_dir"
exec podman run --detach --replace --name "$name" \
  --publish "127.0.0.1:$port:3000" \
  --env RLVR_HOME=/data/rlvr --env RLVR_TRAFFIC_DIR=/data/rlvr/traffic \
  --volume "$(realpath "$traffic_dir"):/data/rlvr/traffic" \
  "$@" "$image"
