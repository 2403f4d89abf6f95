"""Several jobs at once on one fleet (ARCHITECTURE.md, "Several jobs on one fleet").

    python -m bench tenants        # results/tenants.json and results/tenants.md

One fleet started the user's way (`python -m asyncrl.launch --trainers 4`: one generator, one
reward service, four trainers) on the demo's warm-started model, every job a LoRA job (rank 8, lr
1e-3, the demo task, async) over that one base, so they share the one engine, each its adapter:

- makespan: 4 jobs (seeds 0-3) one after another, then the same 4 at once; the ratio of the two
  wall times (`concurrent_lora_makespan_ratio`), with the machine's CPU use in each phase; and
  the same where the engine is the bottleneck (64-token completions: `..._engine_bound`);
- reward gap: each job's final held-out reward at once minus the same job alone (the sequential
  run), mean over the 4 jobs and over `rounds` rounds (seeds 0-3, 4-7, ...); the noise it is
  compared with is the spread of the same differences (their standard error), since two runs of
  one seed differ by sampling alone (`sampling.seeded` is off, as a user runs);
- shares: 3 busy jobs with shares 1:2:4 and long completions (the engine is the bottleneck); the
  generator's tokens per job over the window all three run (its beacon's `load`, GET /fleet),
  against the shares (`share_error`: the largest relative gap of a job's token fraction);
- faults, two jobs at once: one job's trainer SIGKILLed (the launcher restarts it: the job
  resumes) while the other's steps are timed (the longest gap between its steps around the
  kill); a poison rollout and a reward that hangs on every sample in one job, the other's
  step rate (started once the poisoned job's start-up is over) against the same job alone
  (the mean of a run before and one after); a chaos run (the generator, the reward service and one
  trainer SIGKILLed in turn); `verify` per job after each.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from asyncrl.demo import prepare_model
from bench.fleet import WarmFleet
from bench.golden import held_out_curve
from broker.redis_server import resolve_redis_url
from broker.streams import FIELD, ROLLOUTS, JobStreams, connect
from broker.verify import verify

LORA = {"rank": 8, "alpha": 16.0}
STEPS = 15


def lora_spec(model: Path, name: str, seed: int, steps: int = STEPS, **extra: Any) -> dict[str, Any]:
    """The demo job as a LoRA job (bench/lora.py's lr), async, held-out at its first and last step."""
    return {
        "name": name,
        "model_path": str(model),
        "mode": "async",
        "steps": steps,
        "seed": seed,
        "eval_every": steps,
        "algorithm": {"lr": 1e-3},
        "sampling": {"temperature": 1.0, "max_tokens": 8},
        "lora": LORA,
        **extra,
    }


def final_reward(fleet: WarmFleet, job_id: str) -> float:
    curve = held_out_curve(fleet.ledger, job_id)
    return curve[max(curve)]


def checked(fleet: WarmFleet, job_id: str) -> dict[str, Any]:
    """verify of one job: ok, lost, trained twice, steps."""
    res = verify(fleet.ledger, job_id)
    return {
        "ok": res.ok,
        "state": res.job_state,
        "lost": res.lost,
        "trained_twice": res.checks.get("trained_once", 0),
        "steps": res.steps,
        "violations": [str(v) for v in res.violations][:5],
    }


def run_all(fleet: WarmFleet, specs: list[dict[str, Any]], timeout: float = 900) -> tuple[list[str], float]:
    """Submit every spec at once; their ids and the wall time until the last ended."""
    t0 = time.monotonic()
    ids = [fleet.submit(s)[0] for s in specs]
    for j in ids:
        job = fleet.wait(j, timeout=timeout)
        if job["state"] != "finished":
            raise RuntimeError(f"job {j} ended {job['state']}: {job.get('error')}")
    return ids, time.monotonic() - t0


def run_each(fleet: WarmFleet, specs: list[dict[str, Any]]) -> tuple[list[str], float]:
    """One spec after another (each submitted when the last ended); ids and the total wall time."""
    t0, ids = time.monotonic(), []
    for s in specs:
        ids += run_all(fleet, [s])[0]
    return ids, time.monotonic() - t0


def step_times(fleet: WarmFleet, job_id: str) -> list[float]:
    return [float(s["created_at"].timestamp()) for s in fleet.ledger.train_steps(job_id)]


def step_rate(times: list[float], skip: int = 2) -> float:
    """Steps per second over the job's steps after the first `skip` (the start-up's)."""
    t = times[skip:]
    return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else 0.0


def service_pid(fleet: WarmFleet, role: str, job_id: str | None = None) -> int:
    """The pid of the live service of `role` (serving `job_id`, when given), from GET /fleet."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for s in httpx.get(f"{fleet.api}/fleet", timeout=5).json()["services"]:
            if s["role"] == role and (job_id is None or s.get("job") == job_id):
                return int(s["pid"])
        time.sleep(0.2)
    raise RuntimeError(f"no {role} serving {job_id} in GET /fleet")


def wait_step(fleet: WarmFleet, job_id: str, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(fleet.ledger.train_steps(job_id)) < step:
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job_id} did not reach step {step}")
        time.sleep(0.1)


def generator_load(fleet: WarmFleet) -> dict[str, dict[str, float]]:
    """What each job used of the fleet's generator so far (its beacon's load: tokens, engine seconds)."""
    for s in httpx.get(f"{fleet.api}/fleet", timeout=5).json()["services"]:
        if s["role"] == "generator":
            return dict(s.get("load") or {})
    return {}


def share_error(tokens: dict[str, int], shares: dict[str, float]) -> tuple[float, dict[str, float]]:
    """The largest relative gap between a job's fraction of the tokens and its fraction of the
    shares, and each job's token fraction."""
    total_t, total_s = sum(tokens.values()), sum(shares.values())
    frac = {j: tokens[j] / total_t for j in shares}
    return max(abs(frac[j] - shares[j] / total_s) / (shares[j] / total_s) for j in shares), frac


