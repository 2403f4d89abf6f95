"""Placement: which cores (and GPUs) each service of one node gets, and its thread counts.

One rule for every way the services start (ARCHITECTURE.md, "Placement"): the one-box launcher
plans the whole node with `plan_placement` and starts each service on its share; a service started
on its own (docker compose, a systemd unit, a plain `python -m`) places itself with `place_self`
before it imports torch or vLLM (`shared/entry.py`), from the roles on its node (`NODE_ROLES`,
`NODE_GENERATORS`, `GEN_REPLICA`: `PlacementSettings`) and the cores it may use
(`os.sched_getaffinity`). Both give the same answer for the same node.

On a small box the generator's OpenMP threads and the trainer's torch threads otherwise fight over
the same cores (a job started unpinned stepped 2.4x slower than the bench's hand-pinned one on two
cores). Split placement (the default):

- the reward service gets `reward_share` of the cores (at least one core when the node has four or
  more; on smaller boxes it floats over every core: its work is short bursts between the others'),
- the generators and the trainer split the rest evenly (generators first, the trainer the last
  cores; with no trainer on the node the generators take all, and the other way round), each
  generator replica a disjoint slice of the generators' share (a replica without an index shares
  the whole slice),
- the broker API and the admin worker float (no pin: they mostly wait on I/O).

Co-located placement (`placement: colocated` in the job spec, `NODE_PLACEMENT=colocated` for
services that place themselves): the generators and the trainer alternate, so each gets every
core the reward does not (and every GPU): the phase that runs uses the whole machine.

Each pinned role also gets its thread count: `VLLM_CPU_OMP_THREADS_BIND` (the generator's OpenMP
threads, one per core of its slice), `TRAINER_THREADS` and `OMP_NUM_THREADS` (torch intra-op),
`REWARD_WORKERS` (the reward pool's processes). A variable the user has already set wins, and
`<ROLE>_CPUS` (`GEN_CPUS`, `TRAINER_CPUS`, `REWARD_CPUS`: a cpuset list such as `0-3,8`) replaces a
role's share. GPUs (counted with `nvidia-smi -L`): with more than one per generator, each generator
replica gets one device and the trainer the rest (`CUDA_VISIBLE_DEVICES`); with fewer, or
co-located, they share them all (vLLM's `gpu_memory_utilization` leaves the trainer its part, or
the phases take turns: sleep/wake and offloading).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field

ROLE_OF = {"generator_svc": "generator", "trainer_svc": "trainer", "reward_svc": "reward"}
OVERRIDE = {"generator": "GEN_CPUS", "trainer": "TRAINER_CPUS", "reward": "REWARD_CPUS"}
MODES = ("split", "colocated")


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
    mode: str = "split",
) -> dict[str, Placement]:
    """Placement of each (name, module) on a node with `cores` (and `gpus`), given the
    environment the services will see (`env`: overrides and already-set thread variables).
    `mode` is "split" (each role its own cores) or "colocated" (generators and trainer alternate
    on the same cores and GPUs).

    Raises:
        ValueError: an unknown mode, or a `<ROLE>_CPUS` override that does not parse or names
            cores not available.
    """
    if mode not in MODES:
        raise ValueError(f"placement {mode!r}: valid are {', '.join(MODES)}")
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
                raise ValueError(
                    f"{OVERRIDE[role]}={text}: cores {sorted(set(picked) - set(cores))} are not "
                    f"available (this process may use {cpuset(cores)})"
                )
            share[role] = picked
    free = [c for c in cores if not any(c in s for s in share.values())] or cores
    if "reward" in present and "reward" not in share and len(cores) >= 4:
        n = max(1, round(len(cores) * reward_share))
        share["reward"], free = free[-n:], free[:-n] or free
    compute = [r for r in ("generator", "trainer") if r in present and r not in share]
    if len(compute) == 2 and len(free) >= 2 and mode == "split":
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
            if gpus >= len(gens) + 1 and mode == "split":
                e["CUDA_VISIBLE_DEVICES"] = (
                    str(gens.index(name)) if kind == "generator" else ",".join(str(i) for i in range(len(gens), gpus))
                )
            else:
                e["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))  # shared: co-located
        out[name] = Placement(frozenset(mine), e)
    return out


def node_services(roles: Sequence[str], generators: int, replica: int | None = None) -> list[tuple[str, str]]:
    """The (name, module) list `plan_placement` takes for a node running `roles` with `generators`
    generator replicas. With `replica` unset the generators are planned as one (a replica that
    does not know its index shares the whole generators' slice)."""
    module = {v: k for k, v in ROLE_OF.items()}
    out: list[tuple[str, str]] = []
    for role in ("generator", "reward", "trainer"):
        if role not in roles:
            continue
        if role == "generator":
            n = max(1, generators) if replica is not None else 1
            out += [(f"generator-{i}", module[role]) for i in range(n)]
        else:
            out.append((role, module[role]))
    return out


def self_name(role: str, replica: int | None) -> str:
    """This process's name in `node_services`' list."""
    return f"generator-{replica or 0}" if role == "generator" else role


def place_self(
    module: str,
    environ: MutableMapping[str, str] | None = None,
    cores: Sequence[int] | None = None,
    gpus: int | None = None,
) -> Placement | None:
    """Give this process its share of the node: the same plan the launcher makes, for the roles
    the environment says run on this node (`PlacementSettings`), applied to this process only:
    its affinity (`os.sched_setaffinity`) and its thread variables in `environ` (os.environ).
    Call it before torch or vLLM is imported: they read the thread variables once.

    Returns the placement applied, or None: not a placed role, no `NODE_ROLES` (nothing is known
    of the node: the process keeps what it was started with), or `NODE_PLACEMENT=off` (the
    launcher already placed it, or the user pins it by hand).

    Raises:
        ValueError: bad placement variables (`PlacementSettings`) or a `<ROLE>_CPUS` override.
    """
    from shared.settings import PlacementSettings

    environ = os.environ if environ is None else environ
    role = ROLE_OF.get(module)
    s = PlacementSettings.from_env(environ)
    if role is None or s.placement == "off" or not s.roles:
        return None
    roles = set(s.roles) | {role}
    if role == "generator" and s.replica is not None and s.replica >= s.generators:
        raise ValueError(f"GEN_REPLICA={s.replica} but NODE_GENERATORS={s.generators}: replicas count from 0")
    cores = sorted(os.sched_getaffinity(0)) if cores is None else list(cores)
    if gpus is None:
        gpus = gpu_count() if role != "reward" and "CUDA_VISIBLE_DEVICES" not in environ else 0
    plan = plan_placement(node_services(sorted(roles), s.generators, s.replica), cores, environ, gpus, mode=s.placement)
    mine = plan[self_name(role, s.replica)]
    apply(mine, environ)
    return mine


def describe(p: Placement, mode: str = "split") -> str:
    """One log line's worth: 'cores 0-3 (split) VLLM_CPU_OMP_THREADS_BIND=0-3'."""
    where = cpuset(sorted(p.cpus)) if p.cpus else "(any)"
    return f"cores {where} ({mode}) " + " ".join(f"{k}={v}" for k, v in sorted(p.env.items()))


def apply(p: Placement, environ: MutableMapping[str, str]) -> None:
    """Pin this process to `p.cpus` (when set) and put `p.env` into `environ`."""
    environ.update(p.env)
    if p.cpus:
        os.sched_setaffinity(0, p.cpus)


def takes_turns(placement: str, device: str) -> bool:
    """Whether a co-located role hands the device over between phases: on a GPU the engine sleeps
    (level 1) and the trainer's state goes to host memory while the other runs. On CPU the phases
    only share cores (memory is one pool and neither holds a core while it waits), so nothing
    moves."""
    return placement == "colocated" and device.split(":")[0] == "cuda"
