"""`python -m bench ecosystem`: tasks written for other frameworks, run unchanged on a standing fleet.

results/ecosystem.{json,md} hold one key per section (issue 36); this module runs the sections in
`SECTIONS` and merges each into the JSON file already there, so sections measured by other runs
(or other modules adding to `SECTIONS`) are kept.

`conventions`: for verl, TRL and verifiers, a job run from that framework's own files, with no field
mapping and no adapter: a parquet file laid out as verl's preprocessing writes it
(examples/data_preprocess/gsm8k.py) and a `compute_score` file; a conversational JSON Lines dataset
as TRL's GRPO documentation lays it out and a `reward_func` file; a rubric file of verifiers-style
functions (arguments by parameter name) with weights. Each must finish with `verify` ok, and its
samples' rewards must carry what the convention logs (verl's extra numbers, each rubric function).
The files are written by the `*_case` functions below, which tests/test_ecosystem_jobs.py uses too.
"""

from __future__ import annotations

import json
import statistics
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.claims import machine

# --- the frameworks' own files -----------------------------------------------------------------

VERL_REWARD = '''
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's gsm8k-style rule: the last number of the response against the ground truth."""
    numbers = re.findall(r"-?\\d+", solution_str)
    pred = numbers[-1] if numbers else None
    acc = pred == str(ground_truth)
    return {"score": 1.0 if acc else 0.0, "acc": acc, "pred": pred or "", "index": extra_info["index"]}
'''

TRL_REWARD = '''
import re


def accuracy_reward(completions, solution, **kwargs):
    """TRL's GRPO documentation's shape: conversational completions, a dataset column by name."""
    contents = [completion[0]["content"] for completion in completions]
    rewards = []
    for content, sol in zip(contents, solution):
        numbers = re.findall(r"-?\\d+", content)
        rewards.append(1.0 if numbers and numbers[-1] == sol else 0.0)
    return rewards
'''

VERIFIERS_RUBRIC = """
import re


def correct_answer(parser, completion, answer, **kwargs):
    response = parser.parse_answer(completion) or ""
    numbers = re.findall(r"-?\\d+", response)
    return 1.0 if numbers and numbers[-1] == answer else 0.0


def brevity(completion, info):
    text = completion[-1]["content"]
    return 1.0 if len(text) <= info["max_chars"] else 0.0


RUBRIC = [correct_answer, brevity]
"""


def _problems(n: int) -> list[tuple[str, str]]:
    """``n`` additions the fleet's tiny model can read: ("3+4=", "7")."""
    return [(f"{a}+{b}=", str(a + b)) for a in range(20) for b in range(20)][:n]


