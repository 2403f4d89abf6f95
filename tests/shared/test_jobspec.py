"""The job spec: defaults, example specs, and validation errors that name the field to fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from shared.jobspec import (
    AlgorithmSpec,
    JobSpec,
    SamplingSpec,
    TaskSpec,
    format_validation_error,
    stored_spec,
)

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
        if not f.description and not (isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel))
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
        ({"model_path": "m", "task": {"name": "arithmetic", "sizes": 3}}, "task.sizes"),
        ({"model_path": "m", "sampling": {"top_a": 5}}, "sampling.top_a"),
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
        ("share", 0),
        ("share", -1),
        ("share", 1000.5),
        ("share", float("nan")),
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
        share=1000,
    )
    assert spec.group_size == 2 and spec.algorithm.rho == 1.0 and spec.share == 1000
    assert JobSpec(model_path="m").share == 1.0 and JobSpec(model_path="m", share=0.01).share == 0.01


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


@pytest.mark.parametrize(("k", "batch", "in_flight"), [(0, 16, 16), (1, 16, 32), (3, 5, 20), (64, 1, 65)])
def test_async_mode_bounds_groups_in_flight(k: int, batch: int, in_flight: int) -> None:
    spec = JobSpec(model_path="m", mode="async", max_staleness=k, prompts_per_step=batch)
    assert spec.staleness_bound == k
    assert spec.max_groups_in_flight == in_flight  # (k + 1) * batch


# -- bounds: a spec that validates can be stored and served ------------------------------------

# Bounded by their validator rather than the schema: a python reward's free JSON kwargs (at most
# 64 keys and 64 KiB as JSON, finite numbers: shared.rewards.spec.PythonReward._kwargs).
BOUNDED_BY_VALIDATOR = {("PythonReward", "kwargs")}


def _unbounded(where: str, prop: dict[str, Any]) -> list[str]:
    """Places in a JSON-schema property where a number, string, list or map has no upper bound."""
    out: list[str] = []
    for sub in prop.get("anyOf", []) + prop.get("oneOf", []):
        out += _unbounded(where, sub)
    t = prop.get("type")
    if t in ("number", "integer") and "maximum" not in prop and "exclusiveMaximum" not in prop:
        out.append(f"{where}: no maximum")
    if t == "string" and "enum" not in prop and "const" not in prop and "maxLength" not in prop:
        out.append(f"{where}: no maxLength")
    if t == "array":
        if "maxItems" not in prop:
            out.append(f"{where}: no maxItems")
        out += _unbounded(f"{where}[]", prop.get("items", {}))
    if t == "object" and isinstance(prop.get("additionalProperties"), dict):
        if "maxProperties" not in prop:
            out.append(f"{where}: no maxProperties")
        out += _unbounded(f"{where}{{}}", prop["additionalProperties"])
        out += _unbounded(f"{where}{{key}}", prop.get("propertyNames", {"type": "string", "maxLength": 0}))
    return out


def test_every_number_string_list_and_map_of_the_spec_is_bounded() -> None:
    schema = JobSpec.model_json_schema()
    models = {"JobSpec": schema, **schema.get("$defs", {})}
    problems = [
        p
        for model, sub in models.items()
        for name, prop in sub.get("properties", {}).items()
        if (model, name) not in BOUNDED_BY_VALIDATOR
        for p in _unbounded(f"{model}.{name}", prop)
    ]
    assert not problems, problems


@pytest.mark.parametrize("literal", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(
    "patch",
    [
        lambda x: {"algorithm": {"max_grad_norm": x}},
        lambda x: {"guard": {"min_best_reward": x}},
        lambda x: {"eval_sets": [{"name": "e", "pass_threshold": x}]},
        lambda x: {"chat_template_kwargs": {"t": x}},
        lambda x: {"task": {"name": "dataset", "path": "d.jsonl", "datasets": [], "test_fraction": x}},
    ],
)
def test_non_finite_numbers_are_refused_everywhere(literal: float, patch: Any) -> None:
    with pytest.raises(ValidationError):
        JobSpec.model_validate({"model_path": "m", **patch(literal)})


@pytest.mark.parametrize(
    "spec",
    [
        {"model_path": "m", "name": "a\nb"},
        {"model_path": "m\x1b[2J"},
        {"model_path": "m", "name": "a\u2028b"},
        {"model_path": "m", "task": {"name": "dataset", "path": "d\r.jsonl"}},
        {"model_path": "m", "reward": "evil\n.py:score"},
        {"model_path": "m", "reward": {"kind": "model", "path": "rm\x00"}},
    ],
)
def test_control_characters_in_names_and_paths_are_refused(spec: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        JobSpec.model_validate(spec)


def test_nul_anywhere_is_refused_with_its_location() -> None:
    spec = {"model_path": "m", "sampling": {"stop": ["ok", "a\x00"]}, "chat_template_kwargs": {"k\x00": 1}}
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate(spec)
    locs = {e["loc"] for e in err.value.errors()}
    assert locs == {("sampling", "stop", 1), ("chat_template_kwargs", "k\\u0000")}


def test_many_unknown_fields_are_one_error() -> None:
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate({"model_path": "m", **{f"k{i}": 0 for i in range(10_000)}})
    assert len(err.value.errors()) == 1
    assert "10000 unknown fields" in err.value.errors()[0]["msg"]
    with pytest.raises(ValidationError) as err:  # a few are each named
        JobSpec.model_validate({"model_path": "m", "lerning_rate": 1, "stepz": 2})
    assert [e["loc"] for e in err.value.errors()] == [("lerning_rate",), ("stepz",)]


def test_placement_defaults_to_split_and_colocated_is_sync() -> None:
    assert JobSpec(model_path="/m").placement == "split"
    co = JobSpec.model_validate({"model_path": "/m", "placement": "colocated"})
    assert co.mode == "sync" and co.staleness_bound == 0  # alternation: no mode given means sync
    assert JobSpec.model_validate({"model_path": "/m", "placement": "colocated", "mode": "sync"}).mode == "sync"
    with pytest.raises(ValidationError, match="placement colocated .* needs mode sync"):
        JobSpec.model_validate({"model_path": "/m", "placement": "colocated", "mode": "async"})
    with pytest.raises(ValidationError, match="adaptive_staleness"):
        JobSpec.model_validate(
            {"model_path": "/m", "placement": "colocated", "adaptive_staleness": {"k_min": 0, "k_max": 2}}
        )
    with pytest.raises(ValidationError, match="placement"):
        JobSpec.model_validate({"model_path": "/m", "placement": "shared"})
    # the stored form round-trips
    assert JobSpec.model_validate(co.model_dump(mode="json")) == co


# A spec as an older version stored it (by hand): a field since removed, a task field this version
# does not know, an lr above today's bound, an evaluation set whose name no longer validates.
OLD_STORED: dict[str, Any] = {
    "name": "old-job",
    "model_path": "/models/tiny",
    "mode": "async",
    "max_staleness": 2,
    "adaptive_staleness": {"k_min": 1, "k_max": 3},
    "group_size": 4,
    "prompts_per_step": 2,
    "seed": 7,
    "task": {"name": "arithmetic", "n_test": 10, "split_seed": 3},
    "algorithm": {"loss": "gspo", "lr": 2.0},
    "eval_sets": [{"name": "held_out"}, {"name": "no spaces allowed"}],
    "retired_knob": True,
}


def test_stored_spec_reads_a_stored_spec_with_jobspec_s_defaults() -> None:
    with pytest.raises(ValidationError):
        JobSpec.model_validate(OLD_STORED)  # what a service does: a spec that no longer validates never runs
    before = json.dumps(OLD_STORED)
    spec = stored_spec(OLD_STORED)
    assert json.dumps(OLD_STORED) == before  # the stored dict is not touched
    assert (spec.name, spec.mode, spec.seed, spec.group_size, spec.prompts_per_step) == ("old-job", "async", 7, 4, 2)
    assert spec.staleness_bound == 3 and spec.max_groups_in_flight == 8  # adaptive: k_max
    assert spec.task.n_test == 10 and spec.task.name == "arithmetic"
    # what did not validate is left out, its default applies, and the spec says it was not given
    assert spec.algorithm.loss == "gspo" and spec.algorithm.lr == AlgorithmSpec().lr
    assert "lr" not in spec.algorithm.model_fields_set and "loss" in spec.algorithm.model_fields_set
    assert [e.name for e in spec.eval_sets] == ["held_out"]
    assert {"retired_knob", "placement"}.isdisjoint(spec.model_fields_set)
    # a spec stored by this version reads exactly as the services validate it
    current = JobSpec(model_path="/m", group_size=4, task={"n_test": 5}).model_dump(mode="json")
    assert stored_spec(current) == JobSpec.model_validate(current)
    # the defaults are JobSpec's: nothing restated
    minimal = stored_spec({"model_path": "/m"})
    assert minimal == JobSpec(model_path="/m") and minimal.model_fields_set == {"model_path"}


def test_stored_spec_refuses_what_is_no_job_spec() -> None:
    for stored in ({}, {"mode": "sync"}, {"model_path": "/m", "placement": "colocated", "mode": "async"}):
        with pytest.raises(ValidationError):
            stored_spec(stored)


# --- strict types and storable text (issue 31) --------------------------------------------------


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("patch", "loc"),
    [
        ({"steps": True}, ("steps",)),
        ({"steps": "3"}, ("steps",)),
        ({"steps": 3.0}, ("steps",)),
        ({"group_size": "4"}, ("group_size",)),
        ({"seed": False}, ("seed",)),
        ({"guard": {"enabled": 1}}, ("guard", "enabled")),
        ({"algorithm": {"packing": "true"}}, ("algorithm", "packing")),
        ({"algorithm": {"lr": "1e-4"}}, ("algorithm", "lr")),
        ({"algorithm": {"betas": ["0.9", 0.99]}}, ("algorithm", "betas", 0)),
        ({"task": {"name": "dataset", "path": "d.jsonl", "max_rows": "10"}}, ("task", "max_rows")),
    ],
)
def test_integers_booleans_and_numbers_are_strict(patch: dict[str, Any], loc: tuple[Any, ...]) -> None:
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate({"model_path": "m", **patch})
    assert [e["loc"] for e in err.value.errors()] == [loc]
    # what stays valid: an integer where a float is asked, a JSON array for a pair
    spec = JobSpec.model_validate({"model_path": "m", "algorithm": {"lr": 1, "betas": [0.9, 0.99]}, "steps": 3})
    assert spec.algorithm.lr == 1.0 and spec.algorithm.betas == (0.9, 0.99)


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("patch", "loc", "kind"),
    [
        (
            {"reward": {"kind": "python", "function": "m:f", "kwargs": {"s": "\ud800"}}},
            ("reward", "kwargs", "s"),
            "surrogate",
        ),
        (
            {"environment": {"name": "tools", "kwargs": {"t": ["ok", "\udfff"]}}},
            ("environment", "kwargs", "t", 1),
            "surrogate",
        ),
        ({"chat_template_kwargs": {"k\ud800": 1}}, ("chat_template_kwargs", "k\\ud800"), "surrogate"),
        ({"task": {"system_prompt": "be \x1b[2J brief"}}, ("task", "system_prompt"), "control"),
        ({"sampling": {"stop": ["\x07"]}}, ("sampling", "stop", 0), "control"),
        (
            {"reward": {"kind": "python", "function": "m:f", "kwargs": {"s": "a\x85b"}}},
            ("reward", "kwargs", "s"),
            "control",
        ),
    ],
)
def test_text_that_cannot_be_stored_or_logged_is_refused_with_its_field(
    patch: dict[str, Any], loc: tuple[Any, ...], kind: str
) -> None:
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate({"model_path": "m", **patch})
    (e,) = err.value.errors()
    assert e["loc"] == loc and e["type"] == f"{kind}_character"
    assert format_validation_error(err.value)[0]["field"].encode("utf-8")  # the 422 body encodes
    # tab, newline and carriage return are text
    assert JobSpec.model_validate(
        {"model_path": "m", "task": {"system_prompt": "a\tb\r\nc"}, "sampling": {"stop": ["\n"]}}
    )


@pytest.mark.hostile
def test_a_model_path_that_is_not_a_directory_is_refused_before_any_load(tmp_path: Path) -> None:
    from shared.jobspec import local_model_dir

    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert local_model_dir(tmp_path) == tmp_path
    with pytest.raises(ValueError, match=r"model_path '.*model.safetensors' is a file on this machine: give the local"):
        local_model_dir(tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"model_path 'Qwen/Qwen2.5-0.5B' does not exist on this machine.*never downloaded"
    ):
        local_model_dir("Qwen/Qwen2.5-0.5B")  # a Hub id: refused, not fetched
