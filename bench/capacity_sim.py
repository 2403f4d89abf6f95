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
    redis_utilisation: float
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

    def generator():
        while True:
            yield credits.get(c.batch_samples)
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
    # steady state: from the end of step 2 to the last step; busy fractions over the whole run
    # (the servers' queues start empty, so this slightly understates them at saturation)
    t0, t1 = step_ends[1], step_ends[-1]
    span = t1 - t0
    n_stale = sum(n for _, n in stale)
    return SimResult(
        samples_per_s=(len(step_ends) - 2) * c.samples_per_step / span if span > 0 else math.inf,
        redis_utilisation=redis.busy / env.now,
        ledger_utilisation=ledger.busy / env.now,
        staleness_mean=sum(s * n for s, n in stale) / n_stale,
        staleness_max=max(s for s, _ in stale),
        trainer_busy=stepping[0] / env.now,
        sim_s=env.now,
    )


# -- the figures of docs/scaling.md ---------------------------------------------------------------
# Assumptions (not measured here): public-order-of-magnitude GPU figures, stated in docs/scaling.md.
MODELS = {
    "8B": (cm.ModelSize("8B", 8e9), cm.Generator(tokens_per_s=8000, gpus=1)),
    "70B": (cm.ModelSize("70B", 70e9), cm.Generator(tokens_per_s=2500, gpus=4)),
}
GEN_BATCH_SAMPLES = 256  # sequences one replica decodes together (its tokens/s assume that batch)
COMPLETION_TOKENS = (256, 1024, 4096)
GENERATOR_COUNTS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def unit_costs(results: dict[str, Any], *, postgres_cores: int = 2) -> cm.UnitCosts:
    """The model's unit costs from results/capacity.json: Redis CPU per sample (fit), the ledger's
    server CPU per sample spread over `postgres_cores` (the measured box has 2), the TCP link."""
    fit = results["redis"]["fit"]
    ledger_cpu = max(w["server_cpu_s_per_sample"] for w in results["ledger"]["writes"])
    return cm.UnitCosts(redis_cpu_s_per_sample_base=fit["base_s"], redis_cpu_s_per_sample_per_byte=fit["per_byte_s"],
                        ledger_s_per_sample=ledger_cpu / postgres_cores,
                        link_bytes_per_s=results["links"]["tcp_bytes_per_s"])


