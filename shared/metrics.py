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
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

log = logging.getLogger(__name__)

# Generate calls and weight loads run from tens of milliseconds (GPU) to minutes (CPU, big batch).
_SLOW_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, float("inf"))


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
    Info("asyncrl_service", "Which asyncrl service this process runs.", registry=registry).info(
        {"service": service}
    )
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
    # non_finite_reward), never free text: label values must stay few.
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
        self._samples = Counter(
            "asyncrl_generator_samples", "Completions generated.", labels, registry=r
        ).labels(job_id)
        self._tokens = Counter(
            "asyncrl_generator_tokens", "Completion tokens generated.", labels, registry=r
        ).labels(job_id)
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
        self._job_id = job_id
        self._dead = _dead_letters(r, "generator")

    def generated(self, samples: int, tokens: int, seconds: float) -> None:
        """One generate call: `samples` completions holding `tokens` tokens in `seconds`."""
        self._samples.inc(samples)
        self._tokens.inc(tokens)
        self._generate_s.observe(seconds)

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
        self._scored = Counter(
            "asyncrl_reward_scored", "Rollouts scored.", ["job_id"], registry=r
        ).labels(job_id)
        self._mean = Gauge(
            "asyncrl_reward_mean", "reward/mean of the last scored batch.", ["job_id"], registry=r
        ).labels(job_id)
        self._dead = _dead_letters(r, "reward")
        self._status = Counter(
            "asyncrl_reward_status", "Rollouts by reward status (ok, timeout, error), dropped ones included.",
            ["job_id", "status"], registry=r,
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
        """One entry of `stream` dead-lettered for `reason` (a code, e.g. non_finite_reward)."""
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
    }

    def __init__(self, registry: CollectorRegistry | None = None, job_id: str = "") -> None:
        r = _registry(registry)
        labels = ["job_id"]
        self._step = Gauge(
            "asyncrl_trainer_step", "Last completed step.", labels, registry=r
        ).labels(job_id)
        self._version = Gauge(
            "asyncrl_trainer_policy_version", "Newest published policy version.", labels, registry=r
        ).labels(job_id)
        self._gauges = {
            key: Gauge(name, doc, labels, registry=r).labels(job_id)
            for name, (key, doc) in self.GAUGES.items()
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
