"""T_gen: the engine alone generating one step's batch (no Redis, no ledger). Prints JSON.

python -m bench.t_gen --model DIR --prompts 16 --n 8 --max-tokens 32 --reps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from generator_svc.engine import Engine
from shared.schema import SamplingParams
from shared.tasks import synthetic_arithmetic


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True, help="JSON result file")
    a = ap.parse_args()
    engine = Engine(a.model, seed=0)
    train, _ = synthetic_arithmetic(0, n_train=a.prompts, n_test=1)
    prompts = [p.prompt for p in train]
    params = [SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens)] * len(prompts)
    engine.generate(prompts, params, [a.n] * len(prompts))  # warm-up
    times, tokens = [], []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        out = engine.generate(prompts, params, [a.n] * len(prompts))
        times.append(time.perf_counter() - t0)
        tokens.append(sum(len(s.completion_ids) for g in out for s in g))
    engine.close()
    t = statistics.median(times)
    with open(a.out, "w") as f:
        json.dump(
            {
                "t_gen_s": t,
                "times_s": times,
                "tokens": statistics.median(tokens),
                "tokens_per_s": statistics.median(tokens) / t,
            },
            f,
        )


if __name__ == "__main__":
    main()
