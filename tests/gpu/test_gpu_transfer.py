"""On an NVIDIA GPU machine only (`pytest -m gpu`): UCX transfer from CUDA memory is verified."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def test_ucx_transfer_from_cuda_memory(tmp_path):
    out = tmp_path / "transfer_gpu.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "deploy/gpu_transfer_check.py"), "--gb", "0.5", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["verified"] and result["ucx_cuda_gbps"] > 0
