"""The trainer on 2 ranks (torchrun, FSDP2, gloo on CPU) against 1 rank.

`test_two_ranks_step_like_one`: torchrun runs this file as a script (`_worker` below): the same
spec and batch, a few steps, then the gathered weights and optimizer state; they must equal what
one process in the test computes (fp32: loss within 1e-6, parameters within 1e-5; bf16: 1e-4 and
5e-3, since the ranks' matmuls round differently). The cases (`CASES`) cover CPU offload, bf16
mixed precision, LoRA in bf16 with activation checkpointing, and sequence packing. The batch has
uneven completion lengths, so a per-rank loss normalisation would show, and an odd sample count,
so one case pads a rank's micro-batches; the packed case packs each rank's share to a token budget
(sequence packing), its 2-rank step equal to the 1-rank packed step. A checkpoint written by the 2 ranks also resumes at
world size 1, resumes on 2 ranks (rank 0 alone reads it) and rolls back (Learner.restore) on 2
ranks.

`test_two_nodes_step_like_one`: the same worker as two torchrun "nodes" on loopback (`--nnodes 2
--nproc-per-node 1`, one torchrun process per `--node-rank`, static rendezvous on rank 0's
address, as deploy/k8s and deploy/slurm start the trainer); the same checks against one process.

`test_job_on_two_ranks`: a short sync job with the real generator and reward services and the
trainer under `torchrun --nproc-per-node 2`; the ledger shows every step, version, group and
sample once, and one rank fed and published.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.jobspec import JobSpec
from shared.schema import Rollout, Scored, pack_f32, pack_i32
from trainer_svc.batch import TrainBatch

STEPS = 2
# 9 samples -> shares 5 and 4. cpu-offload: FSDP2 CPUOffloadPolicy on the 2 ranks (1 rank has nothing to
# offload), the same step. bfloat16: mixed precision (CPU autocast over the sharded float32 parameters) on both
# sides. bf16-checkpointing-lora: PEFT adapters (frozen base, sharded like the rest; the optimizer over the
# adapters only, checkpoints holding the adapter) in bfloat16 with activation checkpointing. packed: sequence
# packing to PACK_TOKENS tokens per pass, each rank packing its own share (the counts differ, so one rank pads).


@dataclass(frozen=True)
class Case:
    micro_batch_size: int
    cpu_offload: bool = False
    dtype: str = "float32"
    lora: bool = False
    checkpointing: bool = False
    packing: bool = False


CASES = {
    "one-micro-batch-per-rank": Case(64),
    "padded": Case(4),
    "cpu-offload": Case(64, cpu_offload=True),
    "bfloat16": Case(64, dtype="bfloat16"),
    "bf16-checkpointing-lora": Case(4, dtype="bfloat16", lora=True, checkpointing=True),
    "packed": Case(64, packing=True),
}
PACK_TOKENS = 13  # rank 0 packs its share into 4 passes, rank 1 into 3 and one padding pass
GROUPS, N, MAX_TOKENS = 3, 3, 6


def _timed_steps(learner, samples: list[Scored], rewards: torch.Tensor) -> tuple[list[dict], list[float]]:
    """STEPS optimizer steps on the same batch: each step's metrics and seconds."""
    metrics, seconds = [], []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        metrics.append(learner.step(TrainBatch.of(samples, rewards)))
        seconds.append(time.perf_counter() - t0)
    return metrics, seconds


def _spec(model: str | Path, case: Case) -> JobSpec:
    return JobSpec(
        model_path=str(model),
        group_size=N,
        prompts_per_step=GROUPS,
        sampling={"max_tokens": MAX_TOKENS},
        lora={"rank": 4, "alpha": 8.0} if case.lora else None,
        algorithm={
            "lr": 1e-3,
            "micro_batch_size": case.micro_batch_size,
            "max_grad_norm": 1e6,
            "cpu_offload": case.cpu_offload,
            "packing": case.packing,
            "dtype": case.dtype,
            "gradient_checkpointing": case.checkpointing,
            "micro_batch_tokens": PACK_TOKENS,
        },
    )  # no clipping (the bound is 1e6)


def _batch(vocab: int, seed: int = 0) -> tuple[list[Scored], torch.Tensor]:
    """GROUPS x N samples in group order with completion lengths 1..MAX_TOKENS, and rewards (G, N)."""
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(GROUPS):
        for i in range(N):
            t = int(rng.integers(1, MAX_TOKENS + 1))
            r = Rollout(
                job_id="d",
                msg_id=f"d/g{g}/{i}",
                group_id=f"d/g{g}",
                policy_version=0,
                policy_version_max=0,
                prompt_index=g,
                sample_index=i,
                group_size=N,
                generator_id="d",
                prompt_ids=pack_i32([1, *rng.integers(4, vocab, int(rng.integers(2, 6)))]),
                completion_ids=pack_i32(rng.integers(4, vocab, t)),
                logprobs=pack_f32(-rng.random(t) * 3),
                completion="",
                answer="0",
            )
            samples.append(
                Scored(
                    job_id="d",
                    msg_id=r.msg_id,
                    group_id=r.group_id,
                    policy_version=0,
                    rollout=r,
                    reward=float(rng.random()),
                )
            )
    return samples, torch.tensor([s.reward for s in samples], dtype=torch.float32).view(GROUPS, N)


