"""Service metrics: each service's class served on a real port and scraped over HTTP."""

from __future__ import annotations

import socket

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from shared.metrics import (
    GeneratorMetrics,
    RewardMetrics,
    TrainerMetrics,
    serve_metrics,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int, path: str = "/metrics") -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    resp = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)
    assert resp.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(resp.text)
        for s in fam.samples
    }


def _serve(service: str) -> tuple[int, CollectorRegistry]:
    port = _free_port()
    registry = serve_metrics(port, service)
    assert registry is not None
    return port, registry


JOB = (("job_id", "j1"),)


def test_generator_metrics_scraped() -> None:
    port, registry = _serve("generator")
    m = GeneratorMetrics(registry, "j1")
    m.generated(samples=8, tokens=120, seconds=0.3)
    m.generated(samples=8, tokens=80, seconds=2.0)
    m.loaded(version=3, seconds=0.04)
    m.dead_letter("prompts", "prompt_too_long")
    got = _scrape(port)
    assert got[("asyncrl_service_info", (("service", "generator"),))] == 1.0
    too_long = (("job_id", "j1"), ("reason", "prompt_too_long"), ("stream", "prompts"))
    assert got[("asyncrl_generator_dead_letters_total", too_long)] == 1
    assert got[("asyncrl_generator_samples_total", JOB)] == 16
    assert got[("asyncrl_generator_tokens_total", JOB)] == 200
    assert got[("asyncrl_generator_generate_seconds_count", JOB)] == 2
    assert got[("asyncrl_generator_generate_seconds_sum", JOB)] == pytest.approx(2.3)
    # 0.3 s falls in the 0.5 s bucket, 2.0 s does not
    assert got[("asyncrl_generator_generate_seconds_bucket", (("job_id", "j1"), ("le", "0.5")))] == 1
    assert got[("asyncrl_generator_policy_version", JOB)] == 3
    assert got[("asyncrl_generator_weight_load_seconds_count", JOB)] == 1
    # any path answers, so /health works as a liveness probe
    assert ("asyncrl_generator_policy_version", JOB) in _scrape(port, "/health")


def test_reward_metrics_scraped() -> None:
    port, registry = _serve("reward")
    m = RewardMetrics(registry, "j1")
    m.scored([1.0, 0.0, 0.5, 0.5])
    m.scored([])  # an all-dead-lettered batch leaves the mean alone
    m.dead_letter("rollouts", "non_finite_reward")
    m.dead_letter("rollouts", "non_finite_reward")
    m.dead_letter("rollouts", "malformed")
    got = _scrape(port)
    assert got[("asyncrl_reward_scored_total", JOB)] == 4
    assert got[("asyncrl_reward_mean", JOB)] == 0.5
    dead = (("job_id", "j1"), ("reason", "non_finite_reward"), ("stream", "rollouts"))
    assert got[("asyncrl_reward_dead_letters_total", dead)] == 2
    assert (
        got[("asyncrl_reward_dead_letters_total", (("job_id", "j1"), ("reason", "malformed"), ("stream", "rollouts")))]
        == 1
    )


def test_trainer_metrics_scraped() -> None:
    port, registry = _serve("trainer")
    m = TrainerMetrics(registry, "j1")
    step = {
        "reward/mean": 0.25,
        "loss": -0.125,
        "off_policy/mean": 1.5,
        "is/ess": 0.9,
        "off_policy/dropped": 4.0,
        "time/step_s": 1.2,
        "drop_skew/length_shift": 0.5,
    }
    m.step(1, 1, step)
    m.step(2, 2, {**step, "reward/mean": 0.75, "off_policy/dropped": 0.0, "time/step_s": 0.8})
    got = _scrape(port)
    assert got[("asyncrl_trainer_step", JOB)] == 2
    assert got[("asyncrl_trainer_policy_version", JOB)] == 2
    assert got[("asyncrl_trainer_reward_mean", JOB)] == 0.75
    assert got[("asyncrl_trainer_loss", JOB)] == -0.125
    assert got[("asyncrl_trainer_staleness_mean", JOB)] == 1.5
    assert got[("asyncrl_trainer_is_ess", JOB)] == 0.9
    assert got[("asyncrl_trainer_drop_length_shift", JOB)] == 0.5
    assert got[("asyncrl_trainer_dropped_total", JOB)] == 4
    assert got[("asyncrl_trainer_step_seconds_count", JOB)] == 2
    assert got[("asyncrl_trainer_step_seconds_sum", JOB)] == pytest.approx(2.0)


def test_port_zero_serves_nothing_and_metrics_still_accept_updates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_server(*args: object, **kwargs: object) -> None:
        raise AssertionError("port 0 must not start a metrics server")

    monkeypatch.setattr("shared.metrics.start_http_server", no_server)
    assert serve_metrics(0, "trainer") is None
    # Disabled metrics are private, so instances never clash over names.
    for _ in range(2):
        GeneratorMetrics(None, "j").generated(1, 1, 0.1)
        RewardMetrics(None, "j").scored([1.0])
        TrainerMetrics(None, "j").step(1, 1, {"loss": 0.0})


def test_names_are_prometheus_safe() -> None:
    registry = CollectorRegistry()
    GeneratorMetrics(registry, "j")
    RewardMetrics(registry, "j")
    TrainerMetrics(registry, "j")
    names = [fam.name for fam in registry.collect()]
    assert names and all(n.startswith("asyncrl_") and "/" not in n for n in names)


def test_phases_scraped_and_summarised() -> None:
    """Spans of a role land in its phase histogram; phase_summary reads count, total, mean and the
    bucket-interpolated median back from the page."""
    from shared.metrics import phase_summary

    port, registry = _serve("trainer")
    m = TrainerMetrics(registry, "j1")
    with m.phases.span("learner_step"):
        pass
    for s in (0.003, 0.004, 0.004):  # all three in the (0.002, 0.005] bucket
        m.phases.observe("ledger", s)
    with pytest.raises(ValueError, match="unknown trainer phase"), m.phases.span("generate"):
        pass
    assert m.phases.take_last().keys() == {"learner_step", "ledger"}
    assert m.phases.take_last() == {}
    got = {(p["role"], p["phase"]): p for p in phase_summary(httpx.get(f"http://127.0.0.1:{port}/metrics").text)}
    assert list(got) == [("trainer", "learner_step"), ("trainer", "ledger")]  # PHASES order, spans only
    ledger = got[("trainer", "ledger")]
    assert ledger["count"] == 3 and ledger["total_s"] == pytest.approx(0.011)
    assert ledger["mean_s"] == pytest.approx(0.011 / 3)
    # rank 1.5 of 3 in (0.002, 0.005]: 0.002 + 0.003 * 1.5 / 3
    assert ledger["median_s"] == pytest.approx(0.0035)


def test_unknown_role_is_refused() -> None:
    from shared.metrics import Phases

    with pytest.raises(ValueError, match="valid: \\['generator', 'reward', 'trainer'\\]"):
        Phases("judge")
