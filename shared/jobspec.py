"""The job spec: what a user submits to run one RL job (stored in the ledger, read by every service).

Every field has a constraint and a description; unknown fields are rejected, so a typo in a spec is
a 422 naming the field rather than a silently ignored setting.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, Strict, ValidationError, model_validator

from shared.datasets import TASKS, DatasetSource, TaskSpec
from shared.environments.spec import EnvironmentSpec
from shared.rewards.spec import REWARDS, RewardSpec
from shared.schema import LORA_MODULE, LoraAdapter, SamplingParams
from shared.spectypes import PrintableStr, SpecModel, refuse_bad_text
from shared.staleness_bound import groups_in_flight, start_bound
from shared.tracking import TrackingSink

__all__ = [
    "REWARDS",
    "TASKS",
    "DropSkewSpec",
    "EvalSetSpec",
    "JobPatch",
    "JobSpec",
    "RewardSpec",
    "TaskSpec",
    "TrackingSpec",
    "format_validation_error",
    "local_model_dir",
    "stored_spec",
]

# Names of the trainer's registries (trainer_svc.algorithms); a test keeps the two in step.
Advantage = Literal["grpo", "group_mean", "rloo"]
Loss = Literal["aipo", "ppo_clip", "gspo", "reinforce"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LrScheduleName = Literal["constant", "linear", "cosine"]


# Bounds that no job reaches but that keep every number in what JSON, the ledger's 64-bit
# integers and the engines accept (numpy seeds are 32-bit).
MAX_STEPS = 10_000_000
MAX_SEED = 2**32 - 1
MAX_TOKEN_ID = 2**31 - 1
MAX_TOP_K = 2**31 - 1  # a vocabulary size; k >= the vocabulary keeps every token, as 0 does
MAX_SCALE = 1e9

# A chat-template variable: a short string, a bounded integer, a finite float or a flag.
TemplateValue = (
    Annotated[str, Field(max_length=10_000)]
    | Annotated[int, Field(ge=-(2**53), le=2**53)]
    | Annotated[float, Field(ge=-MAX_SCALE, le=MAX_SCALE)]
    | bool
)


class _Strict(SpecModel):
    """Unknown fields rejected, numbers finite, strings bounded (shared.spectypes)."""


class SamplingSpec(_Strict):
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="Sampling temperature for training rollouts.")
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling mass; 1.0 keeps the full distribution. The trainer scores every token under "
        "the same truncated distribution (ARCHITECTURE.md, the behaviour policy).",
    )
    top_k: int = Field(
        0,
        ge=0,
        le=MAX_TOP_K,
        description="Sample among the k most likely tokens (before top_p); 0 keeps every token. "
        "The trainer applies the same cut.",
    )
    max_tokens: int = Field(16, ge=1, le=32768, description="Maximum completion tokens per sample.")
    stop: list[Annotated[str, Field(max_length=1000)]] = Field(
        default_factory=list,
        max_length=64,
        description="Stop strings (vLLM): a completion ends at the first one; the text the reward sees ends there "
        '(the string itself excluded unless include_stop_str_in_output). E.g. ["\\n"] for one-line answers.',
    )
    stop_token_ids: list[Annotated[int, Field(le=MAX_TOKEN_ID)]] = Field(
        default_factory=list,
        max_length=64,
        description="Token ids that end a completion besides the model's EOS (e.g. a chat model's end-of-turn token).",
    )
    min_tokens: int = Field(
        0, ge=0, le=32768, description="Tokens to generate before EOS or a stop may end a completion."
    )
    include_stop_str_in_output: bool = Field(False, description="Keep the matched stop string in the completion text.")
    seeded: bool = Field(
        False,
        description="Give every training group its own sampling seed, from the job's seed and the group's place in "
        "the feed order: a sync job then repeats exactly on the same machine (the golden test's job), whatever "
        "jobs the generator served before and however it batched the groups. Off: rollouts draw from the "
        "engine's one generator. Costs vLLM a sampling pass per sequence, and on GPU its FlashInfer sampler.",
    )

    @model_validator(mode="after")
    def _stops(self) -> SamplingSpec:
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids (>= 0)")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    def params(self, **overrides: float | int) -> SamplingParams:
        """The wire form (shared.schema.SamplingParams) of these settings, with live overrides."""
        return SamplingParams(**{**self.model_dump(exclude={"seeded"}), **overrides})


class AlgorithmSpec(_Strict):
    advantage: Advantage = Field(
        "grpo", description="Advantage estimator: grpo (group z-score), group_mean (AIPO / Dr.GRPO), rloo."
    )
    loss: Loss = Field(
        "aipo",
        description="Policy loss: aipo (truncated IS), ppo_clip (low/high clip), "
        "gspo (sequence ratio), reinforce (no correction).",
    )
    aggregation: Aggregation = Field(
        "token-mean", description="How per-token losses are averaged over the global batch."
    )
    rho: float = Field(2.0, ge=1.0, le=1e6, description="AIPO truncation: importance weight min(pi/mu, rho).")
    clip_low: float = Field(0.2, gt=0.0, lt=1.0, description="ppo_clip: ratio clipped below at 1 - clip_low.")
    clip_high: float = Field(
        0.28, gt=0.0, le=10.0, description="ppo_clip: ratio clipped above at 1 + clip_high (DAPO clip-higher)."
    )
    gspo_clip_low: float = Field(3e-4, gt=0.0, lt=1.0, description="gspo: sequence ratio clipped below at 1 - this.")
    gspo_clip_high: float = Field(4e-4, gt=0.0, le=10.0, description="gspo: sequence ratio clipped above at 1 + this.")
    kl_coef: float = Field(
        0.0, ge=0.0, le=100.0, description="Weight of the k3 KL to the frozen initial policy; 0 disables it."
    )
    entropy_coef: float = Field(
        0.0,
        ge=0.0,
        le=100.0,
        description="Entropy bonus: the loss minus this x the entropy of the policy's next-token "
        "distribution at the model's tokens, averaged like the policy loss "
        "(`aggregation`); 0 disables it (the entropy is then a metric only).",
    )
    staleness_lr: bool = Field(
        False, description="Divide the step size by max(1, mean staleness of the batch) (Zhang et al. 2016)."
    )
    lr: float = Field(
        1e-6,
        gt=0.0,
        le=1.0,
        description="AdamW peak learning rate (1e-6 suits billion-parameter models; tiny ones "
        "take 1e-4): the first step's with no warm-up, every step's with lr_schedule constant.",
    )
    lr_schedule: LrScheduleName = Field(
        "linear",
        description="The lr by step (trainer_svc/algorithms.py lr_at): after the warm-up, constant keeps "
        "lr; linear and cosine (half a cosine) decay from lr at step warmup_steps to "
        "min_lr_ratio x lr at the last step. linear by default, as TRL's and HF Trainer's "
        "(on the own-task bench it learned as fast as TRL's defaults, constant did not: "
        "results/ecosystem.md, defaults_vs_trl). A live lr (PATCH) replaces lr from the next step "
        "on: the schedule goes on by step, scaled by new lr / old lr; a resume continues it "
        "at its step.",
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="Linear warm-up: step t <= warmup_steps trains at lr x t / warmup_steps "
        "(step 1 at lr / warmup_steps, never 0); 0: none. At most `steps`.",
    )
    min_lr_ratio: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="linear, cosine: the last step's lr as a fraction of lr (0: the last step makes no update).",
    )
    # a JSON array is a tuple (strict=False for the container), its items stay strict floats
    betas: tuple[
        Annotated[float, Strict(), Field(ge=0.0, lt=1.0)], Annotated[float, Strict(), Field(ge=0.0, lt=1.0)]
    ] = Field(
        (0.9, 0.999),
        strict=False,
        description="AdamW (beta1, beta2): decay rates of the gradient's first and second moment estimates.",
    )
    eps: float = Field(
        1e-8, gt=0.0, le=1.0, description="AdamW epsilon, added to the root of the second moment estimate."
    )
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0.0, le=1e6, description="Gradient clipping by global norm.")
    micro_batch_size: int = Field(
        64,
        ge=1,
        le=1_000_000,
        description="Gradient accumulation, in samples: one optimizer step covers the step's "
        "whole batch (prompts_per_step x group_size samples), run as "
        "forward/backward passes of at most this many samples each (per rank; "
        "with packing, micro_batch_tokens decides instead) "
        "whose gradients add up. The loss is normalised over the whole batch, so "
        "the update does not depend on it: only memory and speed do.",
    )
    packing: bool = Field(
        False,
        description="Sequence packing: each forward/backward pass is one row of whole samples back to back "
        "(at most micro_batch_tokens tokens, first-fit decreasing; micro_batch_size is not used), "
        "position ids restarting for each sample and attention confined to it (a block-diagonal "
        "causal mask on CPU, varlen flash attention with attn_implementation flash_attention_2), "
        "instead of rows padded to the longest sample. Same loss and gradients within float "
        "rounding; no compute spent on padding. The trainer checks at start-up that the model "
        "confines attention this way (transformers >= 5) and refuses to start otherwise. Off by "
        "default: the padded path is what the rest of the tests and results were measured with.",
    )
    micro_batch_tokens: int = Field(
        8192,
        ge=1,
        le=10_000_000,
        description="With packing: the token budget (prompt + completion tokens) of one "
        "packed forward/backward pass per rank; a sample longer than it gets "
        "a pass of its own. Memory and speed only, as for micro_batch_size.",
    )
    logprob_chunk_tokens: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="Memory: > 0 computes the policy's per-token logprobs (and entropy) over "
        "this many sequence positions at a time, each chunk's head, log-softmax and "
        "gather checkpointed, so the micro-batch's full-vocabulary float32 logits "
        "never exist at once (same values and gradients; the backward recomputes "
        "the head). 0: unchunked. Unsharded HF models with a linear head; others "
        "(and FSDP2 ranks) run unchunked.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Memory: activation checkpointing of the policy's decoder layers (HF "
        "gradient_checkpointing_enable, non-reentrant): the backward recomputes each layer's "
        "forward instead of keeping its activations. Same loss and gradients; slower.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="The trainer's compute precision. float32: everything in float32. bfloat16: mixed "
        "precision: float32 master weights, gradients and AdamW state, the forward (policy "
        "and reference) under torch.autocast to bfloat16 (CPU or CUDA autocast; FSDP2 on "
        "CUDA also all-gathers bfloat16 parameters), logprobs and the loss in float32 from "
        "the bfloat16 logits. The cost shows as the step metric mismatch_kl.",
    )
    cpu_offload: bool = Field(
        False,
        description="Memory, with several trainer ranks (FSDP2, torchrun): keep the sharded parameters, "
        "gradients and optimizer state in CPU memory (FSDP2 CPUOffloadPolicy), the optimizer step "
        "on CPU. No effect with one rank.",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO dynamic sampling: drop groups whose rewards all equal (no gradient) and fill the "
        "batch from new groups; each drop is recorded in the ledger with its reason.",
    )
    dynamic_sampling_max_drops: int = Field(
        4,
        ge=0,
        le=1000,
        description="Per step, at most this many batches' worth of groups are dropped for "
        "dynamic sampling; after that all-equal groups are trained (a task the policy "
        "always or never solves would otherwise stall the job).",
    )
    overlong: Literal["keep", "mask", "penalty"] = Field(
        "keep",
        description="Samples cut at max_tokens (finish_reason length): keep them as they are, mask them from "
        "the loss (DAPO over-long filtering), or add DAPO's soft length penalty to their reward.",
    )
    overlong_buffer: int = Field(
        4,
        ge=1,
        le=32768,
        description="penalty: the penalty ramps from 0 at max_tokens - this to -overlong_penalty at max_tokens.",
    )
    overlong_penalty: float = Field(1.0, ge=0.0, le=100.0, description="penalty: its size at max_tokens.")


class LoraSpec(_Strict):
    """LoRA fine-tuning (PEFT): the job's model stays frozen; only low-rank adapters on the target
    modules train, and only they travel to the generators at each version."""

    rank: int = Field(8, ge=1, le=512, description="Adapter rank r (vLLM serves ranks up to 512).")
    alpha: float = Field(16.0, gt=0.0, le=1e6, description="Scale numerator: the update is (alpha / rank) * B @ A.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input while training.")
    target_modules: list[Annotated[str, Field(pattern=LORA_MODULE)]] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        max_length=64,
        description="Names of the linear layers that get adapters (Llama-style names by default); a name the "
        "model lacks fails the trainer at start.",
    )

    def adapter(self) -> LoraAdapter:
        """The adapter's description on the wire (PolicyAnnouncement.lora)."""
        return LoraAdapter(rank=self.rank, alpha=self.alpha, target_modules=list(self.target_modules))


