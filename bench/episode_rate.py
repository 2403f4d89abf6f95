"""`python -m bench episode-rate`: multi-turn episodes played concurrently vs one after another,
against the engine's own single-turn rate (issue 16's benchmark).

A scripted tool environment (`SleepyTool`): every `step` sleeps `tool_sleep_s` (50 ms) with a sync
`time.sleep` -- so it runs in the episode driver's worker thread, as a real blocking tool does --
then replies with a short tool result; the episode ends after `turns` model turns. Every model turn
is exactly `tokens_per_turn` tokens (`min_tokens == max_tokens`), so each run below generates the
same number of model tokens and the rates compare. The model (the tiny random-init model,
asyncrl.tiny_model) does not decide anything: the environment does.

Measured on one vLLM CPU engine (generator_svc.engine.Engine), warmed up first, each run
repeated `reps` times interleaved (concurrent, sequential, single-turn, ...), medians reported;
vLLM's prefix cache is emptied before every run, so none reuses another's KV:

- concurrent: `groups` x `n` episodes through `generator_svc.episodes.run_groups` (the generator's
  path). Episodes/s, model tokens/s, engine calls and sequences per call, the fraction of the wall
  time spent inside `Engine.generate` (`engine_busy_fraction`) and where the engine idled (before
  the first call, between calls, after the last).
- sequential: the episodes one after another, each its own `run_groups` call with one group of
  n = 1. Its time is linear in the episodes, so `sequential_episodes` of them (default 16) give
  its rate.
- single-turn: the engine with no environment at all: `turns` generate calls, each of
  `groups * n` plain requests (the episodes' openings) of `tokens_per_turn` tokens: the same
  sequences per call, tokens per sequence and total model tokens as the concurrent run.
- single-turn, same contexts: the same calls with, as prompts, the token ids each turn of the
  episodes had as context (recorded from a concurrent run): a later turn's context is longer
  (earlier turns and tool replies), so the engine's own time per turn grows; this rate takes that
  out of the comparison.

`utilisation` = concurrent model tokens/s / single-turn model tokens/s (issue 16's figure, target
>= 0.8); `utilisation_same_contexts` = the same against the same-contexts rate;
`utilisation_bound_lockstep` = single-turn time / (the concurrent run's engine time + `turns` tool
calls): with every episode's turn batched into one call, all episodes call the tool at once and
the engine has nothing to run meanwhile, so this is the most the concurrent run can reach at this
shape. `speedup_vs_sequential` = concurrent episodes/s / sequential episodes/s.

A turn that reaches `max_tokens` is reported by vLLM as finish "length", and `run_episode` ends an
episode at a cut-off turn; here every turn is cut at its fixed length by construction, so the
bench's engine wrapper (`TimedEngine`) reports a turn of exactly `tokens_per_turn` tokens as
finished ("stop"): the environment then answers it, as it would answer a turn the model ended.

Results: results/episode_rate.json and results/episode_rate.md.

    python -m bench episode-rate
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.claims import machine
from shared.environments.base import ModelTurn, StepResult

TOOL_SLEEP_S = 0.05
TOOL_REPLY = "42"


class SleepyTool:
    """A tool that takes `sleep_s` per call: every step sleeps (sync, so in the driver's worker
    thread) and replies with a short result; the episode is done after `turns` model turns."""

    def __init__(self, turns: int = 4, sleep_s: float = TOOL_SLEEP_S, reply: str = TOOL_REPLY) -> None:
        self.turns, self.sleep_s, self.reply = turns, sleep_s, reply
        self.steps = 0

    def start(self, row: Any) -> str:
        return str(row["prompt"])

    def step(self, turn: ModelTurn) -> StepResult:
        time.sleep(self.sleep_s)
        self.steps += 1
        done = self.steps >= self.turns
        return StepResult(text="" if done else self.reply, done=done, role="tool")


@dataclass
class TimedEngine:
    """The engine with its generate calls timed: seconds inside `generate`, calls, sequences per
    call, model tokens. A completion of exactly `fixed_tokens` tokens is reported as finished
    ("stop"; see the module docstring)."""

    engine: Any
    fixed_tokens: int
    busy_s: float = 0.0
    calls: int = 0
    tokens: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    spans: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each call
    contexts: list[list[int]] = field(default_factory=list)  # token-id prompts, when recording
    record: bool = False

    def reset(self) -> None:
        """Zero the counters and empty vLLM's prefix cache (no run reuses another's KV)."""
        self.busy_s, self.calls, self.tokens, self.batch_sizes, self.spans = 0.0, 0, 0, [], []
        self.engine._llm.reset_prefix_cache()

    def generate(self, prompts: list, params: list, n: list[int]) -> list:
        if self.record:
            self.contexts += [list(p) for p in prompts if isinstance(p, list)]
        t0 = time.perf_counter()
        out = self.engine.generate(prompts, params, n)
        t1 = time.perf_counter()
        self.busy_s += t1 - t0
        self.spans.append((t0, t1))
        self.calls += 1
        self.batch_sizes.append(sum(n))
        self.tokens += sum(len(s.completion_ids) for group in out for s in group)
        return [
            [
                replace(s, finish_reason="stop")
                if s.finish_reason == "length" and len(s.completion_ids) == self.fixed_tokens
                else s
                for s in group
            ]
            for group in out
        ]


def _model(workdir: Path) -> Path:
    from asyncrl.tiny_model import build_tiny_model

    model = workdir / "tiny-model"
    if not (model / "config.json").exists():
        build_tiny_model(model, seed=0)
    return model


def bench_episode_rate(
    out_dir: str | None = "results",
    *,
    groups: int = 8,
    n: int = 8,
    turns: int = 4,
    tokens_per_turn: int = 24,
    tool_sleep_s: float = TOOL_SLEEP_S,
    reps: int = 3,
    sequential_episodes: int | None = 16,
    workdir: str = "runs/bench-episode-rate",
    model_dir: str | None = None,
) -> dict[str, Any]:
    """Measure (see the module docstring); write out_dir/episode_rate.{json,md} unless out_dir is None."""
    from transformers import AutoTokenizer

    from generator_svc.engine import Engine
    from generator_svc.episodes import run_groups
    from shared.environments.episode import codec_for
    from shared.environments.spec import EpisodeLimits
    from shared.schema import PromptGroup, SamplingParams

    model = Path(model_dir) if model_dir else _model(Path(workdir))
    max_model_len = 256
    engine = TimedEngine(Engine(str(model), seed=0, dtype="float32", max_model_len=max_model_len), tokens_per_turn)
    codec = codec_for(AutoTokenizer.from_pretrained(str(model)), "auto")
    limits = EpisodeLimits(max_turns=turns, max_total_tokens=max_model_len, step_timeout_s=30.0)
    # unseeded, as a job's training sampling is (on the CPU engine a seeded request whose prefill is
    # chunked -- a turn's context beyond the step's token budget -- fails in vLLM 0.32's bookkeeping)
    sampling = SamplingParams(temperature=1.0, max_tokens=tokens_per_turn, min_tokens=tokens_per_turn)

    def group(g: int, k: int, *, episode: int | None = None) -> PromptGroup:
        gid = f"rate/g{g}" if episode is None else f"rate/g{g}e{episode}"
        return PromptGroup(
            job_id="rate",
            msg_id=gid,
            group_id=gid,
            policy_version=0,
            prompt_index=g,
            prompt=f"Task {g}: call the tool.",
            answer="",
            n=k,
            sampling=sampling,
        )

    def factory() -> SleepyTool:
        return SleepyTool(turns, tool_sleep_s)

    episodes = groups * n
    seq_eps = [(g, i) for g in range(groups) for i in range(n)][: sequential_episodes or episodes]
    if len(seq_eps) < 1:
        raise ValueError("sequential_episodes must be >= 1")
    model_tokens = episodes * turns * tokens_per_turn

    def check(played: Any, k: int) -> None:
        """Every episode played its `turns` turns of `tokens_per_turn` tokens and ended 'done'."""
        samples = [s for per in played.samples for s in per] if all(isinstance(p, list) for p in played.samples) else []
        bad = [p for p in played.samples if isinstance(p, str)]
        if (
            bad
            or len(samples) != k
            or any(
                s.turns != turns or s.stop_reason != "done" or sum(s.model_mask) != turns * tokens_per_turn
                for s in samples
            )
        ):
            raise RuntimeError(
                f"episodes not of the bench's shape: {bad[:1]} "
                f"{[(s.turns, s.stop_reason, sum(s.model_mask)) for s in samples][:4]}"
            )

    def concurrent(record: bool = False) -> dict[str, Any]:
        engine.reset()
        engine.record, engine.contexts = record, []
        t0 = time.perf_counter()
        played = run_groups(engine, factory, limits, codec, [group(g, n) for g in range(groups)])  # type: ignore[arg-type]
        wall = time.perf_counter() - t0
        engine.record = False
        check(played, episodes)
        assert engine.tokens == model_tokens, (engine.tokens, model_tokens)
        spans = engine.spans
        return {
            "wall_s": wall,
            "episodes_per_s": episodes / wall,
            "model_tokens_per_s": model_tokens / wall,
            "engine_busy_s": engine.busy_s,
            "engine_busy_fraction": engine.busy_s / wall,
            "engine_calls": engine.calls,
            "sequences_per_call": list(engine.batch_sizes),
            "call_s": [b - a for a, b in spans],
            # engine idle: before the first call, between calls (the tool rounds), after the last
            "idle_before_first_call_s": spans[0][0] - t0,
            "idle_between_calls_s": [b[0] - a[1] for a, b in zip(spans, spans[1:], strict=False)],
            "idle_after_last_call_s": t0 + wall - spans[-1][1],
        }

    def sequential() -> dict[str, Any]:
        engine.reset()
        t0 = time.perf_counter()
        for g, i in seq_eps:
            check(run_groups(engine, factory, limits, codec, [group(g, 1, episode=i)]), 1)  # type: ignore[arg-type]
        wall = time.perf_counter() - t0
        tokens = len(seq_eps) * turns * tokens_per_turn
        assert engine.tokens == tokens, (engine.tokens, tokens)
        return {
            "wall_s": wall,
            "episodes": len(seq_eps),
            "episodes_per_s": len(seq_eps) / wall,
            "model_tokens_per_s": tokens / wall,
            "engine_busy_fraction": engine.busy_s / wall,
            "engine_calls": engine.calls,
        }

    openings: list[str | list[int]] = [group(g, n).prompt for g in range(groups) for _ in range(n)]

    def single_turn(batches: list[list[str | list[int]]]) -> dict[str, Any]:
        engine.reset()
        t0 = time.perf_counter()
        for prompts in batches:
            engine.generate(list(prompts), [sampling] * len(prompts), [1] * len(prompts))
        wall = time.perf_counter() - t0
        assert engine.tokens == model_tokens, (engine.tokens, model_tokens)
        return {
            "wall_s": wall,
            "model_tokens_per_s": model_tokens / wall,
            "engine_calls": engine.calls,
            "call_s": [b - a for a, b in engine.spans],
        }

    load_before = os.getloadavg()
    try:
        # warm-up: every path once (engine start-up, first-call allocations, the episode driver),
        # recording the contexts of a concurrent run: its turns' contexts, turn by turn (each turn
        # adds >= tokens_per_turn tokens, so sorted by length they fall into turns in order)
        run_groups(engine, factory, limits, codec, [group(0, min(n, 4))])  # type: ignore[arg-type]
        concurrent(record=True)
        ctx = sorted(engine.contexts, key=len)
        assert len(ctx) == episodes * turns, len(ctx)
        same_contexts: list[list[str | list[int]]] = [
            list(ctx[t * episodes : (t + 1) * episodes]) for t in range(turns)
        ]
        single_turn([openings] * turns)
        runs: dict[str, list[dict[str, Any]]] = {
            "concurrent": [],
            "sequential": [],
            "single_turn": [],
            "single_turn_same_contexts": [],
        }
        for _ in range(reps):
            runs["concurrent"].append(concurrent())
            runs["sequential"].append(sequential())
            runs["single_turn"].append(single_turn([openings] * turns))
            runs["single_turn_same_contexts"].append(single_turn(same_contexts))
    finally:
        engine.engine.close()

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    conc_tps, single_tps = med("concurrent", "model_tokens_per_s"), med("single_turn", "model_tokens_per_s")
    same_tps = med("single_turn_same_contexts", "model_tokens_per_s")
    conc_eps, seq_eps_s = med("concurrent", "episodes_per_s"), med("sequential", "episodes_per_s")
    busy = med("concurrent", "engine_busy_s")
    gaps = [g for r in runs["concurrent"] for g in r["idle_between_calls_s"]]
    result: dict[str, Any] = {
        "utilisation": conc_tps / single_tps,
        # the same, against single-turn requests of the contexts the episodes' turns had
        "utilisation_same_contexts": conc_tps / same_tps,
        # each run's concurrent / the single-turn run after it: on a shared machine the load moves
        # between runs, and adjacent runs share more of it
        "utilisation_per_run": [
            c["model_tokens_per_s"] / t["model_tokens_per_s"]
            for c, t in zip(runs["concurrent"], runs["single_turn"], strict=True)
        ],
        # the best a run of episodes in lockstep can do: the engine's own time for the turns, plus
        # one tool call per turn during which every episode sleeps and the engine has nothing to run
        "utilisation_bound_lockstep": (model_tokens / single_tps) / (busy + turns * tool_sleep_s),
        "episodes_per_s_concurrent": conc_eps,
        "episodes_per_s_sequential": seq_eps_s,
        "model_tokens_per_s_concurrent": conc_tps,
        "model_tokens_per_s_sequential": med("sequential", "model_tokens_per_s"),
        "model_tokens_per_s_single_turn": single_tps,
        "model_tokens_per_s_single_turn_same_contexts": same_tps,
        "speedup_vs_sequential": conc_eps / seq_eps_s,
        "engine_busy_fraction": med("concurrent", "engine_busy_fraction"),
        "engine_calls_concurrent": med("concurrent", "engine_calls"),
        "engine_busy_s_concurrent": busy,
        "engine_s_single_turn": med("single_turn", "wall_s"),
        "engine_idle_between_calls_s_median": statistics.median(gaps) if gaps else 0.0,
        "engine_idle_after_last_call_s_median": med("concurrent", "idle_after_last_call_s"),
        "tool_sleep_s": tool_sleep_s,
        "shape": {
            "groups": groups,
            "n": n,
            "episodes": episodes,
            "turns": turns,
            "tokens_per_turn": tokens_per_turn,
            "model_tokens": model_tokens,
            "sequential_episodes": len(seq_eps),
            "reps": reps,
            "model": "asyncrl.tiny_model defaults (random init, char-level, 256-token context)",
        },
        "runs": runs,
        "machine": machine(),
        # the machine may be shared: its load average (1, 5, 15 min) before and after the runs
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "episode_rate.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "episode_rate.md").write_text(markdown(result))
    return result


def markdown(r: dict[str, Any]) -> str:
    s = r["shape"]
    c = r["runs"]["concurrent"]
    seq_busy = statistics.median(x["engine_busy_fraction"] for x in r["runs"]["sequential"])
    idle = statistics.median(x["wall_s"] - x["engine_busy_s"] for x in c)

    def walls(kind: str) -> str:
        return ", ".join(f"{x['wall_s']:.2f}" for x in r["runs"][kind])

    return (
        "\n".join(
            [
                "# Multi-turn episode rate (`python -m bench episode-rate`)",
                "",
                f"{s['episodes']} episodes ({s['groups']} groups x {s['n']}) of {s['turns']} model turns x "
                f"{s['tokens_per_turn']} tokens, a tool that sleeps {r['tool_sleep_s'] * 1000:.0f} ms per call; "
                "the tiny "
                f"random-init model on the vLLM CPU engine, {r['machine']['cores']} cores. "
                f"Medians of {s['reps']} interleaved "
                f"runs (sequential: {s['sequential_episodes']} episodes per run). bench/episode_rate.py says what each "
                "figure is.",
                "",
                "| run | episodes/s | model tokens/s | engine busy | wall of each run (s) |",
                "|---|---|---|---|---|",
                f"| concurrent (`run_groups`) | {r['episodes_per_s_concurrent']:.2f} | "
                f"{r['model_tokens_per_s_concurrent']:.0f} "
                f"| {r['engine_busy_fraction']:.2f} | {walls('concurrent')} |",
                f"| sequential (one episode at a time) | {r['episodes_per_s_sequential']:.2f} | "
                f"{r['model_tokens_per_s_sequential']:.0f} | {seq_busy:.2f} | {walls('sequential')} |",
                "| single-turn, no environment (the openings as prompts) | - | "
                f"{r['model_tokens_per_s_single_turn']:.0f} | 1.00 "
                f"| {walls('single_turn')} |",
                f"| single-turn, no environment (the turns' contexts as prompts) | - | "
                f"{r['model_tokens_per_s_single_turn_same_contexts']:.0f} | 1.00 | "
                f"{walls('single_turn_same_contexts')} |",
                "",
                f"- utilisation (concurrent / single-turn model tokens/s): **{r['utilisation']:.2f}** (target >= 0.8); "
                f"against the same contexts: {r['utilisation_same_contexts']:.2f}; the lockstep bound at this shape: "
                f"{r['utilisation_bound_lockstep']:.2f}; run by run (concurrent / the single-turn run after it): "
                + ", ".join(f"{u:.2f}" for u in r["utilisation_per_run"]),
                "- where the concurrent run's time goes (medians): "
                f"wall {idle + r['engine_busy_s_concurrent']:.2f} s = engine "
                f"{r['engine_busy_s_concurrent']:.2f} s + idle {idle:.2f} s, of which {s['turns']} tool rounds x "
                f"{r['tool_sleep_s'] * 1000:.0f} ms = {s['turns'] * r['tool_sleep_s']:.2f} s of sleep "
                "(every episode in its "
                "tool at once: nothing for the engine to run) and the rest the loop's own work between calls",
                f"- speed-up over sequential: **{r['speedup_vs_sequential']:.1f}x**",
                f"- concurrent: {r['engine_calls_concurrent']:.0f} engine calls (median; sequences per call "
                f"{c[0]['sequences_per_call']} in the first run), engine busy {r['engine_busy_s_concurrent']:.2f} s vs "
                f"{r['engine_s_single_turn']:.2f} s single-turn; engine idle between calls "
                f"{r['engine_idle_between_calls_s_median'] * 1000:.0f} ms (median; the tool's "
                f"{r['tool_sleep_s'] * 1000:.0f} ms plus the loop's work on {s['episodes']} replies), "
                "after the last call "
                f"{r['engine_idle_after_last_call_s_median'] * 1000:.0f} ms",
                f"- {r['date']}, {r['machine']['cpu']}; "
                f"load average (1 min) {r['load_average']['before'][0]:.2f} before, "
                f"{r['load_average']['after'][0]:.2f} after (a shared machine: a run far off the others was disturbed)",
            ]
        )
        + "\n"
    )


if __name__ == "__main__":
    print(json.dumps(bench_episode_rate(), indent=2))
