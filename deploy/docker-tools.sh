#!/usr/bin/env bash
# Install Debian's docker.io (dockerd and the docker CLI) and debootstrap with apt-get, when missing.
#
# Only the image tests need them (tests/deploy/test_images.py runs this; when it exits non-zero
# they skip with its message where no Docker is left here, and fail with it otherwise): they
# start a private dockerd, make a Debian base image with `debootstrap --variant=minbase` from
# the Debian mirror apt already uses (no container registry is needed) and build deploy/docker's
# images on it. A rerun with all present does nothing.
#
#   bash deploy/docker-tools.sh     # or: make docker-tools
#
# Needs root or password-less sudo and apt-get; otherwise exits 3 saying what to install.
set -euo pipefail

missing=""
command -v dockerd >/dev/null 2>&1 || [ -x /usr/sbin/dockerd ] || missing="$missing docker.io"
command -v docker >/dev/null 2>&1 || [[ "$missing" == *docker.io* ]] || missing="$missing docker.io"
command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || missing="$missing debootstrap"
[ -z "$missing" ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "deploy/docker-tools.sh: no apt-get here; install$missing (Docker Engine and debootstrap) by hand" >&2
    exit 3
fi
if [ "$(id -u)" = 0 ]; then
    SUDO=""
elif sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
else
    echo "deploy/docker-tools.sh: apt-get install$missing needs root or password-less sudo" >&2
    exit 3
fi
echo "deploy/docker-tools.sh: apt-get install$missing"
$SUDO apt-get update -q >&2
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing >&2