class GeneratorSpec(_Strict):
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        None,
        description="vLLM's dtype for this job's engines (auto: vLLM's choice for the checkpoint); "
        "unset: the generator's GEN_DTYPE setting (float32 by default, which keeps behaviour "
        "logprobs equal to the trainer's on CPU). Lower precision is faster on a GPU and shows as "
        "the trainer's mismatch_kl; the post-swap probe check is loosened to at least 0.1 (0.5 with fp8).",
    )
    quantization: Literal["fp8"] | None = Field(
        None,
        description="vLLM's online quantization of the weights (fp8, as LlamaRL does for generation): CUDA "
        "only (the CPU build refuses it when the engine starts); the trainer's weights stay "
        "unquantized, and each swap hands them to vLLM's reload_weights, which quantizes them "
        "as it loads.",
    )

    def engine_dtype(self, default: str) -> str:
        """The dtype the engine is built with: this spec's, else the generator's setting `default`."""
        return self.dtype or default


class AdaptiveStalenessSpec(_Strict):
    k_min: int = Field(0, ge=0, le=64, description="Tightest bound the controller may set.")
    k_max: int = Field(4, ge=0, le=64, description="Loosest bound the controller may set.")
    metric: Literal["ess", "mismatch_kl"] = Field(
        "ess", description="Drift signal: normalised ESS of the importance weights, or the k3 mismatch KL."
    )
    threshold: float = Field(
        0.9, gt=0.0, le=MAX_SCALE, description="ess: tighten below it (0..1]; mismatch_kl: tighten above it."
    )
    patience: int = Field(3, ge=1, le=1000, description="Calm steps in a row before the bound loosens by one.")

    @model_validator(mode="after")
    def _range(self) -> AdaptiveStalenessSpec:
        if self.k_min > self.k_max:
            raise ValueError(f"k_min ({self.k_min}) must not exceed k_max ({self.k_max})")
        if self.metric == "ess" and self.threshold > 1.0:
            raise ValueError("threshold for metric 'ess' is a fraction in (0, 1]")
        return self