def _worker(model: str, out: str) -> None:
    """One rank under torchrun: rank 0 drives the Learner, the others run `follow`, per case."""
    from shared.settings import TrainerSettings
    from trainer_svc import checkpoint
    from trainer_svc.dist import KEEPALIVE_S, Ranks
    from trainer_svc.learner import Learner, follow

    torch.set_num_threads(1)
    ranks = Ranks.from_env("cpu")
    assert ranks.world_size == 2
    # where torchrun placed this rank: its node (GROUP_RANK) and the ranks on that node
    (Path(out) / f"rank{ranks.rank}.json").write_text(
        json.dumps(
            {k: os.environ.get(k) for k in ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")}
        )
    )
    if not ranks.is_main:
        for _ in range(len(CASES) + 1):  # each case, then the resume
            follow(TrainerSettings(threads=1), ranks)
        ranks.close()
        return
    for case, c in CASES.items():
        learner = Learner(_spec(model, c), "cpu", ranks=ranks)
        samples, rewards = _batch(learner.model.config.vocab_size)
        metrics, seconds = _timed_steps(learner, samples, rewards)
        ranks._last_sent -= KEEPALIVE_S + 1  # as if rank 0 had waited that long: a tick goes out
        ranks.keepalive()
        weights, optim = learner.full_state()
        optim = copy.deepcopy(optim)  # like optimizer.state_dict(), it may share tensors with the live state
        probe_lp = learner.snapshot()[1][1]
        ckpt = checkpoint.step_dir(out, case, STEPS)
        checkpoint.save(
            ckpt, learner.model, learner.tokenizer, optim, {"step": STEPS, "policy_version": STEPS}, model_state=weights
        )
        learner.step(TrainBatch.of(samples, rewards))  # moves on, then rolls back to the checkpoint
        learner.restore(ckpt)
        back_w, back_o = learner.full_state()
        restored = all(torch.equal(back_w[k], weights[k]) for k in weights) and all(
            torch.equal(back_o["state"][i]["exp_avg"], s["exp_avg"]) for i, s in optim["state"].items()
        )
        torch.save({"weights": weights, "optim": optim}, Path(out) / f"{case}.pt")
        (Path(out) / f"{case}.json").write_text(
            json.dumps(
                {"metrics": metrics, "seconds": seconds, "probe": probe_lp, "restored": restored, "ckpt": str(ckpt)}
            )
        )
        ranks.announce("exit")
    # resume on 2 ranks: rank 0 alone reads the checkpoint, rank 1 builds the base model
    case = next(iter(CASES))
    ckpt = checkpoint.step_dir(out, case, STEPS)
    learner = Learner(_spec(model, CASES[case]), "cpu", ckpt, ranks)
    learner.restore(ckpt, weights=False)
    weights, optim = learner.full_state()
    saved = checkpoint.read_optimizer(ckpt)
    resumed = all(torch.equal(weights[k], v) for k, v in checkpoint.read_weights(ckpt).items()) and all(
        torch.equal(optim["state"][i]["exp_avg_sq"], s["exp_avg_sq"]) for i, s in saved["state"].items()
    )
    (Path(out) / "resume.json").write_text(json.dumps({"resumed": resumed}))
    ranks.announce("exit")
    ranks.close()


def _torchrun(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args],
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from asyncrl.tiny_model import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("model") / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0
    )  # vLLM CPU attention needs head_dim >= 32


@pytest.mark.slow
def test_two_ranks_step_like_one(tmp_path, tiny_model):
    t0 = time.perf_counter()
    proc = _torchrun(__file__, str(tiny_model), str(tmp_path))
    wall_2 = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    _assert_like_one(tmp_path, tiny_model)
    print(f"2-rank worker wall time (torchrun start to exit, all cases) {wall_2:.1f}s")


