"""Offline held-out evaluation of one checkpoint with the vLLM engine.

`python -m generator_svc.evaluate --checkpoint DIR --spec SPEC.json --out RESULT.json`

The same protocol as the trainer's in-pipeline rounds (trainer_svc.feeder.Feeder.feed_eval): one
greedy completion of every held-out problem of the job's task, `spec.sampling.max_tokens` long,
scored with the job's reward function. So the offline figure of a step's checkpoint is directly
comparable with the pipeline's figure at that step. The broker's admin worker runs this as a
subprocess: the engine's memory and any crash stay out of the worker, and the broker never
imports vLLM.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from shared.datasets import load_task
from shared.jobspec import JobSpec
from shared.logs import setup_logging
from shared.prompts import renderer, usable
from shared.rewards import RewardInput, build_scorer

log = logging.getLogger("evaluate")

# Completions kept in the result for a reader to look at; the figure covers every problem.
EXAMPLES = 8


def evaluate(checkpoint: Path, spec: JobSpec, *, max_model_len: int = 512, dtype: str = "float32") -> dict:
    """Greedy held-out reward of the HF-format model in `checkpoint`.

    Returns {"reward_mean", "n", "correct", "tokens", "reward_status" (counts by status), "seconds",
    "examples": [...]}. The engine's context is `max_model_len`, or the model's
    max_position_embeddings where that is shorter.

    Raises:
        FileNotFoundError: `checkpoint` has no config.json (not an HF-format model directory).
        ValueError: the job's task cannot be loaded (see shared.datasets.load_task).
    """
    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint} is not an HF-format model directory (no config.json)")
    _, test = load_task(spec.task, spec.seed)
    # Plug-ins are imported here: one that does not import fails before the engine starts. Sync
    # functions run in threads (a hung one is abandoned at its budget and dies with this process).
    scorer = build_scorer(spec.reward)
    # The model's own context bounds the engine's (vLLM refuses a longer one).
    own = json.loads((checkpoint / "config.json").read_text()).get("max_position_embeddings")
    if isinstance(own, int) and own > 0:
        max_model_len = min(max_model_len, own)
    from generator_svc.engine import Engine  # vLLM: only once the inputs are known to be sound

    t0 = time.perf_counter()
    engine = Engine(str(checkpoint), seed=spec.seed, dtype=dtype, max_model_len=max_model_len)
    load_s = time.perf_counter() - t0
    try:
        # As the trainer's rounds: prompts rendered by the job's renderer (chat template or plain) and
        # generated from those ids, greedy, with the job's stop rules.
        from transformers import AutoTokenizer

        render = renderer(AutoTokenizer.from_pretrained(checkpoint), spec.chat_template, spec.chat_template_kwargs)
        test = usable(test, render, spec.task.bad_rows, "held-out")  # the chat template within its limits
        rendered = [render(p) for p in test]
        greedy = spec.sampling.params(temperature=0.0, top_p=1.0)
        t1 = time.perf_counter()
        outs = engine.generate([r.ids for r in rendered], [greedy] * len(test), [1] * len(test))
        gen_s = time.perf_counter() - t1
    finally:
        engine.close()
    with scorer:
        results = scorer.score_sync(
            [
                RewardInput(
                    prompt=r.text,
                    completion=sample.text,
                    answer=problem.answer,
                    metadata=problem.metadata,
                    finish_reason=sample.finish_reason,
                    completion_ids=sample.completion_ids,
                )
                for problem, r, (sample,) in zip(test, rendered, outs, strict=True)
            ]
        )
    rewards, tokens, statuses = [], 0, Counter(res.status for res in results)
    examples: list[dict[str, Any]] = []
    for problem, (sample,), res in zip(test, outs, results, strict=True):
        # A failed reward counts as 0.0 here under either on_failure: offline there is no group to drop.
        r = float(scorer.reward_for(res) or 0.0)
        rewards.append(r)
        tokens += len(sample.completion_ids)
        if len(examples) < EXAMPLES:
            examples.append(
                {
                    "prompt_index": problem.index,
                    "prompt": problem.prompt,
                    "answer": problem.answer,
                    "completion": sample.text,
                    "reward": r,
                    "reward_status": res.status,
                    "reward_reason": res.reason,
                }
            )
    return {
        "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "n": len(rewards),
        "correct": sum(r > 0 for r in rewards),
        "tokens": tokens,
        "reward_status": dict(statuses),
        "seconds": {"load": round(load_s, 3), "generate": round(gen_s, 3)},
        "examples": examples,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m generator_svc.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="HF-format model directory")
    parser.add_argument("--spec", type=Path, required=True, help="the job spec (JSON) naming task, reward, sampling")
    parser.add_argument("--out", type=Path, required=True, help="where the result JSON goes (written atomically)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    setup_logging("evaluate", os.environ.get("LOG_LEVEL", "INFO"))
    spec = JobSpec.model_validate_json(args.spec.read_text())
    result = evaluate(args.checkpoint, spec, max_model_len=args.max_model_len, dtype=args.dtype)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, args.out)
    log.info("held-out reward %.3f over %d problems (%s)", result["reward_mean"], result["n"], args.checkpoint)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