class GuardSpec(_Strict):
    """Collapse-guard thresholds (trainer_svc/guard.py). The defaults are loose enough that a healthy
    run never trips: a seat belt, not a tuning knob."""

    enabled: bool = Field(True, description="Check every update before it is published; false turns the guard off.")
    max_is: float = Field(
        100.0,
        gt=1.0,
        le=MAX_SCALE,
        description="Trip when the largest importance weight the loss applies (after AIPO's truncation or "
        "a clip; the raw pi/mu for reinforce, which applies none) exceeds this.",
    )
    min_ess: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="Trip when the normalised ESS of the importance weights the loss applies (raw "
        "for reinforce) falls below this: a few tokens carry the whole update.",
    )
    reward_window: int = Field(5, ge=1, le=10_000, description="Steps in the rolling reward mean.")
    reward_drop: float = Field(
        0.5, gt=0.0, le=1.0, description="Trip when the window mean falls below (1 - this) x the best window mean..."
    )
    min_best_reward: float = Field(
        0.2,
        ge=-MAX_SCALE,
        le=MAX_SCALE,
        description="...once the best window mean reached this (there was a signal to lose).",
    )
    reward_false_alarm: float = Field(
        0.001,
        gt=0.0,
        lt=0.5,
        description="...and by more than the reward noise explains: the chance that a healthy run "
        "at a steady, noisy reward trips anyway (sets the noise margin, guard.py "
        "reward_margin; smaller: a wider margin).",
    )
    on_no_checkpoint: Literal["lower_lr", "initial", "fail"] = Field(
        "lower_lr",
        description="A trip with no checkpoint to roll back to (checkpoint_every 0, or none from before the "
        "collapse): lower_lr keeps the current policy and lowers the lr (a non-finite update "
        "fails the job: its weights are unusable); initial restarts from the initial model; "
        "fail fails the job. A reward that fell from the job's first steps trusts only the "
        "initial model: the job restarts from it unless this is fail. Every trip is recorded "
        "and shown either way.",
    )
    lr_factor: float = Field(0.5, gt=0.0, lt=1.0, description="The lr after a trip, relative to before.")
    max_trips: int = Field(
        3, ge=0, le=1000, description="More trips than this in one job: the job fails with the reason."
    )