def cpu_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, over every core."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.system + t.nice + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0), sum(t)


def busy_fraction(before: tuple[float, float], after: tuple[float, float]) -> float:
    """The machine's CPU use between two `cpu_busy` readings, as a fraction of all its cores."""
    return (after[0] - before[0]) / max(after[1] - before[1], 1e-9)


def bench_makespan(fleet: WarmFleet, model: Path, rounds: int) -> dict[str, Any]:
    ratios, gaps, rows = [], [], []
    busy: dict[str, list[float]] = {"sequential": [], "concurrent": []}
    walls: dict[str, list[float]] = {"sequential": [], "concurrent": []}
    for r in range(rounds):
        specs = [lora_spec(model, f"tenant-{r}-{i}", seed=4 * r + i) for i in range(4)]
        c0 = cpu_busy()
        seq_ids, seq_s = run_each(fleet, specs)
        busy["sequential"].append(busy_fraction(c0, cpu_busy()))
        fleet.idle()
        c0 = cpu_busy()
        conc_ids, conc_s = run_all(fleet, specs)
        busy["concurrent"].append(busy_fraction(c0, cpu_busy()))
        fleet.idle()
        ratios.append(seq_s / conc_s)
        walls["sequential"].append(seq_s)
        walls["concurrent"].append(conc_s)
        for spec, a, b in zip(specs, seq_ids, conc_ids, strict=True):
            alone, together = final_reward(fleet, a), final_reward(fleet, b)
            gaps.append(together - alone)
            rows.append({"seed": spec["seed"], "alone": alone, "together": together, "alone_job": a, "job": b})
        print(
            f"round {r}: sequential {seq_s:.1f} s (CPU {busy['sequential'][-1]:.0%} busy), concurrent {conc_s:.1f} s "
            f"(CPU {busy['concurrent'][-1]:.0%}), ratio {seq_s / conc_s:.2f}"
        )
    mean_gap = statistics.mean(gaps)
    se = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else float("nan")
    return {
        "concurrent_lora_makespan_ratio": statistics.mean(ratios),
        "makespan_ratios": ratios,
        "makespan_seconds": walls,
        "cpu_busy_fraction": busy,
        "concurrent_lora_reward_gap": mean_gap,
        "reward_gap_noise_se": se,
        "reward_gap_within_noise": abs(mean_gap) <= 2 * se,
        "per_job": rows,
    }


