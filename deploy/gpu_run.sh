#!/usr/bin/env bash
# On a lent GPU machine: unpack the packages it lacks (deploy/gpu_pack.sh built them into
# .gpupack/site.tar.xz, which travels with the tree) into /tmp/site, then run deploy/gpu_run.py
# with this script's arguments. Nothing is fetched from the network.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PACK=${GPU_PACK:-.gpupack/site.tar.xz}
if [ -f "$PACK" ]; then
  t0=$(date +%s%N)
  if ! { mkdir -p /tmp/site && tar -xJf "$PACK" -C /tmp/site; }; then
    echo "gpu_run.sh: could not unpack $PACK" >&2
    exit 2
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  GPU_PACK_INFO="$PACK unpacked in $(( ($(date +%s%N) - t0) / 1000000 )) ms: $(tr '\n' ' ' < "$(dirname "$PACK")/packages.txt" 2>/dev/null)"
  export GPU_PACK_INFO
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "${PYTHON:-python3}" deploy/gpu_run.py "$@"