# The widest reward range a job may set: the trainer holds rewards as float32, and the group
# statistics of its advantages (squared differences summed over a group) stay finite up to here.
MAX_REWARD = 1e12


class RewardLimitsSpec(_Strict):
    """What the job accepts as a reward, and how long it goes on when its scorer only fails."""

    bounds: tuple[
        Annotated[float, Field(ge=-MAX_REWARD, le=MAX_REWARD)], Annotated[float, Field(ge=-MAX_REWARD, le=MAX_REWARD)]
    ] = Field(
        (-1e6, 1e6),
        strict=False,  # a JSON array is a tuple; its items stay as strict as every number of the spec
        description="[low, high]: a reward (or one of its named components) outside this range, or not a "
        "number, is a reward error of that sample (reward_status error, with the value in the reason; "
        "the reward's on_failure decides what the sample gets), never trained on as a number. Each "
        "bound at most 1e12 in size.",
    )
    fail_after_error_steps: int = Field(
        5,
        ge=0,
        le=MAX_STEPS,
        description="Fail the job once this many steps in a row trained on a batch whose every reward failed "
        "(error or timeout), naming the most common failure; a job with fewer steps fails at its last. "
        "0: never. (Under on_failure drop such samples are dead-lettered, and the job fails when every "
        "group dead-letters.)",
    )

    @model_validator(mode="after")
    def _ordered(self) -> RewardLimitsSpec:
        low, high = self.bounds
        if not low < high:
            raise ValueError(f"bounds [{low}, {high}]: the low bound must be below the high one")
        return self

    def error_steps(self, steps: int) -> int:
        """Steps in a row of failed rewards that fail a job of `steps` steps (0: never)."""
        return min(self.fail_after_error_steps, steps)


