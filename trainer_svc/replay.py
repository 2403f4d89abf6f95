"""Replay: what each train step records so that it can be taken again, and `replay`, which takes a
job's steps again from its ledger and checkpoints alone and compares the weights bit for bit.

Recorded per step (`step_input`, written by the loop in trainer_svc/train.py, table `step_inputs`
of the ledger): the exact `TrainBatch` the learner stepped on (every tensor field by name: token
ids, behaviour logprobs, the rewards as shaped, versions, temperatures...) and the torch RNG state
the step began with, as one safetensors blob compressed with zlib (never pickle), its size and
digest; the lr the step took (the schedule's, the live lr's and staleness's all in it); the
checkpoint a collapse-guard roll-back restored before the step's last try; the manifest checksum
of the weights it produced (the one the version was published with); and the software identity
below. Everything else a step depends on is the job's spec (algorithm, loss, model) and the
weights and optimizer state before it, which follow from the steps before, a checkpoint or the
initial model.

Replaying builds the learner as the trainer did (seed, spec, initial model or the newest
checkpoint before the first replayed step, with its optimizer state), checks that its weights are
the ones recorded there, then for each step restores the recorded RNG state and takes
`Learner.step` on the recorded batch at the recorded lr, and compares the weights' checksum and the
learner's metrics with the recorded ones; it stops at the first step that differs.

What bit-exactness needs, beside the code: the same torch build (its kernels), the same model code
(transformers, peft for LoRA), the same CPU instruction set and model (oneDNN and MKL choose their
kernels and blocking by them) or GPU, the same thread count (a reduction splits by threads; replay
sets the recorded count), world size (FSDP reduces across ranks) and numerics flags. They are
recorded per step (`software_identity`); replay names any that differ up front: its steps are then
"not comparable", a difference expected rather than a fault.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import platform
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import xxhash

from broker.ledger import Ledger
from broker.ledger.rows import StepInputIn, StepInputRow
from shared.jobspec import JobSpec
from shared.transport import build_manifest
from trainer_svc import checkpoint
from trainer_svc.batch import TrainBatch
from trainer_svc.learner import Learner
from trainer_svc.weights import checkpoint_state, flatten_weights

FORMAT = 1
CODEC = "safetensors+zlib"
BATCH, RNG = "batch.", "rng."
# zlib's fastest level: it runs in the step's critical path, and token ids (int64, small values)
# shrink most at any level.
LEVEL = 1
# A differing step names at most this many of the learner's metrics that differ (the rest counted).
MAX_DIFFS_NAMED = 4


# --- recording ----------------------------------------------------------------------------------


class RecordDamaged(ValueError):
    """A recorded step's blob is not what was recorded (its size or digest differ) or unreadable."""


def capture_rng(device: str) -> dict[str, torch.Tensor]:
    """The RNG state a step draws from (dropout): torch's CPU generator, and the device's on CUDA."""
    out = {"torch": torch.get_rng_state()}
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state(dev)
    return out


def set_rng(rng: dict[str, torch.Tensor], device: str) -> None:
    torch.set_rng_state(rng["torch"])
    dev = torch.device(device)
    if "cuda" in rng and dev.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], dev)


def encode(batch: TrainBatch, rng: dict[str, torch.Tensor]) -> tuple[bytes, dict[str, Any]]:
    """`batch` (every tensor field, by name) and `rng` as compressed safetensors bytes, and the
    meta that decodes and checks them (format, codec, raw size, digest, `term_names`)."""
    tensors = {BATCH + k: v.detach().cpu().contiguous().clone() for k, v in batch.tensors().items()}
    tensors |= {RNG + k: v.detach().cpu().contiguous().clone() for k, v in rng.items()}
    raw = safetensors.torch.save(tensors)
    meta = {
        "format": FORMAT,
        "codec": CODEC,
        "raw_bytes": len(raw),
        "digest": xxhash.xxh3_128_hexdigest(raw),
        "term_names": list(batch.term_names),
    }
    return zlib.compress(raw, LEVEL), meta


