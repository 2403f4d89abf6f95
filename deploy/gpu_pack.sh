#!/usr/bin/env bash
# Build, on a machine with pip and the network, the Python packages a bare CUDA machine lacks for
# deploy/gpu_run.py, as one archive that travels with the working tree:
#
#     deploy/gpu_pack.sh [OUT_DIR]          # default .gpupack -> .gpupack/site.tar.xz
#
# The target has CUDA torch, transformers, numpy, msgpack, xxhash ... (Python 3.12, x86-64) but not
# the project's pure-Python needs (pydantic, pydantic-settings, redis-py, tenacity) nor UCX (ucxx
# for CUDA 13: ucxx-cu13 and its libucx/libucxx/rmm wheels). The wheels are installed for that
# target (not this machine's Python), UCX's static libraries, perftest and duplicate sonames are
# dropped (the archive must fit the device tool's 64 MiB with the tree), and the rest is tarred
# with xz. deploy/gpu_run.sh unpacks it into /tmp/site and puts that on PYTHONPATH.
#
# vLLM is not packed: its CUDA wheel is 239 MB (vllm 0.34.0, cp38-abi3 manylinux_2_28) and pins
# torch==2.14.0, against the 64 MiB that travels and the target's torch 2.11 (results/gpu.md).
set -euo pipefail
OUT=${1:-.gpupack}
PY=${PYTHON:-python3}
PKGS=(
  pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  redis==8.2.0 tenacity==9.2.1
  ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.21.0 rmm-cu13==26.10.0 librmm-cu13==26.10.0
  rapids-logger==0.3.0
)
PLAT=()
for p in manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35 manylinux2014; do
  PLAT+=(--platform "${p}_x86_64")
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip install -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
  --no-compile --target "$tmp/site" "${PKGS[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
# Trim what the Python API never loads: static libraries, libtool files, headers, tools, perftest.
find "$tmp/site" -type f \( -name '*.a' -o -name '*.la' -o -name '*perftest*' \) -delete
rm -rf "$tmp/site/libucx/bin" "$tmp/site/libucx/share" "$tmp/site/libucx/include" "$tmp/site/libucx/lib/cmake" "$tmp/site/libucx/lib/pkgconfig" \
  "$tmp/site/libucxx/include" "$tmp/site/librmm/include" "$tmp/site/rapids_logger/include" "$tmp/site/bin"
# libX.so and libX.so.0.0.0 are copies of libX.so.0 (wheels cannot hold links): links again.
while IFS= read -r -d '' so0; do
  for twin in "${so0%.0}" "$so0.0.0"; do
    if [ -f "$twin" ] && cmp -s "$so0" "$twin"; then ln -sf "$(basename "$so0")" "$twin"; fi
  done
done < <(find "$tmp/site" -name '*.so.0' -print0)
mkdir -p "$OUT"
tar -C "$tmp/site" -cf - . | xz -T0 -9 > "$OUT/site.tar.xz"
printf '%s\n' "${PKGS[@]}" > "$OUT/packages.txt"
du -b "$OUT/site.tar.xz" | awk '{printf "site.tar.xz: %.1f MiB\n", $1 / 2^20}'
