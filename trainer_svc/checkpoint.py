"""Trainer checkpoints and exact resume.

One checkpoint, `<root>/<job>/step-NNNNNN/`:

    config.json, model.safetensors, tokenizer files   the policy in HF format, at the top level, so
                                                      the directory loads with from_pretrained and
                                                      vLLM and exports as it is (LoRA: the base
                                                      with the adapter merged in)
    adapter/                     LoRA jobs: the PEFT adapter (adapter_config.json,
                                 adapter_model.safetensors), what a resume loads onto the base
    trainer_state/optimizer.pt   AdamW state_dict (tensors and numbers; torch.load(weights_only=True))
    trainer_state/rng.pt         torch CPU (and CUDA) generator states, numpy's MT19937 key
    trainer_state/trainer.json   step, policy version, run id, staleness bound and the adaptive
                                 controller, base lr, live knobs applied so far, python and numpy
                                 RNG scalars, the feeder's state (data cursor, in-flight groups,
                                 open eval rounds)
    COMMIT                       written last (then one rename): a directory without it is a
                                 crashed save and is removed at the next start

There is no LR scheduler state to save: a step's lr is the live lr (saved as `lr`) times the
schedule's factor at that step (a function of the step, which is saved), set on the param groups
every step (LoopState.step_lr). Next to the step directories, `feed-journal.json`
holds the feeder's state after every publish (atomic replace), so a restarted trainer knows what
its predecessor fed after its last checkpoint.

How resume stays exact (no sample skipped or trained twice). The ledger records a step's samples
as `trained` when the step is done, and a checkpoint is only taken every N steps, so a trainer
killed between checkpoints has trained steps the checkpoint does not hold. Rather than pay for a
full checkpoint (weights + 2x optimizer state) every step, the trainer

1. holds the XACK of every scored entry it trains on until a checkpoint covering that step is
   committed: those entries stay pending in the `trainers` group (and trim_acked's MINID keeps
   them in the stream). Redis memory for this is bounded by checkpoint_every steps of samples;
2. on start, loads the newest committed checkpoint (or the job's initial state when there is none),
   takes over every entry pending in `trainers` at once (the trainer is one process per job, so
   anything pending at its start belongs to a dead predecessor; waiting `claim_idle_ms` for them
   to go idle would stall the job for a minute), and
3. re-does the steps the ledger shows trained after the checkpoint with exactly the groups the
   ledger names, in feed order, at the lr it recorded. Same weights, optimizer state, data and lr
   give the same update: the ledger keeps its single `trained` record per sample (record_used
   only moves unused samples) and the re-published versions carry the checksums the predecessor
   published (checked and logged; on CPU they match bit for bit).

Groups the predecessor fed but had not trained stay in flight: the journal names them and they
are consumed as usual, fresh or dropped by the staleness rule. A group nobody knows (fed in the
instant between an XADD and the journal write) is dropped with a reason, never silently lost.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from broker.ledger import TrainerLedger
from broker.ledger.rows import SampleRow
from broker.streams import Consumer, Delivery, JobStreams
from shared.ids import group_seq, sample_id

log = logging.getLogger(__name__)

FORMAT = 1
STATE_DIR = "trainer_state"
COMMIT = "COMMIT"
JOURNAL = "feed-journal.json"
# The trainer never reclaims from itself mid-run (its held entries may wait longer than any idle
# timeout for the next checkpoint); it takes over a predecessor's entries once, at start.
NEVER_MS = 2**62


def step_dir(root: str | Path, job_id: str, step: int) -> Path:
    return Path(root) / job_id / f"step-{step:06d}"


# --- RNG ----------------------------------------------------------------------------------------


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, JSON scalars) of every generator the trainer may draw from."""
    # the legacy tuple (the default; numpy's type also allows the dict of legacy=False)
    np_state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np_state
    tensors = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(np_keys.astype(np.int64))}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda{i}"] = s
    py_version, py_state, py_gauss = random.getstate()
    scalars = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_name, int(np_pos), int(np_has_gauss), float(np_gauss)],
    }
    return tensors, scalars


