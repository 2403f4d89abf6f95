"""Prometheus metrics of the services (generator, reward, trainer), prometheus-client only.

Each service process calls `serve_metrics(settings.metrics_port, service)` once at start-up and
builds its metrics class with the registry it returns; the loop then updates them in one line
where it already has the figures (`metrics.generated(...)`, `metrics.step(...)`).

Names are the Prometheus spelling of the slash namespaces the logs and the ledger use
(`reward/mean` -> `asyncrl_trainer_reward_mean`): Prometheus names cannot hold a slash. Every
series carries the `job_id` label, so one scrape config serves any number of jobs.

With port 0 nothing is served and the metrics live in a private registry nobody reads: an update
is then a few dictionary lookups per batch, cheap enough that the loops need no `if enabled`.
Every path of the metrics server answers 200 with the exposition, so `/health` doubles as a
liveness probe.

Where a step's time goes: each role times its phases (PHASES) with one helper, `Phases.span`, into
`asyncrl_{role}_phase_seconds{job_id, phase}`; `phase_summary` reads them back from a page
(`asyncrl phases URL`, `python -m bench steps`).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

# Generate calls and weight loads run from tens of milliseconds (GPU) to minutes (CPU, big batch).
_SLOW_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, float("inf"))


# One step's phases: a Redis round trip or a ledger transaction (~0.1-5 ms) up to a generate call.
_PHASE_BUCKETS = (
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1,
    2,
    5,
    10,
    30,
    120,
    float("inf"),
)

# The phases each role times (Phases.span), in the order a step passes through them. A span of
# another name is refused: label values must stay few, and a reader relies on these.
PHASES: Mapping[str, tuple[str, ...]] = {
    # read: the consumer read (blocking while there is no input); policy_poll: reading the policy
    # stream; fetch: pull + verify the chunks; swap: reload into the engine; verify: the probe's
    # logprobs; fingerprint: hash of the engine's weights; load_ledger: the load's ledger row.
    "generator": (
        "read",
        "policy_poll",
        "fetch",
        "swap",
        "verify",
        "fingerprint",
        "load_ledger",
        "generate",
        "publish",
        "ledger",
        "heartbeat",
    ),
    "reward": ("read", "ledger_generated", "score", "ledger", "publish"),
    # wait: from the top of the step until a whole batch is in hand (read, assemble and feed are
    # inside it); learner_step, guard: the optimizer step and the collapse guard's check;
    # snapshot: the full state dict; probe, flatten, checksum, serve: the weight publish;
    # announce: the version's ledger row and its announcement; ledger: the step's ledger writes;
    # tracking: the step's metrics to the job's TensorBoard / MLflow / W&B run; ack: acks and
    # stream trims.
    "trainer": (
        "wait",
        "read",
        "assemble",
        "feed",
        "learner_step",
        "guard",
        "snapshot",
        "probe",
        "flatten",
        "checksum",
        "serve",
        "announce",
        "ledger",
        "tracking",
        "ack",
    ),
}


class Phases:
    """Wall time of one role's phases: `with phases.span("generate"): ...` observes the block's
    duration in `asyncrl_{role}_phase_seconds{job_id, phase}` (a histogram: count, sum, buckets).

    `last` holds each phase's total since `take_last()` was last called (the trainer puts them in
    its step metrics, and so in the ledger).
    """

    def __init__(self, role: str, registry: CollectorRegistry | None = None, job_id: str = "") -> None:
        if role not in PHASES:
            raise ValueError(f"unknown role {role!r}; valid: {sorted(PHASES)}")
        self.role, self._names = role, frozenset(PHASES[role])
        hist = Histogram(
            f"asyncrl_{role}_phase_seconds",
            f"Wall time of one phase of the {role}'s step (one span).",
            ["job_id", "phase"],
            buckets=_PHASE_BUCKETS,
            registry=_registry(registry),
        )
        self._h = {name: hist.labels(job_id, name) for name in PHASES[role]}
        self.last: dict[str, float] = {}

    @contextmanager
    def span(self, phase: str) -> Iterator[None]:
        """Time the block as one `phase` (also when it raises).

        Raises:
            ValueError: `phase` is not one of PHASES[role].
        """
        if phase not in self._names:
            raise ValueError(f"unknown {self.role} phase {phase!r}; valid: {list(PHASES[self.role])}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.observe(phase, time.perf_counter() - t0)

    def observe(self, phase: str, seconds: float) -> None:
        """One `phase` of `seconds` measured elsewhere (e.g. inside the engine's worker)."""
        self._h[phase].observe(seconds)
        self.last[phase] = self.last.get(phase, 0.0) + seconds

    def take_last(self) -> dict[str, float]:
        """Each phase's seconds since the previous call, and start counting afresh."""
        out, self.last = self.last, {}
        return out


def phase_summary(exposition: str) -> list[dict[str, float | str]]:
    """The phases in a /metrics page (`Phases`): per (role, phase) with at least one span, its
    count, total and mean seconds and the median estimated from the buckets (linear within the
    bucket, as PromQL's histogram_quantile), in PHASES order."""
    acc: dict[tuple[str, str], dict[str, float]] = {}
    buckets: dict[tuple[str, str], list[tuple[float, float]]] = {}
    names = {f"asyncrl_{role}_phase_seconds": role for role in PHASES}
    for family in text_string_to_metric_families(exposition):
        role = names.get(family.name)
        if role is None:
            continue
        for s in family.samples:
            key = (role, s.labels.get("phase", ""))
            if s.name.endswith("_bucket"):
                buckets.setdefault(key, []).append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count") or s.name.endswith("_sum"):
                acc.setdefault(key, {})[s.name.rsplit("_", 1)[1]] = s.value
    order = {(r, p): i for i, (r, p) in enumerate((r, p) for r, ps in PHASES.items() for p in ps)}
    out: list[dict[str, float | str]] = []
    for key in sorted(acc, key=lambda k: order.get(k, len(order))):
        n, total = acc[key].get("count", 0.0), acc[key].get("sum", 0.0)
        if n:
            out.append(
                {
                    "role": key[0],
                    "phase": key[1],
                    "count": n,
                    "total_s": total,
                    "mean_s": total / n,
                    "median_s": _bucket_quantile(sorted(buckets.get(key, [])), 0.5),
                }
            )
    return out


def _bucket_quantile(cumulative: list[tuple[float, float]], q: float) -> float:
    """The q-quantile of a histogram from its cumulative (upper bound, count) buckets."""
    if not cumulative or cumulative[-1][1] <= 0:
        return float("nan")
    rank, lo, below = q * cumulative[-1][1], 0.0, 0.0
    for le, n in cumulative:
        if n >= rank:
            if le == float("inf"):
                return lo  # past the last finite bound: its lower edge, as histogram_quantile does
            return lo + (le - lo) * ((rank - below) / (n - below) if n > below else 0.0)
        lo, below = le, n
    return lo


class _JobRegistries:
    """The live jobs' registries of one process, collected as one: a family several jobs define
    (each job's series labelled with its job_id) is exposed once, its samples together; two
    `# HELP` lines for one name would make a scrape fail while jobs run at once."""

    def __init__(self) -> None:
        self.children: list[CollectorRegistry] = []
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            children = list(self.children)
        merged: dict[str, Metric] = {}
        for child in children:
            for family in child.collect():
                if family.name not in merged:
                    merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                merged[family.name].samples.extend(family.samples)
        yield from merged.values()


_JOBS: weakref.WeakKeyDictionary[CollectorRegistry, _JobRegistries] = weakref.WeakKeyDictionary()
_JOBS_LOCK = threading.Lock()


@contextmanager
def job_registry(parent: CollectorRegistry | None) -> Iterator[CollectorRegistry | None]:
    """A registry for one job's metrics, served through `parent` (serve_metrics' registry) while
    the job runs and dropped with it: a long-lived service builds its metrics per job without
    registering a name twice or keeping finished jobs' series. Several jobs at once (a generator
    or reward service of a fleet) are exposed as one set of families (`_JobRegistries`)."""
    if parent is None:
        yield None
        return
    with _JOBS_LOCK:
        jobs = _JOBS.get(parent)
        if jobs is None:
            jobs = _JOBS[parent] = _JobRegistries()
            parent.register(jobs)  # type: ignore[arg-type]  # collects like any collector
    child = CollectorRegistry()
    with jobs._lock:
        jobs.children.append(child)
    try:
        yield child
    finally:
        with jobs._lock:
            jobs.children.remove(child)


def serve_metrics(port: int, service: str, host: str | None = None) -> CollectorRegistry | None:
    """Serve a fresh registry on `host:port`, in a daemon thread of this process.

    Args:
        port: TCP port; 0 serves nothing.
        service: the service's name, exported as `asyncrl_service_info{service=...}`.
        host: interface to listen on; None: METRICS_HOST (CommonSettings.metrics_host), which is
            loopback unless set, like every other port of the system.

    Returns:
        The registry to build the service's metrics on, or None when `port` is 0.

    Raises:
        OSError: the port cannot be bound (in use, or privileged).
    """
    if port <= 0:
        return None
    # A registry per process, not the global default: no process/platform collectors mixed in,
    # and tests can run several services' metrics side by side.
    registry = CollectorRegistry()
    Info("asyncrl_service", "Which asyncrl service this process runs.", registry=registry).info({"service": service})
    if host is None:
        from shared.settings import CommonSettings  # the environment, read only when serving

        host = CommonSettings().metrics_host
    start_http_server(port, addr=host, registry=registry)
    log.info("%s metrics on %s:%d/metrics", service, host, port)
    return registry


def _registry(registry: CollectorRegistry | None) -> CollectorRegistry:
    return registry if registry is not None else CollectorRegistry()


def _dead_letters(r: CollectorRegistry, service: str) -> Counter:
    # `reason` is a fixed code (shared.schema.REJECT_CODES or the consumer's own, e.g.
    # empty_completion), never free text: label values must stay few.
    return Counter(
        f"asyncrl_{service}_dead_letters",
        "Messages this process sent to the dead-letter stream, by source stream and reason code.",
        ["job_id", "stream", "reason"],
        registry=r,
    )


class GeneratorMetrics:
    """Generate calls and weight loads of one generator process."""

    def __init__(self, registry: CollectorRegistry | None = None, job_id: str = "") -> None:
        r = _registry(registry)
        labels = ["job_id"]
        self._samples = Counter("asyncrl_generator_samples", "Completions generated.", labels, registry=r).labels(
            job_id
        )
        self._tokens = Counter("asyncrl_generator_tokens", "Completion tokens generated.", labels, registry=r).labels(
            job_id
        )
        self._generate_s = Histogram(
            "asyncrl_generator_generate_seconds",
            "Wall time of one generate call (a batch of prompt groups).",
            labels,
            buckets=_SLOW_BUCKETS,
            registry=r,
        ).labels(job_id)
        self._version = Gauge(
            "asyncrl_generator_policy_version",
            "Policy version the engine serves.",
            labels,
            registry=r,
        ).labels(job_id)
        self._load_s = Histogram(
            "asyncrl_generator_weight_load_seconds",
            "Fetch + swap time of one verified weight load.",
            labels,
            buckets=_SLOW_BUCKETS,
            registry=r,
        ).labels(job_id)
        self._turns = Counter(
            "asyncrl_generator_model_turns", "Model turns of multi-turn episodes.", labels, registry=r
        ).labels(job_id)
        self._turn_calls = Counter(
            "asyncrl_generator_turn_calls",
            "Engine calls of multi-turn episodes (turns per call: the batching).",
            labels,
            registry=r,
        ).labels(job_id)
        self._job_id = job_id
        self._dead = _dead_letters(r, "generator")
        self.phases = Phases("generator", r, job_id)

    def generated(self, samples: int, tokens: int, seconds: float) -> None:
        """One generate call: `samples` completions holding `tokens` tokens in `seconds`."""
        self._samples.inc(samples)
        self._tokens.inc(tokens)
        self._generate_s.observe(seconds)

    def episodes(self, turns: int, calls: int) -> None:
        """A batch of multi-turn episodes: `turns` model turns in `calls` engine calls."""
        self._turns.inc(turns)
        self._turn_calls.inc(calls)

    def loaded(self, version: int, seconds: float) -> None:
        """A weight version now served, loaded in `seconds`."""
        self._version.set(version)
        self._load_s.observe(seconds)

    def dead_letter(self, stream: str, reason: str) -> None:
        """One entry of `stream` dead-lettered for `reason` (a code, e.g. prompt_too_long)."""
        self._dead.labels(self._job_id, stream, reason).inc()


class RewardMetrics:
    """Scoring batches of one reward process."""

    def __init__(self, registry: CollectorRegistry | None = None, job_id: str = "") -> None:
        r = _registry(registry)
        self._job_id = job_id
        self._scored = Counter("asyncrl_reward_scored", "Rollouts scored.", ["job_id"], registry=r).labels(job_id)
        self._mean = Gauge(
            "asyncrl_reward_mean", "reward/mean of the last scored batch.", ["job_id"], registry=r
        ).labels(job_id)
        self._dead = _dead_letters(r, "reward")
        self.phases = Phases("reward", r, job_id)
        self._status = Counter(
            "asyncrl_reward_status",
            "Rollouts by reward status (ok, timeout, error), dropped ones included.",
            ["job_id", "status"],
            registry=r,
        )

    def scored(self, rewards: list[float]) -> None:
        """One batch's finite rewards; an empty batch leaves the mean as it was."""
        self._scored.inc(len(rewards))
        if rewards:
            self._mean.set(sum(rewards) / len(rewards))

    def statuses(self, counts: Mapping[str, int]) -> None:
        """One batch's reward outcomes by status ("ok", "timeout", "error")."""
        for status, n in counts.items():
            if n:
                self._status.labels(self._job_id, status).inc(n)

    def dead_letter(self, stream: str, reason: str) -> None:
        """One entry of `stream` dead-lettered for `reason` (a code, e.g. empty_completion)."""
        self._dead.labels(self._job_id, stream, reason).inc()


class TrainerMetrics:
    """Per-step figures of the trainer, from the step's metrics dict."""

    # Prometheus gauge -> key in the trainer's step metrics (the names the ledger stores).
    GAUGES: Mapping[str, tuple[str, str]] = {
        "asyncrl_trainer_reward_mean": ("reward/mean", "Mean reward of the last step's batch."),
        "asyncrl_trainer_loss": ("loss", "Policy loss of the last step."),
        "asyncrl_trainer_staleness_mean": (
            "off_policy/mean",
            "Mean staleness (versions) of the last batch.",
        ),
        "asyncrl_trainer_is_ess": (
            "is/ess",
            "Importance-sampling effective sample size fraction, last step.",
        ),
        "asyncrl_trainer_drop_length_shift": (
            "drop_skew/length_shift",
            "Dropped against trained samples' mean completion length, relative to the trained scale; last step "
            "that dropped any (shared/drop_skew.py).",
        ),
        "asyncrl_trainer_drop_reward_shift": (
            "drop_skew/reward_shift",
            "Dropped against trained samples' mean reward, relative to the trained scale; last step that dropped any.",
        ),
    }

    def __init__(self, registry: CollectorRegistry | None = None, job_id: str = "") -> None:
        r = _registry(registry)
        labels = ["job_id"]
        self._step = Gauge("asyncrl_trainer_step", "Last completed step.", labels, registry=r).labels(job_id)
        self._version = Gauge(
            "asyncrl_trainer_policy_version", "Newest published policy version.", labels, registry=r
        ).labels(job_id)
        self._gauges = {
            key: Gauge(name, doc, labels, registry=r).labels(job_id) for name, (key, doc) in self.GAUGES.items()
        }
        self._dropped = Counter(
            "asyncrl_trainer_dropped",
            "Samples dropped for exceeding the staleness bound.",
            labels,
            registry=r,
        ).labels(job_id)
        self._step_s = Histogram(
            "asyncrl_trainer_step_seconds",
            "Wall time of one step (wait for data, train, publish, ledger).",
            labels,
            buckets=_SLOW_BUCKETS,
            registry=r,
        ).labels(job_id)
        self._job_id = job_id
        self._dead = _dead_letters(r, "trainer")
        self.phases = Phases("trainer", r, job_id)

    def dead_letter(self, stream: str, reason: str) -> None:
        """One entry of `stream` dead-lettered for `reason` (a code, e.g. invalid_sample)."""
        self._dead.labels(self._job_id, stream, reason).inc()

    def step(self, step: int, version: int, metrics: Mapping[str, float]) -> None:
        """One finished step and its metrics dict; keys it lacks leave their gauge as it was."""
        self._step.set(step)
        self._version.set(version)
        for key, gauge in self._gauges.items():
            if key in metrics:
                gauge.set(metrics[key])
        self._dropped.inc(metrics.get("off_policy/dropped", 0.0))
        if "time/step_s" in metrics:
            self._step_s.observe(metrics["time/step_s"])
