#!/bin/bash
# Build the epd image with podman where no container registry is reachable: the base image is made locally
# (debootstrap of Debian bookworm with its Python 3.11), then the repository's Dockerfile is built on it from a
# clean `git archive HEAD` (CPU variant). Needs root, podman, debootstrap and the Debian mirror; pip reaches the
# package index it is configured for. Reruns reuse the base image and podman's layer cache.
#
#   scripts/build_image_local.sh [TAG]          (default TAG: localhost/epd:<version in pyproject.toml>)
#
# Environment: EPD_IMAGE_WORK (scratch folder, default /var/tmp/epd-image), EPD_WHEELS (a wheel folder pip
# should prefer, default /opt/wheels when it exists: the CPU torch wheel), EPD_CA_BUNDLE (a CA bundle for pip,
# default /etc/ssl/certs/ca-certificates.crt when it exists: TLS-intercepting proxies).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml" | head -1)
TAG=${1:-localhost/epd:$VERSION}
BASE=localhost/debian-py311:bookworm
WORK=${EPD_IMAGE_WORK:-/var/tmp/epd-image}
WHEELS=${EPD_WHEELS:-/opt/wheels}
CA=${EPD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
mkdir -p "$WORK"

if ! podman image exists "$BASE"; then
  rm -rf "$WORK/rootfs"
  debootstrap --variant=minbase --include=python3.11,python3.11-venv,python3-pip,ca-certificates \
    bookworm "$WORK/rootfs" http://deb.debian.org/debian
  tar -C "$WORK/rootfs" -c . | podman import - "$BASE"
  rm -rf "$WORK/rootfs"
fi

rm -rf "$WORK/context" && mkdir -p "$WORK/context"
git -C "$ROOT" archive HEAD | tar -x -C "$WORK/context"
args=(--isolation chroot --network host --build-arg "BASE=$BASE")  # chroot: no cgroup setup (works in containers)
if [ -d "$WHEELS" ]; then
  # the CPU torch wheel is there; PyPI's index then serves the rest (PyTorch's own index may be unreachable)
  args+=(-v "$WHEELS:/opt/wheels:ro" --build-arg PIP_FIND_LINKS=/opt/wheels
         --build-arg TORCH_INDEX_cpu=https://pypi.org/simple)
fi
if [ -f "$CA" ]; then
  args+=(-v "$CA:/etc/epd-build-ca.crt:ro" --build-arg PIP_CERT=/etc/epd-build-ca.crt)
fi
podman build "${args[@]}" -t "$TAG" "$WORK/context"
echo "built $TAG"