def sweep(costs: cm.UnitCosts, model: str, *, completion_tokens: int = 1024, trainer: cm.Trainer | None = None,
          counts: tuple[int, ...] = GENERATOR_COUNTS, steps: int = 12) -> list[dict[str, Any]]:
    """Simulated throughput, utilisations and staleness vs generator count for one model size.
    trainer None: a trainer that is never the bottleneck (step 1 ms), to find the shard's limit.
    Each step holds (k + 1) steps' worth of every generator's batch, so that all can be busy."""
    m, g = MODELS[model]
    out = []
    for n in counts:
        w = cm.Workload(completion_tokens=completion_tokens, samples_per_step=max(1024, n * GEN_BATCH_SAMPLES // 2))
        step_s = trainer.step_s(m, w) if trainer else 0.001
        cfg = SimConfig(generators=n, gen_samples_per_s=g.samples_per_s(w), batch_samples=GEN_BATCH_SAMPLES,
                        samples_per_step=w.samples_per_step, step_s=step_s,
                        redis_s_per_sample=costs.redis_cpu_s_per_sample(w), ledger_s_per_sample=costs.ledger_s_per_sample,
                        broadcast_s=cm.broadcast_s(m, n, costs.link_bytes_per_s, fanout=4), steps=steps)
        r = simulate(cfg)
        out.append({"generators": n, **asdict(r), "offered_samples_per_s": n * g.samples_per_s(w),
                    "step_s": step_s, "samples_per_step": w.samples_per_step})
    return out


def crosscheck(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The paced runs of bench/capacity.py simulated with their own measured Redis cost: once
    with each service on its own host (the deployment's case), once with the services' measured
    CPU per sample sharing this box's cores (the runs' case; other jobs on the box not modelled)."""
    rows = []
    for p in results["crosscheck"]["points"]:
        cfg = SimConfig(generators=p["generators"], gen_samples_per_s=p["gen_tps"] / p["tokens"],
                        batch_samples=results["crosscheck"]["batch_groups"] * results["crosscheck"]["group_size"],
                        samples_per_step=p["samples_per_step"], step_s=p["step_s"],
                        redis_s_per_sample=p["redis_cpu_s_per_sample"], k=p["k"],
                        steps=max(3, p["samples"] // p["samples_per_step"]))
        sims = [simulate(replace(cfg, seed=s)) for s in range(3)]
        box = [simulate(replace(cfg, seed=s, client_s_per_sample=p["client_cpu_s_per_sample"],
                                client_cores=results["machine"]["cores"])) for s in range(3)]
        rows.append({"generators": p["generators"], "measured_samples_per_s": p["samples_per_s"],
                     "simulated_samples_per_s": sum(s.samples_per_s for s in sims) / 3,
                     "simulated_on_this_box_samples_per_s": sum(s.samples_per_s for s in box) / 3,
                     "measured_client_cpu_per_s": p["client_cpu_per_s"],
                     "measured_staleness": p["staleness_mean"],
                     "simulated_staleness": sum(s.staleness_mean for s in sims) / 3,
                     "measured_redis_utilisation": p["redis_utilisation"],
                     "simulated_redis_utilisation": sum(s.redis_utilisation for s in sims) / 3})
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
    out: dict[str, Any] = {"costs": asdict(costs), "trainer": asdict(trainer), "crosscheck": crosscheck(res),
                           "sweeps": {}}
    for model in MODELS:
        out["sweeps"][model] = {"trainer_64": sweep(costs, model, trainer=trainer),
                                "trainer_unbounded": sweep(costs, model)}

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for model, style in (("8B", "-"), ("70B", "--")):
        for kind, colour in (("trainer_64", "tab:blue"), ("trainer_unbounded", "tab:red")):
            pts = out["sweeps"][model][kind]
            x = [p["generators"] for p in pts]
            label = f"{model}, {'64 trainer ranks' if kind == 'trainer_64' else 'trainer never the bottleneck'}"
            ax[0].plot(x, [p["samples_per_s"] for p in pts], style, color=colour, marker="o", ms=3, label=label)
            ax[1].plot(x, [p["redis_utilisation"] for p in pts], style, color=colour, marker="o", ms=3,
                       label=f"Redis, {label}")
            ax[1].plot(x, [p["ledger_utilisation"] for p in pts], style, color=colour, marker="x", ms=4, alpha=0.5,
                       label=f"ledger, {label}")
            ax[2].plot(x, [p["staleness_mean"] for p in pts], style, color=colour, marker="o", ms=3, label=label)
    ax[0].set(xscale="log", yscale="log", xlabel="generator replicas", ylabel="trained samples/s",
              title="throughput (1024-token completions)")
    ax[1].set(xscale="log", xlabel="generator replicas", ylabel="busy fraction", ylim=(0, 1.05),
              title="one Redis shard / one PostgreSQL (2 cores)")
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

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    gs = list(range(1, 1001))
    out["broadcast"] = {}
    for model, style in (("8B", "-"), ("70B", "--")):
        m = MODELS[model][0]
        for fan, colour in ((None, "tab:red"), (2, "tab:green"), (4, "tab:blue")):
            ys = [cm.broadcast_s(m, n, costs.link_bytes_per_s, fanout=fan) for n in gs]
            name = "star" if fan is None else f"tree, fan-out {fan}"
            ax.plot(gs, ys, style, color=colour, label=f"{model}, {name}")
            out["broadcast"][f"{model} {name}"] = {str(n): ys[n - 1] for n in (1, 10, 100, 1000)}
    ax.set(xscale="log", yscale="log", xlabel="generator replicas", ylabel="seconds until all hold the weights",
           title=f"weight broadcast at {costs.link_bytes_per_s / 1e9:.1f} GB/s per link")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(docs_dir) / "scaling_broadcast.png", dpi=110)
    plt.close(fig)
    (Path(results_dir) / "capacity_sim.json").write_text(json.dumps(out, indent=2) + "\n")
    return out
