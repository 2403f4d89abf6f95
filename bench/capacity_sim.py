"""A discrete-event simulation (SimPy) of one job's pipeline, driven by the measured unit costs:
generators -> Redis shard -> reward -> trainer -> weight broadcast, up to 1,000 generators.

What it models, and how:
- generators: each takes a batch of `batch_samples` from the feeder (a credit pool of (k + 1)
  steps, as the feeder keeps at most k + 1 steps of prompts in flight), generates for
  batch / rate seconds (uniform jitter), stamped with the policy version it holds, then publishes;
- the Redis shard: one server (Redis runs commands on one thread) visited three times per batch,
  by the generator's publish, the reward hop and the trainer's consume/ack, each a third of the
  measured CPU per sample;
- the ledger: one server, the measured seconds per sample split over the four writes;
- reward: `reward_workers` servers of `reward_s_per_sample`;
- trainer: waits for `samples_per_step` scored samples, steps for `step_s`, returns the step's
  credits to the feeder, and the new weights reach the generators `broadcast_s` later.
Outputs: trained samples/s in steady state, Redis and ledger busy fractions, staleness.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import simpy

from bench import capacity_model as cm


@dataclass(frozen=True)
class SimConfig:
    """One simulated job; times in seconds."""

    generators: int
    gen_samples_per_s: float  # per replica
    batch_samples: int  # samples per generate call
    samples_per_step: int
    step_s: float
    redis_s_per_sample: float
    ledger_s_per_sample: float = 0.0
    reward_s_per_sample: float = 0.0
    reward_workers: int = 1
    broadcast_s: float = 0.0
    k: int = 1
    steps: int = 20
    jitter: float = 0.1  # generate time uniform in (1 +- jitter) x nominal
    seed: int = 0
    # The services' own CPU per sample (codec, validation) when they share `client_cores` cores
    # (the cross-check on this box); 0 cores: each service has its own host, not modelled.
    client_s_per_sample: float = 0.0
    client_cores: int = 0
    # Redis CPU s/s of one generator waiting for work (its wake-polls): added to the shard's
    # utilisation for the time generators wait on the feeder's in-flight bound.
    redis_idle_per_consumer: float = 0.0

    def __post_init__(self) -> None:
        if self.generators < 1 or self.batch_samples < 1 or self.samples_per_step < 1 or self.steps < 3:
            raise ValueError("generators, batch_samples, samples_per_step >= 1 and steps >= 3")
        if self.gen_samples_per_s <= 0 or self.step_s < 0 or self.redis_s_per_sample < 0 or self.k < 0:
            raise ValueError("gen_samples_per_s > 0; step_s, redis_s_per_sample, k >= 0")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")


@dataclass(frozen=True)
class SimResult:
    samples_per_s: float  # trained, steady state (after the first two steps)
    redis_utilisation: float  # steady state, serving samples
    redis_idle_utilisation: float  # steady state, the waiting generators' polls
    ledger_utilisation: float
    staleness_mean: float
    staleness_max: int
    trainer_busy: float  # fraction of the steady-state time the trainer was stepping
    sim_s: float


class _Busy:
    """A one-at-a-time server that counts its busy time."""

    def __init__(self, env: simpy.Environment, capacity: int = 1):
        self.env, self.res, self.busy = env, simpy.Resource(env, capacity=capacity), 0.0

    def serve(self, seconds: float):  # a SimPy process step: `yield from server.serve(t)`
        if seconds <= 0:
            return
        with self.res.request() as req:
            yield req
            yield self.env.timeout(seconds)
            self.busy += seconds


def simulate(c: SimConfig) -> SimResult:
    env = simpy.Environment()
    rng = random.Random(c.seed)
    redis, ledger = _Busy(env), _Busy(env)
    reward = _Busy(env, capacity=c.reward_workers)
    host = _Busy(env, capacity=max(1, c.client_cores))
    h3 = c.client_s_per_sample / 3 if c.client_cores else 0.0
    credits = simpy.Container(env, init=(c.k + 1) * c.samples_per_step, capacity=10**12)
    rollouts: simpy.Store = simpy.Store(env)
    scored: simpy.Store = simpy.Store(env)
    state = {"trainer_version": 0, "gen_version": 0}
    r3, l4 = c.redis_s_per_sample / 3, c.ledger_s_per_sample / 4
    done = env.event()

    waiting = [0.0]  # generator-seconds spent waiting for work

    def generator():
        while True:
            t = env.now
            yield credits.get(c.batch_samples)
            waiting[0] += env.now - t
            version = state["gen_version"]
            nominal = c.batch_samples / c.gen_samples_per_s
            yield env.timeout(nominal * rng.uniform(1 - c.jitter, 1 + c.jitter))
            yield from host.serve(c.batch_samples * h3)
            yield from redis.serve(c.batch_samples * r3)  # publish_if_owned of the rollouts
            yield from ledger.serve(c.batch_samples * l4)  # insert the rows
            yield rollouts.put((c.batch_samples, version))

    def reward_worker():
        while True:
            n, version = yield rollouts.get()
            yield from ledger.serve(n * 2 * l4)  # the idempotent insert, then scored
            yield from reward.serve(n * c.reward_s_per_sample)
            yield from host.serve(n * h3)
            yield from redis.serve(n * r3)  # publish_if_owned of the scored copies
            yield scored.put((n, version))

    stale: list[tuple[int, int]] = []  # (staleness, samples)
    step_ends: list[float] = []
    stepping = [0.0]
    marks: list[tuple[float, float, float, float]] = []  # per step end: redis, ledger busy, waiting, stepping

    def trainer():
        held: list[list[int]] = []
        have = 0
        while len(step_ends) < c.steps:
            while have < c.samples_per_step:
                n, version = yield scored.get()
                held.append([n, version])
                have += n
            # take exactly one step's samples, oldest first (a batch may be split across steps)
            take, batch = c.samples_per_step, []
            while take:
                n, version = held[0]
                t = min(n, take)
                batch.append((t, version))
                take -= t
                held[0][0] -= t
                if held[0][0] == 0:
                    held.pop(0)
            have -= c.samples_per_step
            yield from host.serve(c.samples_per_step * h3)
            yield from redis.serve(c.samples_per_step * r3)  # consume + ack
            yield env.timeout(c.step_s)
            stepping[0] += c.step_s
            stale.extend((state["trainer_version"] - v, t) for t, v in batch)
            yield from ledger.serve(c.samples_per_step * l4)  # trained
            state["trainer_version"] += 1
            step_ends.append(env.now)
            marks.append((redis.busy, ledger.busy, waiting[0], stepping[0]))
            yield credits.put(c.samples_per_step)
            env.process(broadcast(state["trainer_version"]))
        done.succeed()

    def broadcast(version: int):
        yield env.timeout(c.broadcast_s)
        state["gen_version"] = max(state["gen_version"], version)

    for _ in range(c.generators):
        env.process(generator())
    for _ in range(max(1, c.reward_workers)):
        env.process(reward_worker())
    env.process(trainer())
    env.run(until=done)
    # steady state: from the end of step 2 to the last step (busy time counted when a service ends)
    t0, t1 = step_ends[1], step_ends[-1]
    span = t1 - t0
    (r0, l0, w0, s0), (r1, l1, w1, s1) = marks[1], marks[-1]
    n_stale = sum(n for _, n in stale)
    return SimResult(
        samples_per_s=(len(step_ends) - 2) * c.samples_per_step / span if span > 0 else math.inf,
        redis_utilisation=(r1 - r0) / span if span > 0 else 0.0,
        redis_idle_utilisation=(w1 - w0) * c.redis_idle_per_consumer / span if span > 0 else 0.0,
        ledger_utilisation=(l1 - l0) / span if span > 0 else 0.0,
        staleness_mean=sum(s * n for s, n in stale) / n_stale,
        staleness_max=max(s for s, _ in stale),
        trainer_busy=(s1 - s0) / span if span > 0 else 1.0,
        sim_s=env.now,
    )


# -- the figures of docs/scaling.md ---------------------------------------------------------------
# Assumptions (not measured here): public-order-of-magnitude GPU figures, stated in docs/scaling.md.
MODELS = {
    "8B": (cm.ModelSize("8B", 8e9), cm.Generator(tokens_per_s=8000, gpus=1)),
    "70B": (cm.ModelSize("70B", 70e9), cm.Generator(tokens_per_s=2500, gpus=4)),
}
# A 400 Gb/s-class link between hosts (the links measured here are loopback on a 2-core VM).
ASSUMED_LINK_BYTES_PER_S = 50e9
GEN_BATCH_SAMPLES = 256  # sequences one replica decodes together (its tokens/s assume that batch)
COMPLETION_TOKENS = (256, 1024, 4096)
GENERATOR_COUNTS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def unit_costs(results: dict[str, Any], *, postgres_cores: int = 2) -> cm.UnitCosts:
    """The model's unit costs from results/capacity.json: Redis CPU per sample (fit over message
    bytes) and per waiting consumer (fit over consumers), the ledger's server CPU per sample (fit
    over completion tokens) spread over `postgres_cores` (the measured box has 2), the TCP link."""
    fit = results["redis"]["fit"]
    # idle cost per waiting consumer: the slope of the idle CPU over consumers (generators + 2)
    pts = results["redis"]["points"] + results["crosscheck"]["points"]
    idle = float(np.polyfit([p["generators"] + 2 for p in pts], [p["redis_idle_cpu_per_s"] for p in pts], 1)[0])
    writes = results["ledger"]["writes"]
    per_token, base = np.polyfit([w["tokens"] for w in writes], [w["server_cpu_s_per_sample"] for w in writes], 1)
    return cm.UnitCosts(
        redis_cpu_s_per_sample_base=fit["base_s"],
        redis_cpu_s_per_sample_per_byte=fit["per_byte_s"],
        ledger_s_per_sample=max(float(base), 0.0) / postgres_cores,
        ledger_s_per_completion_token=max(float(per_token), 0.0) / postgres_cores,
        link_bytes_per_s=results["links"]["tcp_bytes_per_s"],
        redis_idle_cpu_per_consumer=max(idle, 0.0),
    )


def answers(costs: cm.UnitCosts, *, target: float = 0.7) -> list[dict[str, Any]]:
    """Per model size and completion length: generators one Redis shard and one PostgreSQL (2 and
    16 cores) serve at `target` busy, the generators a 64-rank trainer needs, and how many waiting
    generators the shard's idle polling alone allows."""
    rows = []
    trainer = cm.Trainer()
    for model, (m, g) in MODELS.items():
        for tokens in COMPLETION_TOKENS:
            w = cm.Workload(completion_tokens=tokens)
            big_pg = replace(
                costs,
                ledger_s_per_sample=costs.ledger_s_per_sample * 2 / 16,
                ledger_s_per_completion_token=costs.ledger_s_per_completion_token * 2 / 16,
            )
            rows.append(
                {
                    "model": model,
                    "completion_tokens": tokens,
                    "gen_samples_per_s": g.samples_per_s(w),
                    "redis_s_per_sample": costs.redis_cpu_s_per_sample(w),
                    "redis_bytes_per_sample": cm.redis_bytes_per_sample(w),
                    "per_redis_shard": cm.max_generators_per_redis(w, costs, g, target=target),
                    "per_redis_shard_25gbit": cm.max_generators_per_redis(
                        w, costs, g, target=target, nic_bytes_per_s=25e9 / 8
                    ),
                    "per_postgres_2_cores": cm.max_generators_per_ledger(w, costs, g, target=target),
                    "per_postgres_16_cores": cm.max_generators_per_ledger(w, big_pg, g, target=target),
                    "waiting_generators_per_shard": math.floor(target / costs.redis_idle_cpu_per_consumer)
                    if costs.redis_idle_cpu_per_consumer
                    else None,
                    "trainer_step_s": trainer.step_s(m, w),
                    "generators_for_64_ranks": cm.generators_to_feed_trainer(m, w, g, trainer),
                }
            )
    return rows


