"""The compose tier (`pytest -m compose`, deselected by default: it takes minutes and builds
images): runs scripts/compose-test.sh, which installs the engine if missing, builds the images
without a registry where none is reachable, and brings the stack up, scales it, kills containers
mid-job and takes it down and up again (deploy/compose_test.py). Needs root (or sudo) and a
machine where containers can run; results/compose.json is written by the script run by hand, this
test writes its figures to a temporary file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.compose
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_compose_up_scale_kill_and_restart(tmp_path):
    out = tmp_path / "compose.json"
    res = subprocess.run(
        ["bash", "scripts/compose-test.sh", "--out", str(out)],
        cwd=ROOT,
        timeout=3500,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert out.exists(), "scripts/compose-test.sh wrote no results"
    r = json.loads(out.read_text())
    assert res.returncode == 0 and not r["failed"], json.dumps(r, indent=2)[-6000:]
    assert r["demo_finished"] and r["verify_ok"]
    assert r["scaled_generators"] >= 2
    assert r["kill_lost"] == 0 and r["kill_trained_twice"] == 0
    assert r["restart_resumed"]
    assert r["image_gb"] and r["build_s"] >= 0 and r["up_to_finished_s"] > 0