def decode(data: bytes, meta: dict[str, Any]) -> tuple[TrainBatch, dict[str, torch.Tensor]]:
    """The inverse of `encode`.

    Raises:
        RecordDamaged: an unknown format or codec, or bytes that do not decompress to the
            recorded size and digest.
    """
    if meta.get("format") != FORMAT or meta.get("codec") != CODEC:
        raise RecordDamaged(
            f"format {meta.get('format')!r} / codec {meta.get('codec')!r}; this reads {FORMAT} / {CODEC}"
        )
    size = int(meta["raw_bytes"])
    try:
        d = zlib.decompressobj()
        raw = d.decompress(bytes(data), size + 1)  # bounded: never more than was recorded
    except zlib.error as exc:
        raise RecordDamaged(f"does not decompress ({exc})") from exc
    if len(raw) != size or not d.eof:
        raise RecordDamaged(f"decompresses to {len(raw)}{'+' if not d.eof else ''} bytes, recorded {size}")
    if xxhash.xxh3_128_hexdigest(raw) != meta["digest"]:
        raise RecordDamaged("its digest differs from the recorded one")
    tensors = safetensors.torch.load(raw)
    batch = {k.removeprefix(BATCH): v for k, v in tensors.items() if k.startswith(BATCH)}
    rng = {k.removeprefix(RNG): v for k, v in tensors.items() if k.startswith(RNG)}
    return TrainBatch.from_tensors(batch, meta["term_names"]), rng


