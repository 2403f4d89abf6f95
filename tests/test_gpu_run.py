"""deploy/gpu_run.py, the one-command GPU run (issue 34), on a CPU: its runner records every phase
(done, failed with the exact error, not run with the reason, skipped past the budget) and rewrites
gpu.json and gpu.md after each; and its trainer and transfer code paths run end to end with
`--device cpu --tiny` (the same code the GPU run takes, on the CPU's device)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_run", ROOT / "deploy" / "gpu_run.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def test_runner_records_each_outcome_and_rewrites_the_results_after_every_phase(tmp_path):
    g = _module()
    now = [0.0]
    runner = g.Runner(tmp_path, timeout=10.0, header={"date": "d", "device": "cuda"}, clock=lambda: now[0])

    def ok():
        now[0] += 2
        return {"gbps": 1.5}

    def broken():
        now[0] += 3
        raise RuntimeError("CUDA error: out of memory")

    def absent():
        raise g.NotRun("vLLM cannot travel here", "ModuleNotFoundError: No module named 'vllm'")

    runner.phase("machine", lambda: {"gpu": "NVIDIA H200", "driver_line": "Driver Version: 580"})
    runner.phase("transfer", ok)
    saved = json.loads((tmp_path / "gpu.json").read_text())
    assert saved["phases"]["transfer"]["status"] == "done" and saved["figures"]["transfer"] == {"gbps": 1.5}

    def part():
        raise g.PartFailed("ucx_to_device: 3 chunks differ from the manifest", {"tcp": {"gbps": 2.0}})

    runner.phase("trainer", broken)
    runner.phase("engine", absent)
    runner.phase("offload", part)
    now[0] += 10  # past the budget: the next phase is recorded, not started
    runner.phase("packing", lambda: (_ for _ in ()).throw(AssertionError("must not run")))
    saved = json.loads((tmp_path / "gpu.json").read_text())
    status = {n: r["status"] for n, r in saved["phases"].items()}
    assert status == {
        "machine": "done",
        "transfer": "done",
        "trainer": "failed",
        "engine": "not_run",
        "offload": "failed",
        "packing": "skipped",
    }
    assert saved["figures"]["offload"] == {"tcp": {"gbps": 2.0}}  # what it measured before failing stays
    assert saved["phases"]["trainer"]["error"] == "RuntimeError: CUDA error: out of memory"
    assert "broken" in saved["phases"]["trainer"]["traceback"]
    md = (tmp_path / "gpu.md").read_text()
    for text in (
        "NVIDIA H200",
        "Driver Version: 580",
        "RuntimeError: CUDA error: out of memory",
        "ModuleNotFoundError: No module named 'vllm'",
        "vLLM cannot travel here",
        "| packing | skipped |",
        "ucx_to_device: 3 chunks differ from the manifest",
        "- tcp: gbps 2",
        "- gbps: 1.5",
    ):
        assert text in md


def test_the_trainer_transfer_and_publish_paths_run_on_cpu(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "deploy" / "gpu_run.py"),
            "--device",
            "cpu",
            "--tiny",
            "--max-tokens",
            "16",
            "--transfer-gb",
            "0.004",
            "--phases",
            "model,trainer,offload,transfer,publish",
            "--before",
            str(ROOT / "trainer_svc" / "weights.py"),
            "--workdir",
            str(tmp_path / "wd"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads((out / "gpu.json").read_text())
    status = {n: r["status"] for n, r in res["phases"].items()}
    assert status == {
        "model": "done",
        "trainer": "done",
        "offload": "not_run",
        "transfer": "done",
        "publish": "done",
    }, res["phases"]
    tr = res["figures"]["trainer"]
    for dtype in ("bfloat16", "float32"):
        # timed after a full-size warm-up step (first-use costs made the GPU's first bf16 step look 2x
        # slower than float32's), the median of 3
        step = tr[dtype]
        assert len(step["times_s"]) == 3 and step["first_full_step_s"] > 0
        assert step["step_s"] == sorted(step["times_s"])[1]
    gap = tr["logprobs_bf16_vs_trainer_fp32"]
    assert gap["tokens"] == tr["completion_tokens"] and 0 < gap["mean_abs"] <= gap["max_abs"] < 0.1
    tcp = res["figures"]["transfer"]["tcp"]
    assert tcp["verified"] and tcp["gbps"] > 0 and len(tcp["times_s"]) == 3
    pub = res["figures"]["publish"]
    for transport in ("ucx", "tcp"):  # the same weights.py as "before": the same checksums, version by version
        assert pub[transport]["checksums_equal"] and len(pub[transport]["after"]["s"]) == pub["versions"]
    assert len(pub["fetched"]) == 2 * 2 * pub["keep"] and set(pub["fetched"].values()) == {"verified"}
    assert (out / "gpu.md").read_text().startswith("# The CUDA path on one GPU")