def long_spec(model: Path, name: str, seed: int, steps: int, **extra: Any) -> dict[str, Any]:
    """A LoRA job whose completions are 64 tokens long (the demo's end after ~3): the engine, not
    the trainers, is what it waits for. The guard is off: vLLM masks the stop tokens under
    min_tokens before its logprobs and the trainer does not (a known bias), so the importance
    weights it would trip on are not what these runs measure (engine time)."""
    return lora_spec(
        model,
        name,
        seed=seed,
        steps=steps,
        sampling={"temperature": 1.0, "max_tokens": 64, "min_tokens": 64},
        guard={"enabled": False},
        eval_every=0,
        **extra,
    )


def bench_makespan_long(fleet: WarmFleet, model: Path) -> dict[str, Any]:
    """The makespan ratio where the engine is the bottleneck (64-token completions, 8 steps)."""
    specs = [long_spec(model, f"long-{i}", seed=60 + i, steps=8) for i in range(4)]
    c0 = cpu_busy()
    seq_ids, seq_s = run_each(fleet, specs)
    seq_busy = busy_fraction(c0, cpu_busy())
    fleet.idle()
    c0 = cpu_busy()
    conc_ids, conc_s = run_all(fleet, specs)
    conc_busy = busy_fraction(c0, cpu_busy())
    fleet.idle()
    rate = {k: engine_rate(fleet, ids) for k, ids in (("sequential", seq_ids), ("concurrent", conc_ids))}
    print(
        f"engine-bound: sequential {seq_s:.1f} s, concurrent {conc_s:.1f} s, ratio {seq_s / conc_s:.2f}; "
        f"engine tokens/s one job per call {rate['sequential']:.0f}, merged {rate['concurrent']:.0f}"
    )
    return {
        "concurrent_lora_makespan_ratio_engine_bound": seq_s / conc_s,
        "makespan_seconds_engine_bound": {"sequential": seq_s, "concurrent": conc_s},
        "cpu_busy_fraction_engine_bound": {"sequential": seq_busy, "concurrent": conc_busy},
        "engine_tokens_per_s_engine_bound": rate,
    }


def engine_rate(fleet: WarmFleet, ids: list[str]) -> float:
    """Completion tokens per engine-second over the jobs' samples (the ledger's usage of each)."""
    usage = [httpx.get(f"{fleet.api}/jobs/{j}", timeout=30).json()["usage"] for j in ids]
    seconds = sum(u["generator_seconds"] for u in usage)
    return sum(u["completion_tokens"] for u in usage) / seconds if seconds else float("nan")


def swap_seconds(fleet: WarmFleet, job_id: str) -> float:
    """Median seconds of the job's weight swaps in the generator (its log's `loaded policy ...
    total`: fetch, checksums, load, probe excluded): what one turn of a job on an engine costs."""
    import re

    text = "".join(f.read_text(errors="replace") for f in (fleet.run / "logs").glob("generator*.log"))
    found = [float(m) for m in re.findall(rf"job_id={job_id} .*loaded policy v\d+ .* total ([0-9.]+)s", text)]
    return statistics.median(found) if found else float("nan")


def bench_turns(fleet: WarmFleet, model: Path, lora_job: str) -> dict[str, Any]:
    """The cost of a turn: a full-weight job's swap (its whole model) against a LoRA job's (its adapter)."""
    full = {k: v for k, v in lora_spec(model, "full-weights", seed=50, steps=6).items() if k != "lora"}
    job = run_all(fleet, [{**full, "algorithm": {"lr": 1e-4}}])[0][0]
    fleet.idle()
    res = {"full_weight_turn_s": swap_seconds(fleet, job), "lora_turn_s": swap_seconds(fleet, lora_job)}
    print(f"a turn: full weights {res['full_weight_turn_s']:.4f} s, LoRA adapter {res['lora_turn_s']:.4f} s")
    return res


