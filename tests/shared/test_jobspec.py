"""The job spec: defaults, example specs, and validation errors that name the field to fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from shared.jobspec import AlgorithmSpec, JobSpec, SamplingSpec, TaskSpec, format_validation_error

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "deploy" / "jobs"


def errors_of(spec: dict[str, Any]) -> list[dict]:
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate(spec)
    out = format_validation_error(err.value)
    assert out and all(set(e) == {"field", "message"} for e in out)
    assert all(e["message"] for e in out)
    return out


def fields_of(spec: dict[str, Any]) -> set[str]:
    return {e["field"] for e in errors_of(spec)}


def test_defaults_are_valid() -> None:
    spec = JobSpec(model_path="models/tiny")
    assert spec.mode == "async"
    assert spec.task == TaskSpec() and spec.task.name == "arithmetic"
    assert spec.algorithm == AlgorithmSpec() and spec.sampling == SamplingSpec()
    # Every default survives a JSON round trip (the ledger stores the spec as JSON).
    again = JobSpec.model_validate_json(spec.model_dump_json())
    assert again == spec


def test_spec_is_frozen() -> None:
    spec = JobSpec(model_path="m")
    with pytest.raises(ValidationError):
        spec.steps = 3  # type: ignore[misc]


def test_example_specs_parse() -> None:
    """Every example in deploy/jobs/ is a valid spec (the folder is optional)."""
    if not EXAMPLES.exists():
        return
    files = sorted(EXAMPLES.glob("*.json"))
    assert files, f"{EXAMPLES} exists but holds no *.json example specs"
    for path in files:
        try:
            JobSpec.model_validate_json(path.read_text())
        except ValidationError as exc:
            pytest.fail(f"{path.relative_to(REPO)}: {format_validation_error(exc)}")


@pytest.mark.parametrize("model", [JobSpec, TaskSpec, SamplingSpec, AlgorithmSpec])
def test_every_field_is_documented(model: type[BaseModel]) -> None:
    # Sub-spec fields (task, algorithm, sampling) are documented by their own fields.
    undocumented = [
        name
        for name, f in model.model_fields.items()
        if not f.description
        and not (isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel))
    ]
    assert not undocumented, f"{model.__name__} fields without a description: {undocumented}"


def test_missing_model_path() -> None:
    (err,) = errors_of({})
    assert err["field"] == "model_path"
    assert "model_path" in err["message"] and "required" in err["message"]


def test_empty_model_path() -> None:
    assert fields_of({"model_path": ""}) == {"model_path"}


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"model_path": "m", "lerning_rate": 1e-3}, "lerning_rate"),
        ({"model_path": "m", "algorithm": {"lerning_rate": 1e-3}}, "algorithm.lerning_rate"),
        ({"model_path": "m", "task": {"name": "arithmetic", "size": 3}}, "task.size"),
        ({"model_path": "m", "sampling": {"top_k": 5}}, "sampling.top_k"),
    ],
)
def test_unknown_field_is_named(spec: dict, field: str) -> None:
    (err,) = errors_of(spec)
    assert err["field"] == field
    assert f"unknown field '{field}'" in err["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("group_size", 1),
        ("group_size", 1025),
        ("max_staleness", -1),
        ("max_staleness", 65),
        ("steps", 0),
        ("prompts_per_step", 0),
        ("eval_every", -1),
        ("seed", -1),
        ("mode", "bogus"),
        ("reward", "bleu"),
        ("name", ""),
        ("algorithm.lr", 0.0),
        ("algorithm.lr", 2.0),
        ("algorithm.rho", 0.5),
        ("algorithm.weight_decay", -0.1),
        ("algorithm.max_grad_norm", 0.0),
        ("algorithm.micro_batch_size", 0),
        ("algorithm.advantage", "ppo"),
        ("algorithm.loss", "dpo"),
        ("algorithm.aggregation", "mean"),
        ("adaptive_staleness.k_min", -1),
        ("adaptive_staleness.threshold", 0.0),
        ("sampling.temperature", 0.0),
        ("sampling.temperature", 11.0),
        ("sampling.top_p", 0.0),
        ("sampling.top_p", 1.5),
        ("sampling.max_tokens", 0),
        ("task.name", "mmlu"),
        ("task.n_train", 0),
        ("task.n_test", 0),
        ("task.test_fraction", 1.0),
        ("task.max_bytes", 0),
        ("task.max_rows", 0),
        ("task.answer_field", ""),
    ],
)
def test_out_of_range_value_names_the_field(field: str, value: Any) -> None:
    spec: dict[str, Any] = {"model_path": "m"}
    *parents, leaf = field.split(".")
    node = spec
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    (err,) = errors_of(spec)
    assert err["field"] == field


def test_boundary_values_are_accepted() -> None:
    spec = JobSpec(
        model_path="m",
        group_size=2,
        max_staleness=0,
        algorithm={"rho": 1.0, "lr": 1.0},
        sampling={"temperature": 10.0, "top_p": 1.0, "max_tokens": 1},
    )
    assert spec.group_size == 2 and spec.algorithm.rho == 1.0


def test_several_errors_are_all_reported() -> None:
    assert fields_of({"group_size": 1, "mode": "bogus", "extra": 1}) == {
        "model_path",
        "group_size",
        "mode",
        "extra",
    }


def test_gsm8k_requires_a_path() -> None:
    (err,) = errors_of({"model_path": "m", "task": {"name": "gsm8k"}})
    assert err["field"] == "task"
    assert "task.path" in err["message"] and "gsm8k" in err["message"]
    spec = JobSpec(model_path="m", task={"name": "gsm8k", "path": "data/gsm8k.jsonl"})
    assert spec.task.path == "data/gsm8k.jsonl"
    with pytest.raises(ValidationError):
        TaskSpec(name="gsm8k", path="")


def test_json_validation_matches_python_validation() -> None:
    """The API validates JSON bodies; the same errors must come out of that path."""
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate_json(json.dumps({"model_path": "m", "group_size": 1, "typo": 1}))
    assert {e["field"] for e in format_validation_error(err.value)} == {"group_size", "typo"}


def test_format_validation_error_strips_fastapi_body_prefix() -> None:
    class FakeRequestError(Exception):
        def errors(self) -> list[dict]:
            return [
                {
                    "loc": ("body", "algorithm", "lr"),
                    "msg": "Input should be greater than 0",
                    "type": "greater_than",
                },
                {
                    "loc": ("body", "typo"),
                    "msg": "Extra inputs are not permitted",
                    "type": "extra_forbidden",
                },
                {"loc": ("body", "model_path"), "msg": "Field required", "type": "missing"},
            ]

    assert format_validation_error(FakeRequestError()) == [
        {"field": "algorithm.lr", "message": "Input should be greater than 0"},
        {"field": "typo", "message": "unknown field 'typo'; remove it or check its spelling"},
        {"field": "model_path", "message": "field 'model_path' is required"},
    ]


def test_format_validation_error_of_a_plain_exception() -> None:
    assert format_validation_error(ValueError("bad spec")) == [{"field": "", "message": "bad spec"}]


# -- staleness and backpressure ----------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 4, 64])
def test_sync_mode_has_staleness_zero(k: int) -> None:
    spec = JobSpec(model_path="m", mode="sync", max_staleness=k, prompts_per_step=16)
    assert spec.staleness_bound == 0
    assert spec.max_groups_in_flight == 16


@pytest.mark.parametrize(
    ("k", "batch", "in_flight"), [(0, 16, 16), (1, 16, 32), (3, 5, 20), (64, 1, 65)]
)
def test_async_mode_bounds_groups_in_flight(k: int, batch: int, in_flight: int) -> None:
    spec = JobSpec(model_path="m", mode="async", max_staleness=k, prompts_per_step=batch)
    assert spec.staleness_bound == k
    assert spec.max_groups_in_flight == in_flight  # (k + 1) * batch
