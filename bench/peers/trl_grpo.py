"""TRL's GRPOTrainer on the suite's task: the peer side of the time-to-reward comparison.

Runs with the Python of the TRL virtual environment that bench.suite creates; it imports
nothing from this project (the task, the held-out split and the reward's rule arrive in a JSON
file), only torch, transformers, datasets and trl, and it writes one JSON result file.

    <trl-venv>/bin/python bench/peers/trl_grpo.py --config cfg.json --out result.json

Config keys: model_path, train and test (lists of {"prompt", "answer"}, optionally "metadata"),
group_size, prompts_per_step, micro_batch_size, steps, lr, max_tokens, temperature, eval_every,
threads, seed, t_launch (epoch seconds at which the suite started this process: the clock's
zero), workdir, and optionally evaluate (false: no held-out evaluation, for the cost of a step
only), reward ("/path/file.py:function": a user's reward plug-in, called as our reward service
calls it, `fn(completion, answer, metadata=row_metadata)`; default: exact match below) and stop
(strings that end a completion, each one token of the model's tokenizer: they join the
generation config's EOS ids, which is how TRL ends and masks a completion), use_cpu (default
true; false lets TRL take the GPU) and trl_defaults (default false; true: TRL's own defaults, see
`grpo_config_defaults`).

Training settings (`grpo_config`) mirror the job spec of our side: fp32 (TRL's default bf16 off),
no gradient checkpointing (its default on), AdamW without weight decay at an lr decaying linearly
to 0 over the run (our lr_schedule's default and TRL's: step t at lr x (1 - (t - 1) / steps) in
TRL, lr x (1 - t / steps) in ours), one optimizer step per `prompts_per_step * group_size`
completions, group z-score advantages (`scale_rewards="group"`), token-mean loss over the batch
(`loss_type="dapo"`, TRL's default), no KL (beta 0), sampling at `temperature` with no
top-k/top-p, TRL's default generation (transformers `generate`).

Held-out protocol (the same as the trainer's in-pipeline evaluation): one greedy completion of
at most `max_tokens` tokens per held-out prompt, reward 1 when the last number in the completion
equals the answer. It runs in a callback after step 0 (before any update) and every
`eval_every` steps; its own time is taken off TRL's clock, so the curve shows training time only.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

# The answer rule of shared.tasks.extract_answer + shared.rewards.exact_match, restated here
# because this script cannot import the project (tests/bench/test_suite.py checks they agree).
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def _norm(s: str) -> str:
    s = s.strip().replace(",", "")
    try:
        f = float(s)
    except ValueError:
        return s
    return str(int(f)) if f.is_integer() else repr(f)


def exact_match(completion: str, answer: str) -> float:
    """1.0 when the last number in `completion` equals `answer` (as numbers), else 0.0."""
    found = _NUMBER.findall(completion)
    if not found:
        return 0.0
    got = found[-1].replace(",", "")
    if "." in got:
        got = got.rstrip("0").rstrip(".") or "0"
    got = "0" if got == "-0" else got
    return 1.0 if _norm(got) == _norm(answer) else 0.0


def _plain(v: Any) -> str:
    """A config value as text: an enum's value ("linear"), not its name (SchedulerType.LINEAR)."""
    return str(getattr(v, "value", v))


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return None if not xs else xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def load_reward(ref: str | None) -> Any:
    """`fn(completion, answer, metadata)` from "/path/file.py:function", or exact match."""
    if not ref:
        return lambda completion, answer, metadata: exact_match(completion, answer)
    import importlib.util

    path, _, name = ref.rpartition(":")
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name)
    return lambda completion, answer, metadata: float(fn(completion, answer, metadata=metadata))


def stop_token_ids(tokenizer: Any, model: Any, stop: list[str]) -> list[int]:
    """The ids of `stop` strings (each must be one token); they join the generation config's EOS
    ids, which is how TRL ends a completion and masks what follows."""
    ids: list[int] = []
    for s in stop:
        got = tokenizer.encode(s, add_special_tokens=False)
        if len(got) != 1:
            raise ValueError(f"stop string {s!r} is {len(got)} tokens; TRL ends completions on token ids only")
        ids += got
    if ids:
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, *eos, *ids]
    return ids