def set_rng_state(tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[f"cuda{i}"] for i in range(len(tensors)) if f"cuda{i}" in tensors]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    py_version, py_state, py_gauss = scalars["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    np_name, np_pos, np_has_gauss, np_gauss = scalars["numpy"]
    np.random.set_state((np_name, tensors["numpy_keys"].numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))


# --- save / find / load -------------------------------------------------------------------------


def _write_json(path: Path, obj: Any, durable: bool = True) -> None:
    """Write JSON atomically (temp file, rename); `durable`: fsync it first, so it also survives a
    crash of the machine, not only of the process."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
        if durable:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())


def save(
    final: Path,
    model,
    tokenizer,
    optimizer: torch.optim.Optimizer | dict[str, Any],
    state: dict[str, Any],
    model_state: dict[str, torch.Tensor] | None = None,
) -> dict[str, float]:
    """Write one checkpoint atomically; returns {"bytes", "seconds"}. An existing committed
    checkpoint at `final` is kept as it is (a step is saved once).

    `optimizer`: the optimizer or its full `state_dict()`; `model_state`: the full HF-named
    weights when `model` itself holds only a shard (FSDP2, gathered by trainer_svc/dist.py)."""
    t0 = time.perf_counter()
    if (final / COMMIT).exists():
        return {"bytes": float(dir_bytes(final)), "seconds": 0.0}
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if getattr(model, "peft_config", None):  # LoRA: the merged model at the top, the adapter beside it
        from trainer_svc import lora

        spec = lora_spec(model)
        full = model_state if model_state is not None else model.state_dict()
        model.get_base_model().save_pretrained(tmp, state_dict=lora.merged_state(full, spec))
        lora.write_adapter(
            tmp / lora.ADAPTER_DIR,
            {lora.adapter_name(k): v for k, v in full.items() if ".lora_" in k},
            spec,
            str(model.peft_config[lora.ADAPTER_NAME].base_model_name_or_path or ""),
        )
    else:
        model.save_pretrained(tmp, state_dict=model_state)
    tokenizer.save_pretrained(tmp)
    sd = tmp / STATE_DIR
    sd.mkdir()
    torch.save(optimizer if isinstance(optimizer, dict) else optimizer.state_dict(), sd / "optimizer.pt")
    tensors, scalars = rng_state()
    torch.save(tensors, sd / "rng.pt")
    (sd / "trainer.json").write_text(json.dumps({"format": FORMAT, **state, "rng": scalars}))
    _fsync_tree(tmp)
    _write_json(
        tmp / COMMIT,
        {
            "format": FORMAT,
            "job_id": state.get("job_id"),
            "step": state["step"],
            "policy_version": state["policy_version"],
            "trainer_state": STATE_DIR,
        },
    )
    shutil.rmtree(final, ignore_errors=True)  # an uncommitted leftover of a crashed save
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power cut
    finally:
        os.close(fd)
    return {"bytes": float(dir_bytes(final)), "seconds": time.perf_counter() - t0}


def lora_spec(model):
    """The LoraSpec a PeftModel was built with."""
    from shared.jobspec import LoraSpec

    c = model.peft_config["default"]
    return LoraSpec(rank=c.r, alpha=c.lora_alpha, dropout=c.lora_dropout, target_modules=sorted(c.target_modules))


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def step_of(path: Path) -> int:
    """The step a committed checkpoint holds (from its COMMIT marker)."""
    return int(json.loads((path / COMMIT).read_text())["step"])


def latest(root: str | Path, job_id: str) -> Path | None:
    """The newest committed checkpoint of the job that holds trainer state; removes uncommitted
    leftovers (temp directories and directories without COMMIT: crashed saves)."""
    job_dir = Path(root) / job_id
    if not job_dir.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for d in job_dir.glob("step-*"):
        if not d.is_dir():
            continue
        if ".tmp-" in d.name or not (d / COMMIT).exists():
            log.warning("removing uncommitted checkpoint %s (a crashed save)", d)
            shutil.rmtree(d, ignore_errors=True)
            continue
        if not (d / STATE_DIR / "trainer.json").exists():
            continue  # an HF export without trainer state: not resumable
        step = step_of(d)
        if best is None or step > best[0]:
            best = (step, d)
    return best[1] if best else None


def read_optimizer(path: Path) -> dict[str, Any]:
    """A checkpoint's optimizer state (`optimizer.state_dict()` layout, on CPU; whatever the world
    size that saved it)."""
    return torch.load(path / STATE_DIR / "optimizer.pt", map_location="cpu", weights_only=True)


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The HF-named weights of a checkpoint or model directory, as loaded by from_pretrained."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def load_state(path: Path, optimizer: torch.optim.Optimizer | None = None, device: str = "cpu") -> dict[str, Any]:
    """Restore every RNG (and the optimizer, if given; a sharded trainer loads it through
    `Learner.restore` instead) from a checkpoint; returns its trainer.json."""
    sd = path / STATE_DIR
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(sd / "optimizer.pt", map_location=device, weights_only=True))
    state = json.loads((sd / "trainer.json").read_text())
    if state.get("format") != FORMAT:
        raise ValueError(f"{sd}: trainer state format {state.get('format')!r}, this trainer reads {FORMAT}")
    set_rng_state(torch.load(sd / "rng.pt", weights_only=True), state["rng"])
    return state


class FeedJournal:
    """The feeder's newest state, replaced atomically after every publish (`Feeder(journal=...)`).

    Not fsynced: it is written at every step, and an fsync costs ~10 ms there (the most of any fixed
    cost of a small step). A killed trainer's journal is whole (the rename is atomic and the page
    cache outlives the process); after a crash of the machine it may be older than the feeds, which
    a resume tolerates as it does a kill between a publish and its journal write: the groups fed
    after it are not in the new run's flight and are dropped with the reason, never trained twice."""

    def __init__(self, root: str | Path, job_id: str):
        self.path = Path(root) / job_id / JOURNAL

    def write(self, state: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _write_json(self.path, state, durable=False)

    def read(self) -> dict[str, Any] | None:
        return json.loads(self.path.read_text()) if self.path.exists() else None


# --- resume plan --------------------------------------------------------------------------------


def replay_plan(trained: Sequence[SampleRow], from_version: int) -> dict[int, list[str]]:
    """step -> the group ids it trained (feed order), for every step after `from_version`.

    `trained`: ledger rows (group_id, trainer_version) of trained samples; a step that produced
    version v + 1 trained at trainer_version v. Raises ValueError if the steps are not contiguous
    from from_version + 1 (the ledger and the checkpoint do not belong together).
    """
    by_step: dict[int, set[str]] = {}
    for row in trained:
        v = row["trainer_version"]  # never None for a trained row
        if v is not None and v >= from_version:
            by_step.setdefault(v + 1, set()).add(row["group_id"])
    steps = sorted(by_step)
    if steps != list(range(from_version + 1, from_version + 1 + len(steps))):
        raise ValueError(f"ledger steps after version {from_version} are not contiguous: {steps}")
    return {s: sorted(by_step[s], key=group_seq) for s in steps}


@dataclass
class Resume:
    """Where a restarted trainer continues: a checkpoint (None: the job's initial state) plus the
    steps its predecessor trained after it, to re-do with the same groups."""

    checkpoint: Path | None
    step: int
    version: int
    state: dict[str, Any]  # the checkpoint's trainer.json ({} without one)
    feeder: dict[str, Any] | None  # the newest feeder state (journal, else the checkpoint's)
    replay: dict[int, list[str]] = field(default_factory=dict)  # step -> group ids
    replay_lr: dict[int, float] = field(default_factory=dict)  # step -> lr it was trained with
    checksums: dict[int, str] = field(default_factory=dict)  # version -> published checksum
    eval_steps: set[tuple[str, int]] = field(default_factory=set)  # (eval set, step) rounds fed or recorded


def plan_resume(root: str | Path, job_id: str, ledger: TrainerLedger) -> Resume | None:
    """What the ledger, the checkpoints and the feed journal say about this job; None for a job no
    trainer has worked on yet. Call before loading the model (the checkpoint holds it)."""
    ckpt = latest(root, job_id)
    journal = FeedJournal(root, job_id).read()
    if ckpt is None and journal is None and ledger.last_train_step(job_id) is None:
        return None
    state: dict[str, Any] = json.loads((ckpt / STATE_DIR / "trainer.json").read_text()) if ckpt else {}
    step, version = int(state.get("step", 0)), int(state.get("policy_version", 0))
    if ckpt is not None:  # a save may have died between its rename and the ledger row
        ledger.record_checkpoint(job_id, step, version, str(ckpt.resolve()))
    trained = ledger.samples(job_id, status="trained", kind="train", min_trainer_version=version)
    replay = replay_plan(trained, version)
    metrics = {s["step"]: s["metrics"] for s in ledger.train_steps(job_id)}
    replay_lr = {s: float(metrics[s]["lr"]) for s in replay if "lr" in (metrics.get(s) or {})}
    feeder = journal if journal is not None else state.get("feeder")
    eval_steps = {(e["name"], e["step"]) for e in ledger.evals(job_id, source="pipeline")}
    if feeder is not None:
        feeder = dict(feeder)
        # In flight: what was fed and is not used yet (a group is used whole: trained or dropped in
        # one ledger transaction), plus the groups the replayed steps consume again.
        flying = list(feeder["in_flight"])
        used = ledger.used_msg_ids(job_id, [sample_id(g, 0) for g in flying])
        replayed = {g for ids in replay.values() for g in ids}
        keep = {g for g in flying if sample_id(g, 0) not in used} | replayed
        feeder["in_flight"] = sorted(keep, key=group_seq)
        # [step, eval set] per open round (a bare step: the default set, from journals before named sets)
        opened = {
            r: (v, "held_out") if isinstance(v, int) else (int(v[0]), str(v[1]))
            for r, v in feeder["open_evals"].items()
        }
        feeder["open_evals"] = {r: [st, name] for r, (st, name) in opened.items() if (name, st) not in eval_steps}
        eval_steps |= {(name, st) for st, name in opened.values()}
    checksums = {v["version"]: v["checksum"] for v in ledger.policy_versions(job_id)}
    return Resume(ckpt, step, version, state, feeder, replay, replay_lr, checksums, eval_steps)


# --- streams ------------------------------------------------------------------------------------


def _like(streams: JobStreams, claim_idle_ms: int) -> JobStreams:
    return JobStreams(
        streams.r,
        streams.job_id,
        prefix=streams.prefix,
        max_message_bytes=streams.max_message_bytes,
        claim_idle_ms=claim_idle_ms,
        max_deliveries=streams.max_deliveries,
        max_read_bytes=streams.max_read_bytes,
    )


def singleton_consumer(streams: JobStreams) -> JobStreams:
    """The trainer's view of its input stream: no idle reclaim (see NEVER_MS)."""
    return _like(streams, NEVER_MS)


def take_over(streams: JobStreams, c: Consumer) -> list[Delivery]:
    """Claim every entry pending in `c.group` for `c`, whoever holds it and however briefly idle.

    Only for a consumer that is alone in its group by design (the trainer: one per job), at start,
    before it reads anything: every pending entry then belongs to a dead predecessor. Each take-over
    counts one delivery, so an entry survives max_deliveries - 1 restarts between checkpoints.
    """
    if streams.pending_count(c.stream, c.group) == 0:
        return []
    return streams.claim_all(c)  # in reads bounded by bytes