class DropSkewSpec(_Strict):
    """When the job warns that dropping biases what it trains on (shared/drop_skew.py): the samples
    kept out of the gradient (stale, dynamic sampling, over-long, failed rewards, ...) against
    those trained, by completion length and reward, over the whole job."""

    max_shift: float = Field(
        0.2,
        gt=0.0,
        le=10.0,
        description="Warn when the dropped samples' mean length or reward differs from the trained samples' by "
        "more than this, relative to the trained scale (the larger of the trained mean's magnitude and its "
        "p10..p90 spread): 0.2 is a fifth of it.",
    )
    min_dropped: int = Field(
        64,
        ge=1,
        le=1_000_000_000,
        description="Warn only once at least this many samples were dropped (with a reward, for the reward's "
        "shift): the means of fewer are noise.",
    )


class TrackingSpec(_Strict):
    """Experiment tracking (trainer_svc/tracking.py): the trainer feeds each sink the job spec as
    its config, every step's metrics, every evaluation round, and the run's changes (live knobs,
    collapse-guard trips). Where they are written is the trainer's setting (TRAINER_TRACKING_DIR);
    TRAINER_TRACKING adds sinks for every job."""

    sinks: list[TrackingSink] = Field(
        default_factory=list,
        max_length=3,
        description="Metric sinks: tensorboard (event files), mlflow (a run in the trainer's MLflow store, a local "
        "file store by default), wandb (a W&B run, offline unless the trainer says online). Each needs "
        "its package (pip install asyncrl[tracking]); empty: none.",
    )
    project: str = Field(
        "asyncrl",
        pattern=r"^[A-Za-z0-9_.-]{1,128}$",
        description="The W&B project, the MLflow experiment and the TensorBoard folder the run goes under.",
    )
    run_name: PrintableStr | None = Field(
        None, min_length=1, max_length=128, description="The run's display name; unset: <job name>-<job id>."
    )

    @model_validator(mode="after")
    def _unique_sinks(self) -> TrackingSpec:
        if len(set(self.sinks)) != len(self.sinks):
            raise ValueError(f"tracking.sinks must not repeat a sink, got {self.sinks}")
        return self


