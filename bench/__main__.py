"""`python -m bench WHICH` (also `asyncrl bench WHICH`): the benchmarks, each measured in one run on
this machine, results under results/."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import typer

app = typer.Typer(add_completion=False)


@app.command()
def main(
    which: str = typer.Argument(
        "async",
        help="async: T_gen, T_train, sync vs async; parity: learning curves; transfer: weight transfer; "
        "suite: time-to-reward vs TRL on two regimes (short completions, long scratchpad completions), "
        "co-located mode, "
        "stale drops, generator efficiency, broker overhead, scaling; own-task: a user's own task "
        "(data file, reward plug-in, stop string) beside TRL, and the collapse guard's calibration; launcher: "
        "s/step started the README's way (python -m asyncrl.launch) vs hand-pinned; steps: per-step time per role and "
        "phase at the demo's size, async / max(T_gen, T_train); admission: samples dropped for staleness with 1, 2 "
        "and 4 generators (the demo job); startup: command -> first trained step and its "
        "breakdown per service (--seeds: repetitions, --before DIR: code before); multiturn: the tools environment "
        "demonstration (warm start, RL, tool success and held-out curves, the retokenization check); episode-rate: "
        "multi-turn episodes with a 50 ms tool, concurrent vs one after another vs the single-turn engine rate "
        "(--runs); trainer-mem: peak memory per sample-token and tokens/s of a training micro-step with chunked "
        "logprobs and activation checkpointing on and off (a 35M-parameter, 32k-vocabulary Llama); "
        "capacity: unit costs "
        "of one Redis shard, the PostgreSQL ledger and the weight links, the capacity model's simulation and its "
        "figures (docs/scaling.md); fanout: seconds from a weight publish until 1, 2, 4, 8, 16 receivers all serve "
        "it, star vs relay tree, and the trainer's egress (emulated per-node uplinks); lora: LoRA vs full "
        "fine-tune on the built-in task (held-out curve, bytes per weight update, update latency); packing: one "
        "trainer step on a long-tailed batch, padded micro-batches vs sequence packing (tokens/s, padding fraction, "
        "peak memory per token); precision: bfloat16 vs float32, the trainer's loss curves and the vLLM-to-trainer "
        "mismatch KL (a 13M-parameter Llama); correctness: is/mean and mismatch_kl of sync jobs sampled with "
        "top_p 0.8, 0.95 and top_k 20 (--label before/after); redis-cluster: a job on a local Redis Cluster, and one "
        "through a "
        "primary's failover (the loss measured, and what verify finds); fleet: the standing fleet beside TRL "
        "(warm submit -> first step, cold start and its breakdown, time to reward, memory over 20 jobs); "
        "golden: the golden curve of tests/test_golden.py over --runs seeds (0: 8), --write to commit it; "
        "step-time: the trainer's step over a plain step of the same model, --runs measurements (0: 10); replay: "
        "sync, async and two-generator jobs re-run from their ledger and checkpoints, bit for bit, and a "
        "sign-flipped loss caught (results/correctness.json); tenants: several LoRA jobs at once on one fleet "
        "(makespan against one after another, the reward gap, fair shares, one job's faults beside another; "
        "--runs rounds, 0: 2); ecosystem: jobs from verl's, TRL's and verifiers' own files (data layouts and "
        "reward functions unchanged), merged into results/ecosystem.json; ecosystem-gym: three reasoning-gym "
        "datasets trained by name, held-out reward before/after (results/ecosystem.json reasoning_gym); "
        "ecosystem-agent: an agent written with the openai client trained through the job's "
        "OpenAI-compatible endpoint (sync, --steps, "
        "0: 50; results/ecosystem.json openai_endpoint); defaults-vs-trl: "
        "ours with its defaults (and with mode sync) against TRL's GRPOTrainer with its own, own task, "
        "--seeds seeds (results/ecosystem.json defaults_vs_trl); ecosystem-arch: "
        "tiny Llama, Qwen2, Qwen3, Mistral, Gemma 2/3, Qwen3-MoE and Mixtral models on vLLM's CPU build "
        "(mismatch KL, post-swap fingerprint, LoRA targets; results/ecosystem.json key architectures); "
        "ecosystem-verifiers: verifiers environments "
        "by module name, single- and multi-turn (results/ecosystem.json verifiers_envs).",
    ),
    steps: int = typer.Option(0, help="Trainer steps per run (0: the bench's default)."),
    seeds: int = typer.Option(3, help="parity, own-task, defaults-vs-trl: number of seeds."),
    out: str = typer.Option("results", help="Folder for the JSON, markdown and PNG results."),
    preset: str = typer.Option("quick", help="suite: ci, quick or full."),
    runs: int = typer.Option(
        0,
        help="steps: runs of each code, interleaved with --before (0: 2); episode-rate: "
        "runs of each measurement, interleaved (0: 3).",
    ),
    before: str = typer.Option("", help="steps, startup: another checkout whose services to measure too (before)."),
    label: str = typer.Option(
        "after", help="admission, correctness: the name of the code under test (before / after)."
    ),
    generators: str = typer.Option("1,2,4", help="admission: generator counts, comma-separated."),
    write: bool = typer.Option(False, help="golden: write the reference curve and golden_tolerance."),
    part: str = typer.Option(
        "", help="tenants: only this part (shares, kill, poison, chaos), merged into the results already there."
    ),
) -> None:
    """Benchmarks measured in one run on this machine; results under results/."""
    logging.basicConfig(level=logging.WARNING)
    from bench.claims import bench_async, bench_parity, bench_swap

    if which == "tenants":
        from bench.tenants import bench_tenants

        res = bench_tenants(out_dir=out, rounds=runs or 2, part=part)
        typer.echo(json.dumps({k: v for k, v in res.items() if k != "per_job"}, indent=2, default=str))
        return
    if which == "ecosystem":
        from bench.ecosystem import bench_ecosystem

        typer.echo(json.dumps(bench_ecosystem(out_dir=out, steps=steps), indent=2))
        return
    if which == "ecosystem-agent":
        from bench.ecosystem_agent import bench_ecosystem_agent

        typer.echo(json.dumps(bench_ecosystem_agent(steps=steps or 50, out_dir=out), indent=2, default=str))
        return
    if which == "golden":
        from bench.golden import bench_golden

        ref = bench_golden(seeds=runs or 8, write=write, out_dir=out)
        typer.echo(json.dumps({k: v for k, v in ref.items() if k != "seed_curves"}, indent=2))
        return
    if which == "defaults-vs-trl":
        from bench.own_task import run_defaults_vs_trl

        res = run_defaults_vs_trl(candidates=("defaults", "sync"), seeds=seeds, steps=steps or 150, out_dir=out)
        typer.echo(json.dumps({k: v for k, v in res.items() if k not in ("candidates", "settings")}, indent=2))
        return
    if which == "ecosystem-arch":
        from bench.ecosystem_arch import bench_ecosystem_arch

        res = bench_ecosystem_arch(out_dir=out)
        typer.echo(json.dumps(res, indent=2, default=str))
        return
    if which == "ecosystem-verifiers":
        from bench.ecosystem_verifiers import bench_ecosystem_verifiers

        typer.echo(json.dumps(bench_ecosystem_verifiers(out_dir=out, steps=steps)["verifiers_envs"], indent=2))
        return
    if which == "ecosystem-gym":
        from bench.ecosystem_gym import bench_ecosystem_gym

        typer.echo(json.dumps(bench_ecosystem_gym(steps=steps or 60, out_dir=out)["reasoning_gym"], indent=2))
        return
    if which == "step-time":
        from bench.step_time import bench_step_time

        typer.echo(json.dumps(bench_step_time(runs=runs or 10, out_dir=out), indent=2))
        return
    if which == "redis-cluster":
        from bench.redis_cluster import bench_redis_cluster

        typer.echo(json.dumps(bench_redis_cluster(out_dir=out), indent=2))
        return
    if which == "replay":
        from bench.replay import bench_replay

        res = bench_replay(out_dir=out, steps=steps or 10)
        typer.echo(json.dumps({k: v for k, v in res.items() if k.startswith("replay_bitwise")}, indent=2))
        return
    if which == "fleet":
        from bench.fleet import bench_fleet

        res = bench_fleet(out_dir=out, steps=steps or 150)
        typer.echo(
            json.dumps({k: v for k, v in res.items() if k not in ("curves", "rss_mib_per_job")}, indent=2, default=str)
        )
        return
    if which == "suite":
        from bench.suite import run_suite

        run_suite(preset, out_dir=out)
    elif which == "launcher":
        from bench.suite import launcher_vs_pinned

        wd = Path("runs/bench-launcher").resolve()
        wd.mkdir(parents=True, exist_ok=True)
        res = launcher_vs_pinned(wd, steps=steps or 80)
        (Path(out) / "launcher.json").write_text(json.dumps(res, indent=2) + "\n")
        typer.echo(json.dumps(res, indent=2))
    elif which == "capacity":
        from bench.capacity import bench_capacity
        from bench.capacity_sim import write_figures

        bench_capacity(out_dir=out)
        write_figures(results_dir=out, docs_dir="docs" if out == "results" else out)  # figures of docs/scaling.md
    elif which == "packing":
        from bench.packing import bench_packing

        typer.echo(json.dumps(bench_packing(out_dir=out), indent=2))
    elif which == "trainer-mem":
        from bench.trainer_mem import bench_trainer_mem

        typer.echo(json.dumps(bench_trainer_mem(out_dir=out), indent=2))
    elif which == "lora":
        from bench.lora import bench_lora

        bench_lora(out_dir=out, steps=steps or 30, seeds=seeds)
    elif which == "correctness":
        from bench.correctness import bench_correctness

        res = bench_correctness(label=label, steps=steps or 6, out_dir=out)
        typer.echo(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=2))
    elif which == "precision":
        from bench.precision import bench_precision

        res = bench_precision(out_dir=out)
        typer.echo(
            json.dumps({k: res[k] for k in ("fp32_mismatch_kl", "bf16_mismatch_kl", "mismatch", "engines")}, indent=2)
        )
    elif which == "startup":
        from bench.startup import bench_startup

        bench_startup(reps=seeds, compare=before or None, steady_steps=steps or 40, out_dir=out)
    elif which == "own-task":
        from bench.own_task import run_own_task

        run_own_task(out_dir=out, seeds=seeds, steps=steps or 150)
    elif which == "steps":
        from bench.steps import bench_steps

        bench_steps(out_dir=out, steps=steps or 40, runs=runs or 2, before=before or None)
    elif which == "admission":
        from bench.admission import bench_admission

        bench_admission(label, steps=steps or 60, generators=tuple(int(g) for g in generators.split(",")), out_dir=out)
    elif which == "multiturn":
        from bench.multiturn import bench_multiturn

        bench_multiturn(out_dir=out, steps=steps or 60)
    elif which == "episode-rate":
        from bench.episode_rate import bench_episode_rate

        result = bench_episode_rate(out_dir=out, reps=runs or 3)
        typer.echo(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    elif which == "fanout":
        from bench.fanout import bench_fanout

        result = bench_fanout(out_dir=out)
        typer.echo(
            json.dumps({k: v for k, v in result.items() if not isinstance(v, dict) or "star_s" not in v}, indent=2)
        )
    elif which == "async":
        bench_async(steps=steps or 20, out_dir=out)
    elif which == "parity":
        bench_parity(steps=steps or 40, seeds=tuple(range(seeds)), out_dir=out)
    elif which == "transfer":
        from bench.transfer import bench_transfer

        result = bench_transfer(out_dir=out)
        result["swap_latency_s"] = bench_swap(steps=steps or 12)
        (Path(out) / "transfer.json").write_text(json.dumps(result, indent=2) + "\n")
        with open(Path(out) / "transfer.md", "a") as f:
            f.write(
                "\nSeconds from a trainer step's publish until every generator serves it (median, max): "
                + "; ".join(
                    f"{g} generator(s): {r['median_s']:.3f}, {r['max_s']:.3f}"
                    for g, r in result["swap_latency_s"].items()
                )
                + ".\n"
            )
    else:
        raise typer.BadParameter(
            f"unknown bench '{which}'; valid: async, parity, transfer, suite, own-task, launcher, "
            "steps, admission, startup, multiturn, episode-rate, trainer-mem, capacity, fanout, "
            "lora, packing, precision, correctness, redis-cluster, fleet, golden, step-time, replay"
        )


if __name__ == "__main__":
    app()