def bench_shares(fleet: WarmFleet, model: Path) -> dict[str, Any]:
    weights = (1.0, 2.0, 4.0)
    specs = [
        long_spec(model, f"share-{w:g}", seed=10 + i, steps=400, share=w, max_staleness=4)
        for i, w in enumerate(weights)
    ]
    ids = [fleet.submit(s)[0] for s in specs]
    shares = dict(zip(ids, weights, strict=True))
    for j in ids:
        wait_step(fleet, j, 3)
    before = generator_load(fleet)
    time.sleep(60)
    after = generator_load(fleet)
    for j in ids:
        httpx.post(f"{fleet.api}/jobs/{j}/cancel", timeout=30)
    for j in ids:
        fleet.wait(j)
    fleet.idle()
    window = {j: after[j]["tokens"] - before[j]["tokens"] for j in ids}
    seconds = {j: after[j]["seconds"] - before[j]["seconds"] for j in ids}
    err, frac = share_error(window, shares)
    busy = sum(seconds.values()) / 60
    fractions = [round(frac[j], 3) for j in ids]
    print(f"shares 1:2:4 -> token fractions {fractions}, error {err:.3f}; engine busy {busy:.2f}")
    return {
        "share_error": err,
        "shares": [shares[j] for j in ids],
        "token_fractions": [frac[j] for j in ids],
        "tokens_in_window": [window[j] for j in ids],
        "engine_seconds_in_window": [seconds[j] for j in ids],
        "engine_busy_fraction": busy,
        "states_after": [fleet.ledger.get_job(j)["state"] for j in ids],
        "window_s": 60,
    }


def bench_kill(fleet: WarmFleet, model: Path) -> dict[str, Any]:
    a, b = (fleet.submit(lora_spec(model, f"kill-{x}", seed=20 + i, steps=30))[0] for i, x in enumerate("ab"))
    wait_step(fleet, a, 5)
    pid = service_pid(fleet, "trainer", a)
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    for j in (a, b):
        fleet.wait(j)
    times = step_times(fleet, b)
    around = [t for t in times if t_kill - 5 <= t <= t_kill + 30]
    gap = max((y - x for x, y in zip(around, around[1:], strict=False)), default=0.0)
    usual = statistics.median([y - x for x, y in zip(times, times[1:], strict=False)])
    resumed = fleet.ledger.get_job(a)
    print(f"trainer of {a} killed: {b}'s longest step gap around it {gap:.2f} s (median step {usual:.2f} s)")
    return {
        "kill_other_max_step_gap_s": gap,
        "other_median_step_s": usual,
        "killed_job_state": resumed["state"] if resumed else None,
        "verify": {a: checked(fleet, a), b: checked(fleet, b)},
    }


QUIET_S = 3.0  # the poisoned job's sample count unchanged this long: its start-up is over
POISON_STEPS = 100  # the victim's steps per run: long enough that a second of noise is not 10 %
POISON_ROUNDS = 3  # beside the poisoned job, each followed by a run alone (and one alone before)

HANG = """import time


def score(completion, answer):
    # every sample hangs far past the reward's time budget
    time.sleep(3600)
    return float(completion.strip() == answer.strip())
"""


def tree_cpu_rate(pid: int, seconds: float = 5.0) -> float:
    """CPU-seconds per second used by process `pid` and its descendants (reaped ones included, through
    their parents' children times) over `seconds`."""
    import psutil

    def total() -> float:
        root = psutil.Process(pid)
        n = 0.0
        for p in (root, *root.children(recursive=True)):
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            n += t.user + t.system + t.children_user + t.children_system
        return n

    before = total()
    time.sleep(seconds)
    return (total() - before) / seconds