class HeldOut:
    """The held-out protocol: greedy completions of every test prompt, scored by `score`; each
    evaluation's own time is taken off the training clock (`eval_s`)."""

    def __init__(self, cfg: dict[str, Any], tokenizer: Any, score: Any, stop_ids: list[int]) -> None:
        self.test, self.max_tokens = cfg["test"], int(cfg["max_tokens"])
        self.tokenizer, self.score, self.stop_ids = tokenizer, score, stop_ids
        self.t_launch = float(cfg["t_launch"])
        self.curve: list[dict[str, float]] = []
        self.eval_s = 0.0

    def reward(self, m: Any) -> float:  # a PreTrainedModel
        import torch

        tok = self.tokenizer
        was_training = m.training
        m.eval()
        side, tok.padding_side = tok.padding_side, "left"
        try:
            batch = tok([p["prompt"] for p in self.test], return_tensors="pt", padding=True)
        finally:
            tok.padding_side = side
        with torch.no_grad():
            out = m.generate(
                **batch,
                do_sample=False,
                max_new_tokens=self.max_tokens,
                pad_token_id=tok.pad_token_id,
                eos_token_id=[tok.eos_token_id, *self.stop_ids],
            )
        texts = tok.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        m.train(was_training)
        return sum(
            self.score(t, p["answer"], p.get("metadata", {})) for t, p in zip(texts, self.test, strict=True)
        ) / len(self.test)

    def evaluate(self, m: Any, step: int) -> None:
        t0 = time.time()
        reward = self.reward(m)
        # Seconds of training since launch: evaluation time so far is not TRL's to pay.
        self.curve.append(
            {"step": step, "t_s": t0 - self.t_launch - self.eval_s, "reward": reward, "wall_s": t0 - self.t_launch}
        )
        self.eval_s += time.time() - t0


def callback(cfg: dict[str, Any], held_out: HeldOut, clock: dict[str, Any], train_log: list[dict[str, float]]) -> Any:
    """The TrainerCallback that evaluates at step 0 and every eval_every steps, and logs rewards."""
    from transformers import TrainerCallback

    evaluating = bool(cfg.get("evaluate", True))  # False: the cost of a step only
    every, steps, t_launch = int(cfg["eval_every"]), int(cfg["steps"]), float(cfg["t_launch"])

    class Callback(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):  # type: ignore[no-untyped-def]
            clock["first_step_start"] = time.time() - t_launch
            if evaluating:
                held_out.evaluate(model, 0)

        def on_step_end(self, args, state, control, model=None, **kw):  # type: ignore[no-untyped-def]
            step = state.global_step
            if evaluating and (step % every == 0 or step == steps):
                held_out.evaluate(model, step)

        def on_log(self, args, state, control, logs=None, **kw):  # type: ignore[no-untyped-def]
            if logs and "reward" in logs:
                train_log.append(
                    {
                        "step": state.global_step,
                        "reward": float(logs["reward"]),
                        "t_s": time.time() - t_launch - held_out.eval_s,
                        "completion_length": logs.get("completions/mean_length"),
                    }
                )

    return Callback()


