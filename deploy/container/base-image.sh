#!/usr/bin/env bash
# The base image of every rlvr-ops image (the policy Bento, the code location, the Dagster webserver):
# Debian 12 (bookworm) and its Python 3.11 with headers (python3-dev: for packages that ship only
# sources), built from Debian packages with debootstrap (no image registry needed), plus what BentoML's
# generated Dockerfile expects in a custom base: ca-certificates, gnupg2, bash, build-essential, git
# and uv. Prints its tag, rlvr-base:bookworm-py311-<recipe hash>, and points the alias
# rlvr-base:bookworm-py311 (bentos/bentofile.yaml's docker.base_image) at it.
#
# Built once: the tag carries a hash of this file, so the image is rebuilt only when the recipe
# changes and stays in podman's storage between builds. Needs root, podman, debootstrap, and a Debian
# mirror (DEBIAN_MIRROR) and PyPI (for uv, through this host's pip configuration) while it builds.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$HERE/containers.conf}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
UV_VERSION=0.13.9
PACKAGES=python3,python3-dev,ca-certificates,gnupg2,bash,build-essential,git

recipe_hash="$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-12)"
alias=rlvr-base:bookworm-py311
tag="$alias-$recipe_hash"
if podman image exists "$tag"; then
  podman tag "$tag" "$alias"
  echo "$tag"
  exit 0
fi

for tool in podman debootstrap; do
  command -v "$tool" >/dev/null || { echo "base-image.sh: $tool is not installed (apt-get install -y podman runc debootstrap)" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "base-image.sh: debootstrap and rootful podman need root" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"
echo "base-image.sh: debootstrap bookworm into $rootfs (a few minutes)" >&2
debootstrap --variant=minbase --include="$PACKAGES" bookworm "$rootfs" "$DEBIAN_MIRROR" >"$work/debootstrap.log" 2>&1 ||
  { tail -30 "$work/debootstrap.log" >&2; exit 1; }

# uv, from its PyPI wheel (a static binary): the generated Bento Dockerfile installs packages with it.
python3 -m pip download --no-deps --only-binary=:all: --dest "$work/uv" "uv==$UV_VERSION" >"$work/pip.log" 2>&1 ||
  { cat "$work/pip.log" >&2; exit 1; }
python3 -m zipfile -e "$work"/uv/uv-*.whl "$work/uv/x"
install -m 0755 "$work/uv/x/uv-$UV_VERSION.data/scripts/uv" "$rootfs/usr/local/bin/uv"

# Where builds mount their inputs (build_images.py): present here, so no build leaves a mount point behind.
mkdir -p "$rootfs/etc/uv" "$rootfs/run/rlvr-build/wheelhouse"
echo "# empty: builds mount their uv settings over this file (deploy/container/build_images.py)" >"$rootfs/etc/uv/uv.toml"

# Small layers, also in the images' own apt steps (BentoML's Dockerfile runs apt-get update): package
# lists kept compressed, no translations, no binary caches or downloaded .debs (as Docker's Debian images).
cat >"$rootfs/etc/apt/apt.conf.d/90rlvr-small-layers" <<'EOF'
Acquire::GzipIndexes "true";
Acquire::CompressionTypes::Order:: "gz";
Acquire::Languages "none";
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb || true"; };
EOF

# No package lists, caches, docs or locales in the image (apt-get update restores the lists).
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
  "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/var/log/*.log
find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} +

tar --numeric-owner -C "$rootfs" -c . | podman import \
  --change 'ENV LANG=C.UTF-8' --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' --message "rlvr-ops base: debootstrap bookworm ($PACKAGES) + uv $UV_VERSION" \
  - "$tag" >/dev/null
podman tag "$tag" "$alias"
echo "$tag"
