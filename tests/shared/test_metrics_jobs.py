"""Several jobs' metrics in one process (shared/metrics.py `job_registry`): one family per name."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shared.metrics import job_registry


def test_jobs_at_once_expose_each_family_once_with_every_jobs_series() -> None:
    parent = CollectorRegistry()
    with job_registry(parent) as a, job_registry(parent) as b:
        assert a is not None and b is not None
        for reg, job, n in ((a, "job-a", 2), (b, "job-b", 5)):
            Counter("asyncrl_generator_samples", "Samples.", ["job_id"], registry=reg).labels(job).inc(n)
        text = generate_latest(parent).decode()
        assert text.count("# HELP asyncrl_generator_samples_total") == 1
        (family,) = [f for f in text_string_to_metric_families(text) if f.name == "asyncrl_generator_samples"]
        got = {s.labels["job_id"]: s.value for s in family.samples if s.name.endswith("_total")}
        assert got == {"job-a": 2.0, "job-b": 5.0}
    # both jobs over: their series are gone, the name can be defined again
    assert "asyncrl_generator_samples" not in generate_latest(parent).decode()
    with job_registry(parent) as c:
        Counter("asyncrl_generator_samples", "Samples.", ["job_id"], registry=c).labels("job-c").inc()
        assert 'job_id="job-c"' in generate_latest(parent).decode()