@functools.cache
def _static_identity() -> dict[str, Any]:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "cuda": torch.version.cuda,
        "transformers": version("transformers"),
        "peft": version("peft"),
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def software_identity(device: str, world_size: int = 1) -> dict[str, Any]:
    """What a step's bits depend on besides the code and its inputs (see the module docstring)."""
    dev = torch.device(device)
    ident = {
        **_static_identity(),
        "device": dev.type,
        "threads": torch.get_num_threads(),
        "world_size": world_size,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
    }
    if dev.type == "cuda":
        ident |= {
            "gpu": torch.cuda.get_device_name(dev),
            "cudnn": torch.backends.cudnn.version(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "tf32": [torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32],
        }
    return ident


def identity_differences(recorded: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """Each key whose value differs, as `key: <recorded> recorded, <here> here`."""
    return [
        f"{k}: {recorded.get(k)!r} recorded, {here.get(k)!r} here"
        for k in sorted(recorded.keys() | here.keys())
        if recorded.get(k) != here.get(k)
    ]


@dataclass
class Taken:
    """One step as the learner took it (its last try): what `step_input` records besides the batch."""

    metrics: dict[str, float]
    tripped: bool
    lr: float
    rng: dict[str, torch.Tensor]
    restored_from: int | None = None  # a guard roll-back before the last try: the checkpoint step (0: initial)


def step_input(
    job_id: str,
    step: int,
    version: int,
    batch: TrainBatch,
    taken: Taken,
    checksum: str,
    identity: dict[str, Any],
) -> StepInputIn:
    """The ledger row (`record_step_input`) of step `step`, which produced `version` with weights
    of checksum `checksum`."""
    data, meta = encode(batch, taken.rng)
    return {
        "job_id": job_id,
        "step": step,
        "policy_version": version,
        "lr": float(taken.lr),
        "checksum": checksum,
        "restored_from": taken.restored_from,
        "identity": identity,
        "meta": meta,
        "data": data,
    }


def weights_checksum(learner: Learner) -> str:
    """The manifest checksum of the learner's weights as a publish computes it (the same snapshot:
    full weights, or a LoRA job's adapter tensors)."""
    state, _ = learner.snapshot()
    if learner.spec.lora is None:  # as publish_weights names and lays them out
        state = checkpoint_state(learner.model, state)
    entries, buf = flatten_weights(state)
    return build_manifest(0, entries, buf).checksum  # the checksum depends on the bytes only


# --- replaying ----------------------------------------------------------------------------------


class CannotReplay(RuntimeError):
    """The job cannot be replayed (as far as asked): the message says why."""


@dataclass
class Start:
    """Where a replay begins: after `step` (0: the initial model), from `source`."""

    step: int
    source: str
    path: Path | None
    checksum: str  # the weights loaded
    expected: str | None  # what the ledger recorded for them (None: nothing recorded)
    identity: dict[str, Any]  # this process's
    not_comparable: list[str]  # how the first replayed step's recorded identity differs from it

    @property
    def same(self) -> bool:
        return self.expected is None or self.expected == self.checksum


@dataclass
class StepResult:
    step: int
    version: int
    lr: float
    expected: str  # the recorded weights' checksum
    got: str  # the replayed one ("" when the step could not be taken)
    differs: list[str] = field(default_factory=list)  # what differed, named; [] bit for bit
    not_comparable: list[str] = field(default_factory=list)  # the recorded identity's differences
    restored_from: int | None = None
    loss: float | None = None

    @property
    def same(self) -> bool:
        return not self.differs


def _checkpoint_ok(path: Path) -> bool:
    return (path / checkpoint.COMMIT).exists() and (path / checkpoint.STATE_DIR / "optimizer.pt").exists()


def _metric_differences(recorded: dict[str, Any], got: dict[str, float]) -> list[str]:
    """The learner metrics that differ from the recorded step's (exact: JSON keeps a float's
    every bit; a non-finite value was recorded as null)."""
    out = []
    for k, v in got.items():
        if k not in recorded:
            continue
        r = recorded[k]
        same = (r is None and not math.isfinite(v)) or (r is not None and float(r) == v)
        if not same:
            out.append(f"{k} {r!r} recorded, {v!r} replayed")
    return out


def replay(
    ledger: Ledger,
    job_id: str,
    *,
    from_step: int = 1,
    to_step: int | None = None,
    device: str | None = None,
) -> Iterator[Start | StepResult]:
    """Take the job's recorded steps again: yields the `Start`, then a `StepResult` per step from
    the newest usable checkpoint before `from_step` (else the initial model) through `to_step`
    (default: the last recorded), stopping after the first that differs (or a start whose weights
    differ from the recorded ones). `device`: default the recorded one where it is available.

    Raises:
        CannotReplay: no such job, nothing recorded (the reason), a step between the start and
            `to_step` not recorded, or a checkpoint a step needs is gone.
    """
    job = ledger.get_job(job_id)
    if job is None:
        raise CannotReplay(f"no job {job_id!r} in the ledger")
    spec = JobSpec.model_validate(job["spec"])
    recorded = ledger.step_input_steps(job_id)
    if not recorded:
        why = (
            "its spec has record_steps false"
            if not spec.record_steps
            else "it trained no step, or trained before steps were recorded"
        )
        raise CannotReplay(f"job {job_id} recorded no step inputs ({why}): nothing to replay")
    last = max(recorded)
    to_step = last if to_step is None else min(to_step, last)
    if not 1 <= from_step <= to_step:
        raise CannotReplay(f"--from-step {from_step} is outside the recorded steps 1..{to_step}")
    ckpts = {c["step"]: Path(c["path"]) for c in ledger.checkpoints(job_id)}
    usable = [s for s, p in ckpts.items() if s < from_step and _checkpoint_ok(p)]
    start = max(usable, default=0)
    missing = sorted(set(range(start + 1, to_step + 1)) - set(recorded))
    if missing:
        raise CannotReplay(
            f"steps {missing[:8]}{'...' if len(missing) > 8 else ''} of job {job_id} were not recorded "
            f"(between the start, {'step ' + str(start) if start else 'the initial model'}, and step {to_step})"
        )
    first = ledger.step_input(job_id, start + 1)
    assert first is not None
    rec_ident = first["identity"]
    if device is None:
        device = "cuda" if rec_ident.get("device") == "cuda" and torch.cuda.is_available() else "cpu"
    threads = torch.get_num_threads()
    try:
        # the recorded thread count: a reduction's order depends on it
        if isinstance(rec_ident.get("threads"), int) and rec_ident["threads"] > 0:
            torch.set_num_threads(rec_ident["threads"])
        yield from _replay_from(ledger, job_id, spec, start, to_step, ckpts, first, device)
    finally:
        torch.set_num_threads(threads)  # the caller's again


def _replay_from(
    ledger: Ledger,
    job_id: str,
    spec: JobSpec,
    start: int,
    to_step: int,
    ckpts: dict[int, Path],
    first: StepInputRow,
    device: str,
) -> Iterator[Start | StepResult]:
    rec_ident = first["identity"]

    # the learner as the trainer built it (Parts.build): seed, then the model
    torch.manual_seed(spec.seed)
    path = ckpts[start] if start else None
    learner = Learner(spec, device, path)
    if path is not None:
        learner.restore(path, weights=False)  # its optimizer state
    here = software_identity(learner.device)
    versions = {v["version"]: v["checksum"] for v in ledger.policy_versions(job_id)}
    expected: str | None
    if start:
        before = ledger.step_input(job_id, start)
        expected = before["checksum"] if before is not None else versions.get(start)
    else:
        expected = versions.get(0)
    got = weights_checksum(learner)
    begin = Start(
        start,
        f"checkpoint {path}" if path else "the initial model",
        path,
        got,
        expected,
        here,
        identity_differences(rec_ident, here),
    )
    yield begin
    if not begin.same:
        return
    metrics = {s["step"]: s["metrics"] or {} for s in ledger.train_steps(job_id)}
    for step in range(start + 1, to_step + 1):
        row = first if step == start + 1 else ledger.step_input(job_id, step)
        assert row is not None
        result = _replay_step(learner, row, ckpts, metrics.get(step, {}), here)
        yield result
        if not result.same:
            return


def _replay_step(
    learner: Learner,
    row: StepInputRow,
    ckpts: dict[int, Path],
    recorded_metrics: dict[str, Any],
    here: dict[str, Any],
) -> StepResult:
    step = row["step"]
    result = StepResult(
        step,
        row["policy_version"],
        row["lr"],
        row["checksum"],
        "",
        not_comparable=identity_differences(row["identity"], here),
        restored_from=row["restored_from"],
    )
    try:
        batch, rng = decode(row["data"], row["meta"])
    except RecordDamaged as exc:
        result.differs.append(f"recorded batch damaged: {exc}")
        return result
    back = row["restored_from"]
    if back is not None:  # the collapse guard rolled back before this step's last try
        if back and not (back in ckpts and _checkpoint_ok(ckpts[back])):
            raise CannotReplay(f"step {step} started from checkpoint step {back} (a roll-back), which is gone")
        learner.restore(ckpts[back] if back else None)
    set_rng(rng, learner.device)
    metrics = learner.step(batch, lr=row["lr"])
    result.loss = metrics.get("loss")
    result.got = weights_checksum(learner)
    if result.got != result.expected:
        result.differs.append(f"weights checksum {result.expected} recorded, {result.got} replayed")
    diffs = _metric_differences(recorded_metrics, metrics)
    result.differs += diffs[:MAX_DIFFS_NAMED] + (
        [f"(+{len(diffs) - MAX_DIFFS_NAMED} more metrics)"] if len(diffs) > MAX_DIFFS_NAMED else []
    )
    return result


def report(job_id: str, events: list[Start | StepResult]) -> dict[str, Any]:
    """A replay's outcome as JSON: `bitwise` (every step replayed and the same; the start too),
    `first_differing_step` (0: the starting weights; None), what differed there, and what of the
    software differs from the recording (`not_comparable`)."""
    start = next(e for e in events if isinstance(e, Start))
    steps = [e for e in events if isinstance(e, StepResult)]
    bad = next((s for s in steps if not s.same), None)
    first: int | None = None if start.same else start.step
    differs = [] if start.same else [f"starting weights: checksum {start.expected} recorded, {start.checksum} loaded"]
    if bad is not None:
        first, differs = bad.step, bad.differs
    not_comparable = sorted({*start.not_comparable, *(d for s in steps for d in s.not_comparable)})
    return {
        "job_id": job_id,
        "bitwise": first is None,
        "first_differing_step": first,
        "differs": differs,
        "not_comparable": not_comparable,
        "start": {"step": start.step, "source": start.source, "checksum": start.checksum, "expected": start.expected},
        "steps": [
            {"step": s.step, "version": s.version, "lr": s.lr, "loss": s.loss, "expected": s.expected, "got": s.got}
            for s in steps
        ],
    }