def verl_case(d: Path, n: int = 48) -> dict[str, Any]:
    """verl's layout (a parquet file as its preprocessing writes it) and a compute_score file;
    the job spec's `task` and `reward` for them: no mapping, no adapter."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": q}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": a},
            "extra_info": {"split": "train", "index": i, "answer": f"#### {a}", "question": q},
        }
        for i, (q, a) in enumerate(_problems(n))
    ]
    pq.write_table(pa.Table.from_pylist(rows), d / "verl_train.parquet")
    (d / "verl_reward.py").write_text(textwrap.dedent(VERL_REWARD))
    return {
        "task": {"format": "verl", "path": str(d / "verl_train.parquet"), "n_test": 8},
        "reward": f"{d / 'verl_reward.py'}:compute_score",
    }


def trl_case(d: Path, n: int = 48) -> dict[str, Any]:
    """TRL's conversational layout (prompt messages, a `solution` column) and a reward_func file."""
    rows = [{"prompt": [{"role": "user", "content": q}], "solution": a} for q, a in _problems(n)]
    (d / "trl_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "trl_reward.py").write_text(textwrap.dedent(TRL_REWARD))
    return {
        "task": {"format": "trl", "path": str(d / "trl_train.jsonl"), "n_test": 8},
        "reward": f"{d / 'trl_reward.py'}:accuracy_reward",
    }


def verifiers_case(d: Path, n: int = 48) -> dict[str, Any]:
    """A verifiers-style dataset (prompt messages, answer, info) and a rubric of two functions."""
    rows = [
        {"prompt": [{"role": "user", "content": q}], "answer": a, "info": {"max_chars": 4}, "task": "add"}
        for q, a in _problems(n)
    ]
    (d / "vf_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "vf_rubric.py").write_text(textwrap.dedent(VERIFIERS_RUBRIC))
    return {
        "task": {"format": "trl", "path": str(d / "vf_train.jsonl"), "n_test": 8},
        "reward": {"kind": "python", "function": f"{d / 'vf_rubric.py'}:RUBRIC", "weights": [1.0, 0.2]},
    }


CASES: dict[str, Callable[[Path], dict[str, Any]]] = {"verl": verl_case, "trl": trl_case, "verifiers": verifiers_case}
# What each convention must leave in its samples' reward details (the components it logs).
COMPONENTS = {"verl": {"acc", "index"}, "trl": set(), "verifiers": {"correct_answer", "brevity"}}


# --- running them ------------------------------------------------------------------------------


@dataclass
class Target:
    """Where jobs run: a standing fleet's API and its ledger (tests/shared_fleet.Fleet, or the
    fleet this bench starts), and the model its jobs train."""

    api: str
    ledger: Any  # broker.ledger.Ledger
    model: Path


def job_spec(name: str, model: Path, case: dict[str, Any], steps: int) -> dict[str, Any]:
    """A tiny job on `model` from one case's task and reward."""
    return {
        "name": name,
        "model_path": str(model),
        "steps": steps,
        "group_size": 4,
        "prompts_per_step": 4,
        "eval_every": 0,
        "sampling": {"max_tokens": 8},
        **case,
    }


def run_job(target: Target, spec: dict[str, Any], timeout_s: float = 600) -> dict[str, Any]:
    """Submit `spec`, wait for its end; the job's summary for the results (ok: finished and verified)."""
    import httpx

    from broker.verify import verify

    r = httpx.post(f"{target.api}/jobs", json=spec, timeout=30)
    if r.status_code != 201:
        raise RuntimeError(f"the API refused the {spec['name']} job: {r.status_code} {r.text}")
    job_id = str(r.json()["id"])
    deadline = time.monotonic() + timeout_s
    while (job := httpx.get(f"{target.api}/jobs/{job_id}", timeout=30).json())["state"] not in (
        "finished",
        "failed",
        "stopped",
        "cancelled",
    ):
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} ({spec['name']}) still {job['state']} after {timeout_s:g} s")
        time.sleep(0.5)
    v = verify(target.ledger, job_id)
    samples = target.ledger.samples(job_id)
    scored = [s for s in samples if s["reward_status"] is not None]
    comps = sorted({k for s in scored for k in ((s["reward_details"] or {}).get("components") or {})})
    rewards = [s["reward"] for s in scored if s["reward"] is not None]
    return {
        "ok": job["state"] == "finished" and v.ok,
        "job": job_id,
        "state": job["state"],
        "error": job.get("error"),
        "steps": job["step"],
        "verify": {
            "ok": v.ok,
            "steps": v.steps,
            "counts": v.counts,
            "violations": [f"{f.check}: {f.message}" for f in v.violations],
        },
        "reward_status": {st: sum(s["reward_status"] == st for s in scored) for st in ("ok", "error", "timeout")},
        "reward_mean": round(sum(rewards) / len(rewards), 4) if rewards else None,
        "components": comps,
    }


def conventions(target: Target, work: Path, steps: int = 3) -> dict[str, Any]:
    """The `conventions` section: one job per convention from that framework's own files."""
    out: dict[str, Any] = {}
    for name, make in CASES.items():
        d = work / f"conventions-{name}"
        d.mkdir(parents=True, exist_ok=True)
        out[name] = run_job(target, job_spec(f"ecosystem-{name}", target.model, make(d), steps))
    return out


Section = Callable[[Target, Path, int], dict[str, Any]]
SECTIONS: dict[str, Section] = {"conventions": conventions}
ARCH_KL_GATE = 1e-6  # issue 36's bound on the sync-mode mismatch KL (bench/ecosystem_arch.py)
"""The sections this module measures, by their key in results/ecosystem.json."""


def merge_results(path: Path, sections: dict[str, Any]) -> dict[str, Any]:
    """`path`'s JSON with `sections` put in (their keys replaced, every other key kept); written back."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(sections)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return data


def architectures_markdown(section: dict[str, Any]) -> list[str]:
    """results/ecosystem.md's `architectures` section."""
    lines = [
        "",
        "## architectures",
        "",
        "Tiny random models of the architectures users train (`asyncrl/tiny_archs.py`), each with its family's "
        "tokenizer type and chat template, on vLLM's CPU build in float32 (bench/ecosystem_arch.py). "
        f"mismatch KL: k3 per token of vLLM's samples under the trainer (gate {ARCH_KL_GATE:g}), from disk and after "
        "two full weight swaps (sync mode); fingerprint: the probe check passes after each swap (and failed before "
        "the first), the worse gap shown, and the engine fingerprint changed; LoRA: the default target modules all "
        "found, and an adapter swap passes the probe check.",
        "",
        "| architecture | tokenizer | ok | mismatch KL initial | mismatch KL sync | probe gap | fingerprint ok "
        "| LoRA targets | LoRA swap | mismatch KL LoRA | why not |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.2g}" if isinstance(x, float) else str(x)

    for name, r in section.items():
        reasons = [r[k] for k in ("reason", "swap_reason", "lora_reason", "lora_swap_reason") if r.get(k)]
        why = "; ".join(x.splitlines()[0][:200] for x in reasons).replace("|", "\\|")
        lines.append(
            f"| {name} ({r['model_type']}) | {r['tokenizer']} | {r['ok']} | {f(r.get('mismatch_kl_initial'))} | "
            f"{f(r.get('mismatch_kl_sync'))} | {f(r.get('probe_gap'))} | {f(r.get('fingerprint_ok'))} | "
            f"{f(r.get('lora_ok'))} | {f(r.get('lora_swap_ok'))} | {f(r.get('mismatch_kl_lora'))} | "
            f"{why} |"
        )
    return lines


def markdown(data: dict[str, Any]) -> str:
    lines = [
        "# Ecosystem: other frameworks' tasks run unchanged",
        "",
        "Generated by `python -m bench ecosystem` (section architectures: `python -m bench ecosystem-arch`).",
    ]
    if conv := data.get("conventions"):
        lines += [
            "",
            "## conventions",
            "",
            "A job per framework from its own files (data layout and reward function unchanged; "
            "bench/ecosystem.py writes them), on a standing fleet with reward worker processes.",
            "",
            "| convention | ok | job | steps | verify | rewards ok/error/timeout | reward mean | components logged |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, r in conv.items():
            st = r["reward_status"]
            lines.append(
                f"| {name} | {r['ok']} | `{r['job']}` | {r['steps']} | {'ok' if r['verify']['ok'] else 'FAILED'} | "
                f"{st['ok']}/{st['error']}/{st['timeout']} | {r['reward_mean']} | {', '.join(r['components']) or '-'} |"
            )
    if dvt := data.get("defaults_vs_trl"):
        lines += ["", defaults_markdown(dvt)]
    if gym := data.get("reasoning_gym"):
        lines += [
            "",
            "## reasoning_gym",
            "",
            "Datasets trained by name (`python -m bench ecosystem-gym`; the run's settings: `reasoning_gym_run`).",
            "",
            "| dataset | held-out before | after | delta | steps | verify |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {name} | {r['held_out_before']} | {r['held_out_after']} | {r['delta']:+.2f} | {r['steps']} | "
            f"{'ok' if r['verify_ok'] else 'FAILED'} |"
            for name, r in gym.items()
        ]
    if arch := data.get("architectures"):
        lines += architectures_markdown(arch)
    if envs := data.get("verifiers_envs"):
        lines += [
            "",
            "## verifiers_envs",
            "",
            "verifiers environments by module name (`python -m bench ecosystem-verifiers`; the tiny packages of "
            "tests/vf_envs, on the tiny model): the environment's own rubric is the reward, each function a term.",
            "",
            "| environment | ok | job | steps | verify | rewards ok/error/timeout | reward mean | terms logged |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, r in envs.items():
            st = r["reward_status"]
            lines.append(
                f"| {name} | {r['ok']} | `{r['job']}` | {r['steps']} | {'ok' if r['verify']['ok'] else 'FAILED'} | "
                f"{st['ok']}/{st['error']}/{st['timeout']} | {r['reward_mean']} | {', '.join(r['components']) or '-'} |"
            )
    skip = (
        "conventions",
        "machine",
        "conventions_machine",
        "defaults_vs_trl",
        "reasoning_gym",
        "architectures",
        "architectures_machine",
        "verifiers_envs",
        "verifiers_envs_machine",
    )
    for key in sorted(k for k in data if k not in skip):
        lines += ["", f"## {key}", ""]
        section = data[key]
        scalars = (
            {k: v for k, v in section.items() if isinstance(v, str | int | float | bool | None)}
            if isinstance(section, dict)
            else {}
        )
        if scalars:
            lines += ["| figure | value |", "|---|---|"]
            lines += [f"| {k} | {round(v, 4) if isinstance(v, float) else v} |" for k, v in scalars.items()]
            lines += ["", f"The rest in `results/ecosystem.json` key `{key}`."]
        else:
            lines.append(f"See `results/ecosystem.json` key `{key}`.")
    return "\n".join(lines) + "\n"


def bench_ecosystem(out_dir: str = "results", steps: int = 0, workdir: str = "runs/bench-ecosystem") -> dict[str, Any]:
    """Run every section on a fresh standing fleet (the tests' tiny model) and merge the results
    into `out_dir`/ecosystem.json and .md."""
    from asyncrl.tiny_model import build_tiny_model
    from bench.standing import standing_services

    wd = Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(wd / "tiny", layers=2, hidden=64, heads=2, intermediate=128, seed=0)
    started = time.time()
    with standing_services(wd / f"fleet-{time.time_ns()}", "ecosystem") as f:
        target = Target(f.api, f.ledger, model)
        results = {key: section(target, wd, steps or 3) for key, section in SECTIONS.items()}
    results["conventions_machine"] = {**machine(), "wall_s": round(time.time() - started, 1)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = merge_results(out / "ecosystem.json", results)
    (out / "ecosystem.md").write_text(markdown(data))
    return results


def defaults_markdown(d: dict[str, Any]) -> str:
    """results/ecosystem.md's `defaults_vs_trl` section."""
    st = d["settings"]
    lines = [
        "## defaults_vs_trl",
        "",
        "This system with its defaults against TRL's GRPOTrainer with its own defaults, on the own-task "
        "bench's task and warm start (bench/own_task.py `run_defaults_vs_trl`: "
        "`python -m bench defaults-vs-trl`). Ours sets only "
        f"{', '.join(f'`{f}`' for f in st['ours_fields_set'])}; TRL {st['trl'].get('version', '')} sets only "
        f"{', '.join(f'`{f}`' for f in st['trl'].get('fields_set') or [])} (bf16 off: fp32 on a CPU). "
        f"Both: {st['shape']['prompts_per_step']} prompts x {st['shape']['group_size']} samples a step, "
        f"lr {st['shape']['lr']}, {st['shape']['max_tokens']} tokens, stop {st['stop']!r}, {d['steps']} steps; "
        f"held-out: {st['held_out']}.",
        "",
    ]
    if "gap" in d:
        se = d["gap_se"]
        lines += [
            f"**gap {d['gap']:+.3f}** (ours {d['ours_mean']:.3f} - TRL {d['trl_mean']:.3f}, "
            f"standard error {'-' if se is None else f'{se:.3f}'} from the seeds' spread); goal >= "
            f"{d['goal']}: {'met' if d['goal_met'] else 'NOT met'}."
            + (f" With mode sync (the issue's comparison): gap {d['gap_sync']:+.3f}." if "gap_sync" in d else ""),
            "",
        ]
    lines += [
        "| | overrides | held-out per seed | mean | gap vs TRL | se | s/step |",
        "|---|---|---|---|---|---|---|",
        f"| TRL defaults | - | {', '.join(f'{x:.2f}' for x in d['trl'])} | {statistics.fmean(d['trl']):.3f} | | | "
        f"{st['trl_step_s_median']:.3f} |",
    ]
    for name, c in d["candidates"].items():
        se = c["gap_se"]
        lines.append(
            f"| ours {name} | `{json.dumps(c['overrides'])}` | {', '.join(f'{x:.2f}' for x in c['held_out'])} | "
            f"{c['ours_mean']:.3f} | {c['gap']:+.3f} | {'-' if se is None else f'{se:.3f}'} | "
            f"{statistics.median(c['step_s_median']):.3f} |"
        )
    ours, trl = st["ours_defaults"], st["trl"].get("defaults", {})
    lines += [
        "",
        "The defaults each side runs with (ours resolved from the job spec; TRL's read from its GRPOConfig):",
        "",
        f"- ours: {', '.join(f'{k} {v}' for k, v in ours.items())}",
        f"- TRL: {', '.join(f'{k} {v}' for k, v in trl.items())}",
        "",
        f"Machine: {st['machine']['cores']} cores, load average {st['loadavg_start'][0]:.2f} at the start, "
        f"{st['loadavg_end'][0]:.2f} at the end; {st['wall_s']:.0f} s; {st['date']}.",
    ]
    return "\n".join(lines)
