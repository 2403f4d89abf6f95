"""T_train: the trainer alone on one batch (optimizer step + weight publish; no Redis, no ledger).

Fabricates a batch with the shapes of a real step (prompts_per_step x group_size completions of
max_tokens tokens, behaviour logprobs, rewards) and times `Learner.step` plus flattening,
checksumming and serving the new weights. Prints nothing; writes JSON.

    python -m bench.t_train --model DIR --prompts 16 --n 8 --max-tokens 32 --reps 5 --out F
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from shared.jobspec import JobSpec
from shared.schema import Rollout, Scored, pack_f32, pack_i32
from shared.transport import TcpWeightServer, build_manifest
from trainer_svc.batch import TrainBatch
from trainer_svc.feeder import Group
from trainer_svc.learner import Learner
from trainer_svc.sink import flatten_batch
from trainer_svc.weights import flatten_weights


def fake_batch(prompts: int, n: int, max_tokens: int, vocab: int, seed: int = 0) -> list[Group]:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(prompts):
        group = Group(f"b/g{g}", n)
        for i in range(n):
            r = Rollout(
                job_id="bench",
                msg_id=f"b/g{g}/{i}",
                group_id=f"b/g{g}",
                policy_version=0,
                policy_version_max=0,
                prompt_index=g,
                sample_index=i,
                group_size=n,
                generator_id="bench",
                prompt_ids=pack_i32([1, *rng.integers(4, vocab, 6)]),
                completion_ids=pack_i32(rng.integers(4, vocab, max_tokens)),
                logprobs=pack_f32(-rng.random(max_tokens) * 3),
                completion="",
                answer="0",
            )
            group.samples[r.msg_id] = Scored(
                job_id="bench",
                msg_id=r.msg_id,
                group_id=r.group_id,
                policy_version=0,
                rollout=r,
                reward=float(rng.integers(0, 2)),
            )
        groups.append(group)
    return groups


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    spec = JobSpec(
        model_path=a.model,
        group_size=a.n,
        prompts_per_step=a.prompts,
        sampling={"max_tokens": a.max_tokens},
        algorithm={"lr": 1e-6},
    )
    learner = Learner(spec, "cpu")
    samples, rewards = flatten_batch(fake_batch(a.prompts, a.n, a.max_tokens, learner.model.config.vocab_size))
    server = TcpWeightServer(keep=2)
    step_s, publish_s = [], []
    for rep in range(a.reps + 1):  # the first repetition warms up
        t0 = time.perf_counter()
        learner.step(TrainBatch.of(samples, rewards))
        t1 = time.perf_counter()
        entries, buf = flatten_weights(learner.model)
        server.serve(build_manifest(rep, entries, buf), buf)
        t2 = time.perf_counter()
        if rep:
            step_s.append(t1 - t0)
            publish_s.append(t2 - t1)
    server.close()
    out = {"t_step_s": statistics.median(step_s), "t_publish_s": statistics.median(publish_s)}
    out["t_train_s"] = out["t_step_s"] + out["t_publish_s"]
    with open(a.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
