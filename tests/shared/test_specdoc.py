"""docs/jobspec.md is exactly what the models generate: the reference cannot drift from the code."""

from pathlib import Path

from shared.specdoc import reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "jobspec.md"


def test_the_job_spec_reference_is_current():
    assert DOC.read_text() == reference(), "regenerate it: python -m shared.specdoc > docs/jobspec.md"


def test_every_job_spec_field_is_in_the_reference():
    from shared.jobspec import JobSpec

    text = reference()
    assert all(f"| `{name}` |" in text for name in JobSpec.model_fields)