@pytest.mark.slow
def test_two_nodes_step_like_one(tmp_path, tiny_model):
    """Two torchrun agents, one per "node" (`--node-rank 0` and `1`), one rank each, meeting at
    node 0's address: the multi-node launch of deploy/k8s and deploy/slurm, on loopback."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                __file__,
                str(tiny_model),
                str(tmp_path),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=300)[0] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    wall = time.perf_counter() - t0
    for node, (p, out) in enumerate(zip(nodes, outs, strict=True)):
        assert p.returncode == 0, f"node {node}:\n{out[-6000:]}"
    # each node ran one rank of the two, and node 0 holds rank 0 (the one that serves the job)
    placed = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(p["RANK"], p["GROUP_RANK"], p["LOCAL_RANK"], p["LOCAL_WORLD_SIZE"]) for p in placed] == [
        ("0", "0", "0", "1"),
        ("1", "1", "0", "1"),
    ], placed
    _assert_like_one(tmp_path, tiny_model)
    print(f"2-node worker wall time (both torchrun agents, start to exit) {wall:.1f}s")


def _assert_like_one(tmp_path: Path, tiny_model: Path) -> None:
    """What the 2-rank `_worker` wrote under `tmp_path` equals one process's steps, per case."""
    from trainer_svc import checkpoint
    from trainer_svc.learner import Learner
    from trainer_svc.weights import probe

    torch.set_num_threads(1)
    for case, c in CASES.items():
        spec = _spec(tiny_model, c)
        # bfloat16: the 2 ranks' micro-batches hold other rows than the 1 rank's, so the matmuls round
        # differently (loss ~1e-5 apart, measured); AdamW's first steps move a weight by ~lr (1e-3) whatever
        # the gradient's size, so a near-zero gradient's rounding shows in the weights at up to ~2 lr; a
        # max-type metric (is/max) takes one token's rounding whole (1.8e-3 relative measured with LoRA)
        loss_tol, rel, param_tol, opt_atol, opt_rtol = (
            (1e-6, 1e-5, 1e-5, 1e-6, 1e-5) if c.dtype == "float32" else (1e-4, 1e-2, 5e-3, 1e-4, 1e-2)
        )
        one = Learner(spec, "cpu")
        samples, rewards = _batch(one.model.config.vocab_size)
        metrics, seconds = _timed_steps(one, samples, rewards)
        got = json.loads((tmp_path / f"{case}.json").read_text())
        two = torch.load(tmp_path / f"{case}.pt", weights_only=True)
        loss_diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(metrics, got["metrics"], strict=True))
        assert loss_diff <= loss_tol, (case, metrics, got["metrics"])
        for a, b in zip(metrics, got["metrics"], strict=True):  # every metric reduced across ranks
            assert set(a) == set(b)
            for key in a:
                assert b[key] == pytest.approx(a[key], rel=rel, abs=loss_tol), (case, key)
        ref = one.model.state_dict()
        assert set(two["weights"]) == set(ref)
        param_diff = max(float((two["weights"][k] - ref[k]).abs().max()) for k in ref)
        assert param_diff <= param_tol, (case, param_diff)
        assert any(not torch.equal(ref[k], v) for k, v in Learner(spec, "cpu").model.state_dict().items())  # it moved
        ref_opt = one.optimizer.state_dict()
        assert ref_opt["param_groups"][0]["params"] == two["optim"]["param_groups"][0]["params"]
        for i, s in ref_opt["state"].items():
            assert float(two["optim"]["state"][i]["step"]) == float(s["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(two["optim"]["state"][i][key], s[key], atol=opt_atol, rtol=opt_rtol)
        assert got["probe"] == pytest.approx(probe(one.model)[1], abs=param_tol)
        assert got["restored"], "Learner.restore on 2 ranks did not bring back the checkpoint"
        # the checkpoint the 2 ranks wrote resumes at world size 1 (HF weights + optimizer layout)
        resumed = Learner(spec, "cpu", got["ckpt"])
        resumed.restore(got["ckpt"], weights=False)
        checkpoint.load_state(Path(got["ckpt"]))
        for k, v in resumed.model.state_dict().items():
            assert torch.equal(v, two["weights"][k]), k
        m1, m2 = one.step(TrainBatch.of(samples, rewards)), resumed.step(TrainBatch.of(samples, rewards))
        # bfloat16: from weights up to param_tol apart (the 2 ranks' checkpoint), measured 1.5e-4
        assert m2["loss"] == pytest.approx(m1["loss"], abs=loss_tol if c.dtype == "float32" else 1e-3)
        size = f"packed to {PACK_TOKENS} tokens" if c.packing else f"micro-batch {c.micro_batch_size}"
        print(
            f"\n{case} ({size}): |loss 1 rank - 2 ranks| max {loss_diff:.2e}, |params| max "
            f"{param_diff:.2e}; step s 1 rank {seconds[-1]:.3f}, 2 ranks {got['seconds'][-1]:.3f}"
        )
    assert json.loads((tmp_path / "resume.json").read_text())["resumed"], "2 ranks did not resume the checkpoint"


# --- a whole job ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
@pytest.mark.slow
def test_job_on_two_ranks(tmp_path, tiny_model):
    from asyncrl.launch import Supervisor
    from broker.ledger import Ledger
    from broker.redis_server import resolve_redis_url
    from broker.streams import POLICY, JobStreams, connect
    from shared.schema import PolicyAnnouncement

    steps, p, n = 3, 2, 4
    redis_url, _ = resolve_redis_url(os.environ.get("REDIS_URL"))
    db_url = os.environ.get("DATABASE_URL") or f"sqlite:///{tmp_path / 'ledger.db'}"
    prefix = f"dist-{uuid.uuid4().hex[:8]}:"
    env = {
        "REDIS_URL": redis_url,
        "DATABASE_URL": db_url,
        "STREAM_PREFIX": prefix,
        "GEN_GENERATOR_ID": "gen-0",
        "TRAINER_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TRAINER_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
    }
    sup = Supervisor(tmp_path / "logs", env)
    ledger = Ledger(db_url)
    spec = JobSpec.model_validate(
        {
            "name": "dist",
            "model_path": str(tiny_model),
            "mode": "sync",
            "steps": steps,
            "group_size": n,
            "prompts_per_step": p,
            "eval_every": 0,
            "checkpoint_every": 2,
            "task": {"n_train": 32, "n_test": 4},
            "sampling": {"max_tokens": 8},
        }
    )
    job_id = f"dist-{uuid.uuid4().hex[:8]}"
    ledger.create_job(job_id, "dist", spec.model_dump(mode="json"))
    t0 = time.monotonic()
    try:
        sup.start("generator", "generator_svc", {"JOB_ID": job_id})
        sup.start("reward", "reward_svc", {"JOB_ID": job_id})
        sup.start(
            "trainer",
            "torch.distributed.run",
            {"JOB_ID": job_id},
            args=["--nproc-per-node", "2", "--master-port", str(_free_port()), "-m", "trainer_svc"],
        )
        deadline = time.monotonic() + 240
        while ledger.get_job(job_id)["state"] not in ("finished", "failed", "stopped"):
            assert not sup.failed(), "\n".join(f"{x.name}:\n{sup.tail(x.name, 60)}" for x in sup.failed())
            assert time.monotonic() < deadline, sup.tail("trainer", 60)
            time.sleep(0.3)
        assert ledger.get_job(job_id)["state"] == "finished", sup.tail("trainer", 60)
        assert sup.wait_all(60), "services did not exit after the job finished"
        codes = {x.name: x.popen.returncode for x in sup.procs}
        assert codes == {"generator": 0, "reward": 0, "trainer": 0}, "\n".join(
            f"{x.name}:\n{sup.tail(x.name, 80)}" for x in sup.procs if x.popen.returncode
        )
    finally:
        sup.stop_all()
    wall = time.monotonic() - t0
    log = (tmp_path / "logs" / "trainer.log").read_text()
    assert "rank 1 of 2 (gloo, cpu)" in log and "rank 0 of 2 (gloo, cpu)" in log, log[-3000:]

    train_steps = ledger.train_steps(job_id)
    assert [s["step"] for s in train_steps] == list(range(1, steps + 1))  # each step once
    assert all(s["metrics"]["ledger/trained_twice"] == 0 for s in train_steps)
    assert sorted(v["version"] for v in ledger.policy_versions(job_id)) == list(range(steps + 1))  # once each
    # one publisher: every announcement still on the policy stream comes from one trainer run
    streams = JobStreams(connect(redis_url), job_id, prefix=prefix)
    _, anns = streams.read_broadcast(POLICY, "0", PolicyAnnouncement)
    assert anns and len({(a.trainer_run, a.address) for a in anns}) == 1
    # the feeder ran once: one run id in every train group, each group fed once, n samples each
    train = ledger.samples(job_id, kind="train")
    groups: dict[str, set[int]] = {}
    for s in train:
        groups.setdefault(s["group_id"], set()).add(s["sample_index"])
    assert len({g.rsplit("/", 1)[0] for g in groups}) == 1, sorted(groups)
    assert all(idx == set(range(n)) for idx in groups.values()), groups
    trained = [s for s in train if s["status"] == "trained"]
    assert len(trained) == len({s["msg_id"] for s in trained}) == steps * p * n  # each sample trained once
    assert len(groups) == steps * p  # sync: the feeder keeps one batch in flight, nothing else was fed
    assert [c["step"] for c in ledger.checkpoints(job_id)] == [2, 3]
    ckpt = Path(ledger.checkpoints(job_id)[-1]["path"])
    assert (ckpt / "model.safetensors").exists() and (ckpt / "trainer_state" / "optimizer.pt").exists()
    times = [s["metrics"]["time/train_s"] for s in train_steps]
    print(f"\n2-rank job: {steps} steps in {wall:.1f}s (all services), train s/step {times}")


if __name__ == "__main__":
    _worker(*sys.argv[1:])