def start_poisoned(fleet: WarmFleet, model: Path, plugin: Path, steps: int) -> tuple[str, dict[str, Any]]:
    """A job whose reward hangs on every sample, poison first in its rollouts stream (the reward
    service's group reads from the start, so it meets the poison before its first batch hangs);
    returned once it is in its faulty steady state: its start-up (model load, step 0's held-out
    evaluation, its first batches) over, its generator stopped at the staleness bound, every batch
    of its reward hanging. A job starting beside the victim costs the victim CPU whatever its
    fault; that start-up is not what the figure measures. With what it was seen doing."""
    reward = {"kind": "python", "function": f"{plugin}:score", "timeout_s": 2.0, "on_failure": "zero"}
    bad = fleet.submit(lora_spec(model, "poisoned", seed=31, steps=steps, reward=reward))[0]
    redis_url, _ = resolve_redis_url(fleet.env.get("REDIS_URL"))
    streams = JobStreams(connect(redis_url), bad, prefix=fleet.env["STREAM_PREFIX"])
    for payload in (b"\x00not msgpack", b"\x81\xa1x\xc1"):  # garbage, and an invalid msgpack byte
        streams.publish_raw(ROLLOUTS, {FIELD: payload})
    t0, deadline = time.monotonic(), time.monotonic() + 120
    seen, steady_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = fleet.ledger.count_samples(bad)
        if n != seen:
            seen, steady_since = n, time.monotonic()
        elif n > 0 and time.monotonic() - steady_since >= QUIET_S:
            break
        time.sleep(0.2)
    return bad, {
        "samples": seen,
        "quiet_after_s": time.monotonic() - t0,
        "reward_cpu_s_per_s": tree_cpu_rate(service_pid(fleet, "reward")),  # what the faulty job alone costs
        "streams": streams,
    }


def bench_poison(fleet: WarmFleet, model: Path, wd: Path, rounds: int = POISON_ROUNDS) -> dict[str, Any]:
    """The victim alone, then `rounds` times: beside a poisoned job, then alone again. Alone and
    beside interleave so that the box's drift (alone runs of one session differ by up to 15 %
    here) falls on both sides; the ratio is of the means."""
    plugin = wd / "hang_reward.py"
    plugin.write_text(HANG)
    steps = POISON_STEPS

    def alone(name: str) -> str:
        job_id = run_all(fleet, [lora_spec(model, name, seed=30, steps=steps)])[0][0]
        fleet.idle()
        return job_id

    alone_ids, victims, bads, seen = [alone("victim-alone-0")], [], [], []
    for r in range(rounds):
        bad, state = start_poisoned(fleet, model, plugin, steps)
        victims.append(fleet.submit(lora_spec(model, f"victim-{r}", seed=30, steps=steps))[0])
        fleet.wait(victims[-1])
        httpx.post(f"{fleet.api}/jobs/{bad}/cancel", timeout=30)
        fleet.wait(bad)
        fleet.idle()
        bads.append(bad)
        seen.append(state)
        alone_ids.append(alone(f"victim-alone-{r + 1}"))
    rates = [step_rate(step_times(fleet, j)) for j in alone_ids]
    beside = [step_rate(step_times(fleet, j)) for j in victims]
    solo, together = statistics.mean(rates), statistics.mean(beside)
    print(f"victim's step rate {together:.2f}/s beside the poisoned job ({beside}) vs {solo:.2f}/s alone ({rates})")
    return {
        "poison_other_throughput_ratio": together / solo if solo else None,
        "victim_steps_per_s_alone": solo,
        "victim_steps_per_s_alone_runs": rates,
        "victim_steps_per_s_beside_poisoned": together,
        "victim_steps_per_s_beside_runs": beside,
        "poisoned_dead_letters": [s["streams"].r.xlen(s["streams"].key("dead")) for s in seen],
        "poisoned_samples_before_victim": [s["samples"] for s in seen],
        "poisoned_quiet_after_s": [round(s["quiet_after_s"], 1) for s in seen],
        "poisoned_reward_cpu_s_per_s": statistics.mean(s["reward_cpu_s_per_s"] for s in seen),
        "verify": {j: checked(fleet, j) for j in (*victims, *alone_ids, *bads)},
    }