def grpo_config(cfg: dict[str, Any]) -> Any:
    """TRL's settings mirroring our job spec (see the module docstring)."""
    from trl import GRPOConfig

    per_step = int(cfg["prompts_per_step"]) * int(cfg["group_size"])
    micro = min(int(cfg["micro_batch_size"]), per_step)
    return GRPOConfig(
        output_dir=str(Path(cfg["workdir"]) / "trl-out"),
        use_cpu=bool(cfg.get("use_cpu", True)),  # False: the GPU variant (deploy/gpu_bench.py)
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_step // micro,
        num_generations=int(cfg["group_size"]),
        max_completion_length=int(cfg["max_tokens"]),
        temperature=float(cfg["temperature"]),
        top_p=1.0,
        top_k=0,
        learning_rate=float(cfg["lr"]),
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        scale_rewards="group",
        loss_type="dapo",
        max_steps=int(cfg["steps"]),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=int(cfg["seed"]),
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


# The GRPOConfig fields grpo_config_defaults sets; every other field keeps TRL's default.
DEFAULTS_SET = (
    "output_dir",
    "use_cpu",
    "bf16",
    "per_device_train_batch_size",
    "num_generations",
    "max_completion_length",
    "learning_rate",
    "max_steps",
    "seed",
    "logging_steps",
    "save_strategy",
    "report_to",
    "disable_tqdm",
)
# TRL's defaults a comparison with ours turns on, read back from the config (result "trl_settings").
DEFAULTS_READ = (
    "lr_scheduler_type",
    "warmup_steps",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "optim",
    "max_grad_norm",
    "beta",
    "epsilon",
    "epsilon_high",
    "scale_rewards",
    "loss_type",
    "num_iterations",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "temperature",
    "top_p",
    "top_k",
    "mask_truncated_completions",
    "importance_sampling_level",
    "gradient_checkpointing",
    "disable_dropout",
    "shuffle_dataset",
)


def grpo_config_defaults(cfg: dict[str, Any]) -> Any:
    """TRL's own defaults, as a user on a CPU runs GRPOTrainer: only the run's shape (prompts_per_step
    x group_size completions per optimizer step, in one batch), its length, lr, steps and seed, and
    bf16 off (TRL's bf16=True runs ~17 s/step on a CPU without bfloat16 matmuls). Logging, saving and
    the progress bar are bookkeeping. Everything else (the lr schedule, the loss, clipping,
    gradient checkpointing, ...) is TRL's: DEFAULTS_READ lists what the result reports."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(Path(cfg["workdir"]) / "trl-out"),
        use_cpu=bool(cfg.get("use_cpu", True)),
        bf16=False,
        per_device_train_batch_size=int(cfg["prompts_per_step"]) * int(cfg["group_size"]),
        num_generations=int(cfg["group_size"]),
        max_completion_length=int(cfg["max_tokens"]),
        learning_rate=float(cfg["lr"]),
        max_steps=int(cfg["steps"]),
        seed=int(cfg["seed"]),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    t_launch = float(cfg["t_launch"])
    torch.set_num_threads(int(cfg["threads"]))
    torch.manual_seed(int(cfg["seed"]))
    tokenizer = AutoTokenizer.from_pretrained(cfg["model_path"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model_path"], dtype=torch.float32)
    score = load_reward(cfg.get("reward"))
    held_out = HeldOut(cfg, tokenizer, score, stop_token_ids(tokenizer, model, cfg.get("stop") or []))
    clock: dict[str, Any] = {"first_step_start": None}
    train_log: list[dict[str, float]] = []

    def reward(completions: list[str], answer: list[str], metadata: list[str], **_: Any) -> list[float]:
        """TRL reward function: the dataset's columns arrive as keyword arguments."""
        return [score(c, a, json.loads(m)) for c, a, m in zip(completions, answer, metadata, strict=True)]

    dataset = Dataset.from_list(
        [
            {"prompt": p["prompt"], "answer": p["answer"], "metadata": json.dumps(p.get("metadata", {}))}
            for p in cfg["train"]
        ]
    )
    args = grpo_config_defaults(cfg) if cfg.get("trl_defaults") else grpo_config(cfg)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[callback(cfg, held_out, clock, train_log)],
    )
    trainer.train()
    return {
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "generation": "transformers generate (TRL's default; its vLLM mode needs vllm<=0.31)",
        "curve": held_out.curve,
        "train_reward": train_log,
        "startup_s": clock["first_step_start"],
        "completion_tokens_median": _median(
            [x["completion_length"] for x in train_log if x.get("completion_length") is not None]
        ),
        "eval_s_total": held_out.eval_s,
        "wall_s": time.time() - t_launch,
        "steps": int(cfg["steps"]),
        "trl_settings": {k: _plain(getattr(args, k, None)) for k in DEFAULTS_READ},
        "trl_fields_set": list(DEFAULTS_SET) if cfg.get("trl_defaults") else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    a = p.parse_args()
    result = run(json.loads(a.config.read_text()))
    a.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