class EvalSamplingSpec(_Strict):
    temperature: float = Field(0.0, ge=0.0, le=10.0, description="0: greedy (one completion per problem is enough).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="The k most likely tokens only; 0 keeps every token.")
    n: int = Field(1, ge=1, le=1024, description="Samples per problem: n > 1 gives mean@n, pass@k and maj@n.")
    max_tokens: int | None = Field(
        None, ge=1, le=32768, description="Completion length; unset: the job's sampling.max_tokens."
    )


class EvalSetSpec(_Strict):
    """A named evaluation set: its problems, reward, sampling and cadence. The job's stop rules
    (sampling.stop, stop_token_ids, min_tokens) apply here too."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Unique name (letters, digits, _ . -).")
    dataset: DatasetSource | None = Field(
        None,
        description="Problems of this set, read like the task's datasets (field mapping and prompt template "
        "of `task`); unset: the task's held-out split.",
    )
    max_problems: int | None = Field(None, ge=1, le=1_000_000, description="Evaluate only the first N problems.")
    # RewardSpec is an Annotated union that typing cannot union with None again: null = unset
    reward: RewardSpec = Field(None, description="Reward of this set; unset: the job's reward.")  # type: ignore[assignment]
    sampling: EvalSamplingSpec = Field(default_factory=EvalSamplingSpec, description="How this set is sampled.")
    every: int | None = Field(
        None,
        ge=0,
        le=MAX_STEPS,
        description="Evaluate every N steps (0: only at the start and the end); unset: the job's eval_every.",
    )
    pass_k: list[Annotated[int, Field(ge=1, le=1024)]] = Field(
        default_factory=list,
        max_length=16,
        description="k values of pass@k (each <= sampling.n); unset: 1 and n. Reported when n > 1.",
    )
    pass_threshold: float = Field(
        1.0, ge=-MAX_SCALE, le=MAX_SCALE, description="A sample passes (pass@k, maj@n) when its reward reaches this."
    )

    @model_validator(mode="before")
    @classmethod
    def _null_reward_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict) and "reward" in data and data["reward"] is None:  # a stored spec's null
            data = {k: v for k, v in data.items() if k != "reward"}
        return data

    @model_validator(mode="after")
    def _ks(self) -> EvalSetSpec:
        bad = [k for k in self.pass_k if not 1 <= k <= self.sampling.n]
        if bad:
            raise ValueError(f"pass_k {bad} must lie in 1..sampling.n ({self.sampling.n})")
        return self

    @property
    def ks(self) -> list[int]:
        return sorted(set(self.pass_k or [1, self.sampling.n]))


class JobSpec(_Strict):
    name: PrintableStr = Field(
        "job", min_length=1, max_length=200, description="Human-readable job name (printable: no control characters)."
    )
    model_path: PrintableStr = Field(
        ..., min_length=1, max_length=4096, description="Local HF-format model directory (never downloaded)."
    )
    task: TaskSpec = Field(default_factory=TaskSpec, description="Where prompts and reference answers come from.")
    chat_template: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Render prompts with the tokenizer's chat template (system prompt, user turn, generation "
        "prompt): auto when the tokenizer has one, on (an error if it has none), off (plain text).",
    )
    chat_template_kwargs: dict[Annotated[PrintableStr, Field(min_length=1, max_length=200)], TemplateValue] = Field(
        default_factory=dict,
        max_length=64,
        description='Extra chat-template variables, e.g. {"enable_thinking": false}.',
    )
    reward: RewardSpec = Field(
        "exact_match",
        description=f"The reward: a built-in by name ({', '.join(REWARDS)}) or a reward object (shared/rewards). "
        "Left out: exact_match, or reasoning_gym (the dataset's own score_answer) for a reasoning_gym task, "
        "or verifiers (the environment's own rubric, each reward function a term) for a verifiers task.",
    )
    environment: EnvironmentSpec | None = Field(
        None,
        description="Multi-turn episodes: the environment each training rollout runs in (a built-in such as "
        "tools, or a user's class by import path), with its limits; the model's turns and the "
        "environment's replies are kept as token ids and only the model's are trained on. "
        "Unset: one completion per prompt, as with single_turn; for a verifiers task whose tasks have tools, "
        "the verifiers environment (shared/vfenv.py).",
    )
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec, description="Advantage, loss and optimizer.")
    lora: LoraSpec | None = Field(
        None, description="Train LoRA adapters instead of every weight; unset: full fine-tuning."
    )
    generator: GeneratorSpec = Field(default_factory=GeneratorSpec, description="The generators' engine precision.")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec, description="How training rollouts are sampled.")
    mode: Literal["async", "sync"] = Field(
        "async", description="async overlaps generation and training within max_staleness; sync waits (staleness 0)."
    )
    placement: Literal["split", "colocated"] = Field(
        "split",
        description="split: generators and trainer on their own cores or GPUs, overlapping (async) or "
        "not (sync); colocated: they share every core and GPU and take turns, each phase using "
        "all of them (GPU: the engine sleeps and the trainer's state is offloaded to host memory "
        "while the other runs). Colocated alternates, so it is sync only: mode defaults to sync "
        "with it, and async with it is refused.",
    )
    max_staleness: int = Field(
        1, ge=0, le=64, description="Drop samples generated more than this many policy versions ago (async only)."
    )
    adaptive_staleness: AdaptiveStalenessSpec | None = Field(
        None, description="Move the staleness bound between k_min and k_max from measured drift (async only)."
    )
    group_size: int = Field(8, ge=2, le=1024, description="Samples per prompt (the GRPO group).")
    prompts_per_step: int = Field(16, ge=1, le=100_000, description="Prompt groups in one optimizer step.")
    steps: int = Field(100, ge=1, le=MAX_STEPS, description="Optimizer steps to run.")
    eval_every: int = Field(
        10,
        ge=0,
        le=MAX_STEPS,
        description="Evaluate on the held-out set every N steps (0: only at the start and the end).",
    )
    eval_sets: list[EvalSetSpec] = Field(
        default_factory=list,
        max_length=32,
        description="Named evaluation sets; unset: one set `held_out`, the task's held-out split, "
        "greedy, every eval_every steps.",
    )
    generation_batch: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description="Prompt groups per generate call (counted in samples: held-out groups of one sample fill it "
        "together); unset: the generator's GEN_BATCH_GROUPS.",
    )
    checkpoint_every: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="Save an HF-format checkpoint every N steps (0: only when the job ends or stops).",
    )
    record_steps: bool = Field(
        True,
        description="Record in the ledger what each step trained on (its batch of token ids, behaviour logprobs, "
        "rewards and versions, compressed; its lr and RNG state) and the weights' checksum after it, so that "
        "`asyncrl replay` can re-run the training bit for bit. Costs about the batch's size per step (a few "
        "bytes per token); false: nothing recorded, and replay says it cannot.",
    )
    guard: GuardSpec = Field(
        default_factory=GuardSpec,
        description="Collapse guard: roll back to the last checkpoint and lower the lr on a trip.",
    )
    reward_limits: RewardLimitsSpec = Field(
        default_factory=RewardLimitsSpec,
        description="The range a reward must lie in, and when a job whose rewards all fail stops.",
    )
    drop_skew: DropSkewSpec = Field(
        default_factory=DropSkewSpec,
        description="When a warning says that dropping samples biases the completion length or reward trained on.",
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed for data order, sampling and initialisation.")
    priority: int = Field(
        0,
        ge=-100,
        le=100,
        description="Place in the fleet's queue: a higher priority runs first; first in, first "
        "out among equal priorities. Never preempts a running job.",
    )
    share: float = Field(
        1.0,
        gt=0,
        le=1000,
        allow_inf_nan=False,
        description="The job's weight in generator time when jobs run together on one fleet (shares 2 and 1: "
        "twice the engine time when they compete for a generator); a job that cannot use its share (it waits "
        "on its trainer) leaves it to the others.",
    )
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec, description="Experiment tracking: TensorBoard, MLflow, W&B (none by default)."
    )

    @model_validator(mode="before")
    @classmethod
    def _text_is_storable(cls, data: Any) -> Any:
        refuse_bad_text(cls.__name__, data)
        return data

    @model_validator(mode="before")
    @classmethod
    def _gym_reward(cls, data: Any) -> Any:
        """A reasoning_gym task is scored by its dataset's own score_answer unless a reward is given."""
        task = data.get("task") if isinstance(data, dict) else None
        if isinstance(task, dict) and task.get("name") == "reasoning_gym" and "reward" not in data:
            data = {**data, "reward": "reasoning_gym"}
        return data

    @model_validator(mode="before")
    @classmethod
    def _verifiers_defaults(cls, data: Any) -> Any:
        """A verifiers task is scored by its own rubric unless a reward is given, and a task with
        tools plays its episodes in the verifiers environment unless an environment is given."""
        task = data.get("task") if isinstance(data, dict) else None
        if not (isinstance(task, dict) and task.get("name") == "verifiers"):
            return data
        if "reward" not in data:
            data = {**data, "reward": "verifiers"}
        env, args = task.get("env"), task.get("args") or {}
        if "environment" not in data and isinstance(env, str) and isinstance(args, dict):
            from shared.vfenv import VerifiersError, is_multi_turn  # imports verifiers: only for such a job

            try:
                multi = is_multi_turn(env, args)
            except (VerifiersError, TypeError, ValueError):
                multi = False  # the task section's own validation says what is wrong
            if multi:
                data = {**data, "environment": {"name": "verifiers"}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _colocated_is_sync(cls, data: Any) -> Any:
        """Co-located phases alternate: generation, then the step. Without a mode that is sync;
        async (generation overlapping the step on the same devices) is refused."""
        if isinstance(data, dict) and data.get("placement") == "colocated":
            if data.get("mode", "sync") != "sync":
                raise ValueError(
                    f"placement colocated alternates generation and training, so it needs mode sync "
                    f"(got mode {data['mode']!r}): use mode sync, or placement split for async"
                )
            if data.get("adaptive_staleness") is not None:
                raise ValueError("placement colocated is sync: adaptive_staleness (an async bound) does not apply")
            data = {**data, "mode": "sync"}
        return data

    @model_validator(mode="after")
    def _overlong_buffer(self) -> JobSpec:
        if self.algorithm.overlong == "penalty" and self.algorithm.overlong_buffer > self.sampling.max_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer ({self.algorithm.overlong_buffer}) must not exceed "
                f"sampling.max_tokens ({self.sampling.max_tokens})"
            )
        return self

    @model_validator(mode="after")
    def _warmup_within_steps(self) -> JobSpec:
        if self.algorithm.warmup_steps > self.steps:
            raise ValueError(
                f"algorithm.warmup_steps ({self.algorithm.warmup_steps}) must not exceed steps "
                f"({self.steps}): the lr would never reach algorithm.lr"
            )
        return self

    @model_validator(mode="after")
    def _unique_eval_sets(self) -> JobSpec:
        names = [e.name for e in self.eval_sets]
        if len(set(names)) != len(names):
            raise ValueError(f"eval_sets names must be unique, got {names}")
        return self

    def evaluation_sets(self) -> list[EvalSetSpec]:
        """The evaluation sets this job runs (the default `held_out` set when none are given)."""
        return list(self.eval_sets) or [EvalSetSpec(name="held_out")]

    def eval_due(self, es: EvalSetSpec, step: int) -> bool:
        """Whether set `es` is evaluated after `step` (step 0: the initial policy; the last step
        is always evaluated, by the trainer's final round)."""
        every = self.eval_every if es.every is None else es.every
        return step == 0 or step >= self.steps or bool(every and step % every == 0)

    @property
    def staleness_bound(self) -> int:
        """The starting bound: sync mode is async with k = 0; adaptive starts at its k_max."""
        adaptive = self.adaptive_staleness
        return start_bound(self.mode, self.max_staleness, None if adaptive is None else adaptive.k_max)

    @property
    def max_groups_in_flight(self) -> int:
        """Prompt groups the feeder may have outstanding: (k + 1) * batch: the backpressure that
        keeps generators within the staleness budget."""
        return groups_in_flight(self.staleness_bound, self.prompts_per_step)


def local_model_dir(path: str | Path, what: str = "model_path") -> Path:
    """`path` as the local model directory it must be, checked before anything loads from it: a
    path that is not a directory would otherwise be taken by transformers for a Hub model id and
    fetched (a network attempt; the spec promises none).

    Raises:
        ValueError: `path` is not a directory on this machine (the message says what it is).
    """
    p = Path(path)
    if p.is_dir():
        return p
    what_it_is = "is a file" if p.is_file() else "does not exist" if not p.exists() else "is not a directory"
    raise ValueError(
        f"{what} {str(path)!r} {what_it_is} on this machine: give the local directory of an HF-format model "
        "(config.json, the weights, the tokenizer); models are never downloaded"
    )


def stored_spec(stored: Mapping[str, Any]) -> JobSpec:
    """A job's spec as the ledger stored it (a JSON dict), read into a JobSpec: the one reader for
    what a job was (broker/verify.py's nominal in-flight bound, asyncrl/guard_calibration.py's rows),
    so the spec's defaults are stated in JobSpec only, never again as `.get(key, default)`.

    Tolerant of a spec stored by an older version: an item that no longer validates (a field since
    removed or renamed, a value outside a since-tightened constraint; the innermost item the error
    names that the stored spec holds, e.g. `task.path`, or a whole section whose rule between its
    fields changed) is left out, one at a time, so its default applies, as a reader of the dict
    would have had it. `model_fields_set` (of the spec and of each section) says which fields the
    stored spec gave and this reader kept. The services do not read a spec this way: a spec that no
    longer validates must not run, so they validate strictly (`JobSpec.model_validate`,
    broker/runtime.py `spec_problem`).

    Raises:
        pydantic.ValidationError: not a job spec even without the items that do not validate (no
            model_path, say, or a rule between the spec's top-level fields).
    """
    data: dict[str, Any] = copy.deepcopy(dict(stored))
    while True:
        try:
            return JobSpec.model_validate(data)
        except ValidationError as exc:
            if not _leave_out(data, exc.errors()[0]["loc"]):
                raise


def _leave_out(data: dict[str, Any], loc: tuple[int | str, ...]) -> bool:
    """Delete the innermost item of `data` on the error location `loc` (locations may name union
    members or a model's rule past the data's items: the walk stops at the first part the data
    does not hold); False when `loc` names no item of it."""
    found: tuple[Any, Any] | None = None  # (container, key) of the innermost item on `loc`
    node: Any = data
    for part in loc:
        holds = (isinstance(node, dict) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        )
        if not holds:
            break
        found, node = (node, part), node[part]
    if found is None:
        return False
    container, key = found
    del container[key]
    return True


class JobPatch(_Strict):
    """The knobs that may change while a job runs; services apply them at their next step."""

    @model_validator(mode="before")
    @classmethod
    def _text_is_storable(cls, data: Any) -> Any:
        refuse_bad_text(cls.__name__, data)
        return data

    lr: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="New peak learning rate (algorithm.lr): the schedule goes on by step, "
        "scaled by new lr / old lr; a step's metric `lr` is the lr it trained with.",
    )
    max_staleness: int | None = Field(None, ge=0, le=64, description="New staleness bound k (async jobs).")
    temperature: float | None = Field(None, gt=0.0, le=10.0, description="Sampling temperature of new rollouts.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus mass of new rollouts.")
    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K, description="Top-k of new rollouts (0: none).")
    generation_batch: int | None = Field(None, ge=1, le=100_000, description="Prompt groups per generate call.")

    def changes(self) -> dict[str, float]:
        return {k: v for k, v in self.model_dump().items() if v is not None}

    def apply(self, spec: dict) -> dict:
        """The spec (as a dict) with these changes; validate the result with JobSpec."""
        out = {**spec, "algorithm": dict(spec.get("algorithm") or {}), "sampling": dict(spec.get("sampling") or {})}
        c = self.changes()
        if "lr" in c:
            out["algorithm"]["lr"] = c["lr"]
        for key in ("temperature", "top_p", "top_k"):
            if key in c:
                out["sampling"][key] = c[key]
        for key in ("max_staleness", "generation_batch"):
            if key in c:
                out[key] = c[key]
        return out


def _storable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def format_validation_error(exc: Exception) -> list[dict]:
    """Turn a pydantic ValidationError into [{field, message}] that says what to fix."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return [{"field": "", "message": str(exc)}]
    out = []
    for e in errors():
        loc = list(e.get("loc", ()))
        if loc and loc[0] == "body":  # FastAPI prefixes request-body fields with "body"
            loc = loc[1:]
        # a 422 body is JSON in UTF-8: a lone surrogate in a field name is written as its escape
        field = _storable(".".join(str(p) for p in loc))
        msg = _storable(e.get("msg", "invalid"))
        if e.get("type") == "json_invalid":
            field, msg = (
                "",
                f"the request body is not valid JSON ({e.get('ctx', {}).get('error', msg)}); send a JSON object",
            )
        elif e.get("type") == "extra_forbidden":
            msg = f"unknown field '{field}'; remove it or check its spelling"
        elif e.get("type") == "missing":
            msg = f"field '{field}' is required"
        out.append({"field": field, "message": msg})
    return out