def bench_chaos(fleet: WarmFleet, model: Path) -> dict[str, Any]:
    a, b = (fleet.submit(lora_spec(model, f"chaos-{x}", seed=40 + i, steps=30))[0] for i, x in enumerate("ab"))
    faults = []
    for step, role in ((4, "generator"), (10, "reward"), (16, "trainer")):
        wait_step(fleet, a, step)
        pid = service_pid(fleet, role, a if role == "trainer" else None)
        os.kill(pid, signal.SIGKILL)
        faults.append({"at_step_of_a": step, "killed": role, "pid": pid})
        time.sleep(3)
    for j in (a, b):
        fleet.wait(j, timeout=900)
    res = {a: checked(fleet, a), b: checked(fleet, b)}
    print(f"chaos: {faults}; verify {res}")
    return {"faults": faults, "verify": res}


PARTS = ("shares", "kill", "poison", "chaos")


def bench_tenants(
    *, workdir: str = "runs/bench-tenants", out_dir: str = "results", rounds: int = 2, part: str = ""
) -> dict[str, Any]:
    """All of it, or with `part` (one of PARTS) that part alone on a fleet of its own, merged into the
    results already in `out_dir` and marked as a rerun."""
    if part and part not in PARTS:
        raise ValueError(f"part must be one of {', '.join(PARTS)}, got {part!r}")
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    out = Path(out_dir)
    model = prepare_model(wd / "demo", 0)
    load = os.getloadavg()
    fleet = WarmFleet(wd, args=("--trainers", "4"))
    try:
        fleet.wait(fleet.submit(lora_spec(model, "warm-up", seed=99, steps=2))[0])  # the engine built once
        fleet.idle()
        if part:
            res = json.loads((out / "tenants.json").read_text())
            runs = {
                "shares": lambda: bench_shares(fleet, model),
                "kill": lambda: bench_kill(fleet, model),
                "poison": lambda: bench_poison(fleet, model, wd),
                "chaos": lambda: bench_chaos(fleet, model),
            }
            res[part] = runs[part]()
            res[part].update(
                rerun=f"this part alone ({time.strftime('%Y-%m-%d')}, python -m bench tenants --part {part}), "
                f"load {load[0]:.1f} -> {os.getloadavg()[0]:.1f}"
            )
            if part == "shares":
                res["share_error"] = res["shares"]["share_error"]
        else:
            res = {"machine_load_before": load, "steps": STEPS, "lora": LORA}
            res.update(bench_makespan(fleet, model, rounds))
            res.update(bench_turns(fleet, model, res["per_job"][0]["job"]))
            res.update(bench_makespan_long(fleet, model))
            res["shares"] = bench_shares(fleet, model)
            res["share_error"] = res["shares"]["share_error"]
            res["kill"] = bench_kill(fleet, model)
            res["poison"] = bench_poison(fleet, model, wd)
            res["chaos"] = bench_chaos(fleet, model)
            res["machine_load_after"] = os.getloadavg()
    finally:
        fleet.close()
    out.mkdir(parents=True, exist_ok=True)
    (out / "tenants.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    (out / "tenants.md").write_text(report(res))
    return res


def _figures(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


def report(r: dict[str, Any]) -> str:
    k, p, c = r["kill"], r["poison"], r["chaos"]
    verify_rows = [
        (name, j, v) for name, part in (("kill", k), ("poison", p), ("chaos", c)) for j, v in part["verify"].items()
    ]
    lines = [
        "# Several jobs at once on one fleet (`python -m bench tenants`)",
        "",
        "One fleet (`python -m asyncrl.launch --trainers 4`: 1 generator, 1 reward service, 4 trainers) on the "
        f"demo's warm-started model; LoRA rank {r['lora']['rank']} jobs, {r['steps']} steps, async. Load average "
        f"before {r['machine_load_before'][0]:.1f}, after {r['machine_load_after'][0]:.1f} (2 cores).",
        "",
        "| figure | value | goal |",
        "|---|---|---|",
        f"| concurrent_lora_makespan_ratio (4 jobs one after another / at once) | "
        f"{r['concurrent_lora_makespan_ratio']:.2f} (rounds: {', '.join(f'{x:.2f}' for x in r['makespan_ratios'])}; "
        f"CPU busy one after another {statistics.mean(r['cpu_busy_fraction']['sequential']):.0%}, at once "
        f"{statistics.mean(r['cpu_busy_fraction']['concurrent']):.0%} of 2 cores) | >= 2.0 |",
        f"| concurrent_lora_reward_gap (final held-out, at once minus alone) | {r['concurrent_lora_reward_gap']:+.3f} "
        f"(standard error {r['reward_gap_noise_se']:.3f}) | within the noise |",
        f"| share_error (shares 1:2:4, token fractions "
        f"{', '.join(f'{x:.3f}' for x in r['shares']['token_fractions'])}) | {r['share_error']:.3f} | <= 0.10 |",
        f"| the same where the engine is the bottleneck (64-token completions, 8 steps) | "
        f"{r['concurrent_lora_makespan_ratio_engine_bound']:.2f} (CPU busy "
        f"{r['cpu_busy_fraction_engine_bound']['sequential']:.0%} / "
        f"{r['cpu_busy_fraction_engine_bound']['concurrent']:.0%}; engine tokens/s one job per call "
        f"{r['engine_tokens_per_s_engine_bound']['sequential']:.0f}, merged calls "
        f"{r['engine_tokens_per_s_engine_bound']['concurrent']:.0f}) | |",
        f"| a turn of a job on a shared engine: full-weight swap / LoRA adapter swap (demo model) | "
        f"{r['full_weight_turn_s']:.4f} s / {r['lora_turn_s']:.4f} s | (why full-weight jobs get generators of "
        "their own: ARCHITECTURE.md) |",
        f"| one job's trainer SIGKILLed: the other's longest step gap | {k['kill_other_max_step_gap_s']:.2f} s "
        f"(median step {k['other_median_step_s']:.2f} s) | <= 2 s |",
        f"| poison rollouts + a hanging reward in one job: the other's step rate / alone | "
        f"{p['poison_other_throughput_ratio']:.3f} (mean steps/s beside it "
        f"{p['victim_steps_per_s_beside_poisoned']:.2f}: {_figures(p['victim_steps_per_s_beside_runs'])}; "
        f"alone {p['victim_steps_per_s_alone']:.2f}: {_figures(p['victim_steps_per_s_alone_runs'])}, interleaved) "
        "| >= 0.90 |",
        *(
            [
                f"\nThe poisoned job alone (its reward hanging on every call) kept the reward service and its "
                f"workers at {p['poisoned_reward_cpu_s_per_s']:.2f} CPU-s/s of the box's 2."
            ]
            if p.get("poisoned_reward_cpu_s_per_s") is not None
            else []
        ),
        *([f"\nRerun: {x[0]}: {x[1]['rerun']}" for x in (("poison", p), ("kill", k), ("chaos", c)) if "rerun" in x[1]]),
        "",
        "verify per job:",
        "",
        "| run | job | ok | state | lost | trained twice | steps |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {name} | {j} | {v['ok']} | {v['state']} | {v['lost']} | {v['trained_twice']} | {v['steps']} |"
            for name, j, v in verify_rows
        ),
        "",
        f"Chaos faults (in turn, two jobs running): {', '.join(f['killed'] for f in c['faults'])} SIGKILLed.",
        "",
        "Per job (seed: held-out at the last step alone / at once):",
        "",
        *(f"- seed {x['seed']}: {x['alone']:.3f} / {x['together']:.3f}" for x in r["per_job"]),
        "",
    ]
    return "\n".join(lines)