def sweep(
    costs: cm.UnitCosts,
    model: str,
    *,
    completion_tokens: int = 1024,
    trainer: cm.Trainer | None = None,
    counts: tuple[int, ...] = GENERATOR_COUNTS,
    steps: int = 12,
) -> list[dict[str, Any]]:
    """Simulated throughput, utilisations and staleness vs generator count for one model size.
    trainer None: a trainer that is never the bottleneck (step 1 ms), to find the shard's limit.
    A step holds one batch of every generator, so the feeder's (k + 1) steps in flight give each
    generator work while the previous batch is trained; completion lengths vary (jitter 0.3)."""
    m, g = MODELS[model]
    out = []
    for n in counts:
        w = cm.Workload(completion_tokens=completion_tokens, samples_per_step=max(1024, n * GEN_BATCH_SAMPLES))
        step_s = trainer.step_s(m, w) if trainer else 0.001
        cfg = SimConfig(
            generators=n,
            gen_samples_per_s=g.samples_per_s(w),
            batch_samples=GEN_BATCH_SAMPLES,
            samples_per_step=w.samples_per_step,
            step_s=step_s,
            redis_s_per_sample=costs.redis_cpu_s_per_sample(w),
            ledger_s_per_sample=costs.ledger_s(w),
            reward_workers=max(1, n // 16),
            broadcast_s=cm.broadcast_s(m, n, ASSUMED_LINK_BYTES_PER_S, fanout=4),
            steps=steps,
            jitter=0.3,
            redis_idle_per_consumer=costs.redis_idle_cpu_per_consumer,
        )
        r = simulate(cfg)
        out.append(
            {
                "generators": n,
                **asdict(r),
                "offered_samples_per_s": n * g.samples_per_s(w),
                "step_s": step_s,
                "samples_per_step": w.samples_per_step,
            }
        )
    return out


def crosscheck(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The paced runs of bench/capacity.py simulated with their own measured Redis cost: once
    with each service on its own host (the deployment's case), once with the services' measured
    CPU per sample sharing this box's cores (the runs' case; other jobs on the box not modelled)."""
    rows = []
    for p in results["crosscheck"]["points"]:
        cfg = SimConfig(
            generators=p["generators"],
            gen_samples_per_s=p["gen_tps"] / p["tokens"],
            batch_samples=results["crosscheck"]["batch_groups"] * results["crosscheck"]["group_size"],
            samples_per_step=p["samples_per_step"],
            step_s=p["step_s"],
            redis_s_per_sample=p["redis_cpu_s_per_sample"],
            k=p["k"],
            steps=max(3, p["samples"] // p["samples_per_step"]),
        )
        sims = [simulate(replace(cfg, seed=s)) for s in range(3)]
        box = [
            simulate(
                replace(
                    cfg,
                    seed=s,
                    client_s_per_sample=p["client_cpu_s_per_sample"],
                    client_cores=results["machine"]["cores"],
                )
            )
            for s in range(3)
        ]
        rows.append(
            {
                "generators": p["generators"],
                "measured_samples_per_s": p["samples_per_s"],
                "simulated_samples_per_s": sum(s.samples_per_s for s in sims) / 3,
                "simulated_on_this_box_samples_per_s": sum(s.samples_per_s for s in box) / 3,
                "measured_client_cpu_per_s": p["client_cpu_per_s"],
                "measured_staleness": p["staleness_mean"],
                "simulated_staleness": sum(s.staleness_mean for s in sims) / 3,
                "measured_redis_utilisation": p["redis_utilisation"],
                "simulated_redis_utilisation": sum(s.redis_utilisation for s in sims) / 3,
                # the waiting consumers' polls, measured in the same run before the samples
                "measured_idle_utilisation": p["redis_idle_cpu_per_s"],
            }
        )
    return rows


def write_figures(results_dir: str = "results", docs_dir: str = "docs") -> dict[str, Any]:
    """Run the sweeps and the cross-check on results/capacity.json; write results/capacity_sim.json
    and docs/scaling_*.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads((Path(results_dir) / "capacity.json").read_text())
    costs = unit_costs(res)
    trainer = cm.Trainer()
    out: dict[str, Any] = {
        "costs": asdict(costs),
        "trainer": asdict(trainer),
        "crosscheck": crosscheck(res),
        "answers": answers(costs),
        "sweeps": {},
    }
    for model in MODELS:
        out["sweeps"][model] = {
            "trainer_64": sweep(costs, model, trainer=trainer),
            "trainer_unbounded": sweep(costs, model),
        }

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for model, style in (("8B", "-"), ("70B", "--")):
        for kind, colour in (("trainer_64", "tab:blue"), ("trainer_unbounded", "tab:red")):
            pts = out["sweeps"][model][kind]
            x = [p["generators"] for p in pts]
            label = f"{model}, {'64 trainer ranks' if kind == 'trainer_64' else 'trainer never the bottleneck'}"
            ax[0].plot(x, [p["samples_per_s"] for p in pts], style, color=colour, marker="o", ms=3, label=label)
            ax[1].plot(
                x,
                [p["redis_utilisation"] + p["redis_idle_utilisation"] for p in pts],
                style,
                color=colour,
                marker="o",
                ms=3,
                label=f"Redis, {label}",
            )
            ax[1].plot(
                x,
                [p["ledger_utilisation"] for p in pts],
                style,
                color=colour,
                marker="x",
                ms=4,
                alpha=0.5,
                label=f"ledger, {label}",
            )
            ax[2].plot(x, [p["staleness_mean"] for p in pts], style, color=colour, marker="o", ms=3, label=label)
    ax[0].set(
        xscale="log",
        yscale="log",
        xlabel="generator replicas",
        ylabel="trained samples/s",
        title="throughput (1024-token completions)",
    )
    ax[1].set(
        xscale="log",
        xlabel="generator replicas",
        ylabel="busy fraction",
        ylim=(0, 1.5),
        title="Redis (o: samples + waiting generators' polls), ledger (x)",
    )
    ax[1].axhline(0.7, color="grey", lw=0.8, ls=":")
    ax[2].set(xscale="log", xlabel="generator replicas", ylabel="mean staleness (steps)", title="staleness (k = 1)")
    for a in ax:
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=7)
    ax[1].legend(fontsize=6)
    fig.tight_layout()
    Path(docs_dir).mkdir(parents=True, exist_ok=True)
    fig.savefig(Path(docs_dir) / "scaling_sim.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    gs = list(range(1, 1001))
    out["broadcast"] = {}
    for ax, link, where in (
        (axes[0], costs.link_bytes_per_s, "measured here (TCP, loopback)"),
        (axes[1], ASSUMED_LINK_BYTES_PER_S, "assumed (400 Gb/s class)"),
    ):
        for model, style in (("8B", "-"), ("70B", "--")):
            m = MODELS[model][0]
            for fan, colour in ((None, "tab:red"), (2, "tab:green"), (4, "tab:blue"), (8, "tab:purple")):
                ys = [cm.broadcast_s(m, n, link, fanout=fan) for n in gs]
                name = "star" if fan is None else f"tree, fan-out {fan}"
                ax.plot(gs, ys, style, color=colour, label=f"{model}, {name}")
                out["broadcast"][f"{link / 1e9:.1f} GB/s, {model}, {name}"] = {
                    str(n): ys[n - 1] for n in (1, 10, 100, 1000)
                }
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="generator replicas",
            ylabel="seconds until all hold the weights",
            title=f"weight broadcast, {link / 1e9:.1f} GB/s per link, {where}",
        )
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(docs_dir) / "scaling_broadcast.png", dpi=110)
    plt.close(fig)
    (Path(results_dir) / "capacity_sim.json").write_text(json.dumps(out, indent=2) + "\n")
    return out
