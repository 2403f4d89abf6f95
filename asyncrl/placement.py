"""Placement: which cores (and GPUs) each service of one node gets, and its thread counts.

On a small box the generator's OpenMP threads and the trainer's torch threads otherwise fight over
the same cores (a job started unpinned stepped 2.4x slower than the bench's hand-pinned one on two
cores). `plan_placement` splits the node's cores between the roles it runs:

- the reward service gets `reward_share` of them (at least one core when the node has four or more;
  on smaller boxes it floats over every core: its work is short bursts between the others'),
- the generators and the trainer split the rest evenly (generators first, the trainer the last
  cores; with no trainer on the node the generators take all, and the other way round), each
  generator replica a disjoint slice of the generators' share,
- the broker API and the admin worker float (no pin: they mostly wait on I/O).

Each pinned role also gets its thread count: `VLLM_CPU_OMP_THREADS_BIND` (the generator's OpenMP
threads, one per core of its slice), `TRAINER_THREADS` and `OMP_NUM_THREADS` (torch intra-op),
`REWARD_WORKERS` (the reward pool's processes). A variable the user has already set wins, and
`<ROLE>_CPUS` (`GEN_CPUS`, `TRAINER_CPUS`, `REWARD_CPUS`: a cpuset list such as `0-3,8`) replaces a
role's share. GPUs (counted with `nvidia-smi -L`): with two or more, each generator replica gets one
device and the trainer the rest (`CUDA_VISIBLE_DEVICES`); with one, they share it (a declared
co-location: vLLM's `gpu_memory_utilization` leaves the trainer its part).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

ROLE_OF = {"generator_svc": "generator", "trainer_svc": "trainer", "reward_svc": "reward"}
OVERRIDE = {"generator": "GEN_CPUS", "trainer": "TRAINER_CPUS", "reward": "REWARD_CPUS"}


@dataclass(frozen=True)
class Placement:
    """Where one service runs: `cpus` (None: unpinned) and the environment that sizes its threads."""

    cpus: frozenset[int] | None
    env: dict[str, str] = field(default_factory=dict)


def parse_cpuset(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8].

    Raises:
        ValueError: not a cpuset list.
    """
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"{text!r} is not a cpuset list such as 0-3,8")
        a, b = int(lo), int(hi or lo)
        if b < a:
            raise ValueError(f"{text!r}: range {part} runs backwards")
        out += range(a, b + 1)
    return sorted(set(out))


def cpuset(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8' (vLLM's VLLM_CPU_OMP_THREADS_BIND takes this form)."""
    xs, parts, i = sorted(set(cpus)), [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(parts)


def gpu_count() -> int:
    """GPUs `nvidia-smi -L` lists (0 without the tool or a driver)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _split(xs: list[int], parts: int) -> list[list[int]]:
    """`xs` in `parts` contiguous slices as even as possible (each non-empty when len >= parts;
    with fewer cores than parts, slices share cores round-robin)."""
    if len(xs) < parts:
        return [[xs[i % len(xs)]] for i in range(parts)]
    q, r = divmod(len(xs), parts)
    out, i = [], 0
    for p in range(parts):
        n = q + (1 if p < r else 0)
        out.append(xs[i : i + n])
        i += n
    return out


def plan_placement(
    names: Sequence[tuple[str, str]],
    cores: Sequence[int],
    env: Mapping[str, str],
    gpus: int = 0,
    reward_share: float = 0.125,
) -> dict[str, Placement]:
    """Placement of each (name, module) on a node with `cores` (and `gpus`), given the
    environment the services will see (`env`: overrides and already-set thread variables).

    Raises:
        ValueError: a `<ROLE>_CPUS` override that does not parse or names cores not available.
    """
    cores = sorted(cores)
    roles = {n: ROLE_OF.get(m) for n, m in names}
    gens = [n for n, r in roles.items() if r == "generator"]
    present = {r for r in roles.values() if r}
    share: dict[str, list[int]] = {}
    for role in present:
        text = env.get(OVERRIDE[role])
        if text:
            picked = parse_cpuset(text)
            if not set(picked) <= set(cores):
                raise ValueError(f"{OVERRIDE[role]}={text}: cores {sorted(set(picked) - set(cores))} are not "
                                 f"available (this process may use {cpuset(cores)})")
            share[role] = picked
    free = [c for c in cores if not any(c in s for s in share.values())] or cores
    if "reward" in present and "reward" not in share and len(cores) >= 4:
        n = max(1, round(len(cores) * reward_share))
        share["reward"], free = free[-n:], free[:-n] or free
    compute = [r for r in ("generator", "trainer") if r in present and r not in share]
    if len(compute) == 2 and len(free) >= 2:
        half = (len(free) + 1) // 2
        share["generator"], share["trainer"] = free[:half], free[half:]
    elif compute:
        for r in compute:
            share[r] = free
    out: dict[str, Placement] = {}
    gen_slices = _split(share["generator"], len(gens)) if gens else []
    for name, kind in roles.items():
        if kind is None:
            out[name] = Placement(None)
            continue
        mine = gen_slices[gens.index(name)] if kind == "generator" else share.get(kind)
        if kind == "reward" and "reward" not in share:
            out[name] = Placement(None, {"REWARD_WORKERS": env.get("REWARD_WORKERS", "1"), "OMP_NUM_THREADS": "1"})
            continue
        assert mine is not None
        e: dict[str, str] = {}
        if kind == "generator":
            e["VLLM_CPU_OMP_THREADS_BIND"] = env.get("VLLM_CPU_OMP_THREADS_BIND", cpuset(mine))
        elif kind == "trainer":
            e["TRAINER_THREADS"] = env.get("TRAINER_THREADS", str(len(mine)))
            e["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", str(len(mine)))
        else:
            e["REWARD_WORKERS"] = env.get("REWARD_WORKERS", str(len(mine)))
            e["OMP_NUM_THREADS"] = "1"
        if gpus and "CUDA_VISIBLE_DEVICES" not in env and kind in ("generator", "trainer"):
            if gpus >= len(gens) + 1:
                e["CUDA_VISIBLE_DEVICES"] = (str(gens.index(name)) if kind == "generator"
                                             else ",".join(str(i) for i in range(len(gens), gpus)))
            else:
                e["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))  # shared: co-located
        out[name] = Placement(frozenset(mine), e)
    return out
