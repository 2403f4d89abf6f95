"""The job API's OpenAPI documents every answer: each route's 2xx body has a schema that names its
fields (not `{}`, not a free-form object), and each error answer is the `{"error": ...}` shape.

No I/O: the app is built on an unmigrated in-memory ledger and its Redis client connects lazily.
"""

from __future__ import annotations

from typing import Any

import pytest

from broker.api import create_app
from broker.ledger import Ledger
from shared.settings import BrokerSettings

JSON = "application/json"


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    app = create_app(BrokerSettings(redis_url="redis://127.0.0.1:6379/0"), ledger=Ledger("sqlite://", migrate=False))
    return app.openapi()


def operations(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method.upper(), path, op) for path, ops in spec["paths"].items() for method, op in ops.items()]


def resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        name = schema["$ref"].removeprefix("#/components/schemas/")
        schema = spec["components"]["schemas"][name]
    return schema


def undocumented(spec: dict[str, Any], schema: dict[str, Any]) -> str | None:
    """Why a JSON body schema does not say what the body holds, or None when it does."""
    schema = resolve(spec, schema)
    if schema.get("type") == "array":
        return undocumented(spec, schema.get("items") or {})
    if schema.get("type") == "object" and schema.get("properties"):
        return None
    return f"no named fields: {schema}"


def test_the_check_tells_a_model_from_a_free_form_body(spec: dict[str, Any]) -> None:
    assert undocumented(spec, {}) is not None
    assert undocumented(spec, {"type": "object", "additionalProperties": True}) is not None
    assert undocumented(spec, {"type": "array", "items": {"type": "object", "additionalProperties": True}})
    assert undocumented(spec, {"$ref": "#/components/schemas/ErrorBody"}) is None


def test_every_route_documents_its_2xx_body(spec: dict[str, Any]) -> None:
    problems = []
    for method, path, op in operations(spec):
        answers = {code: r for code, r in op["responses"].items() if code.startswith("2")}
        if not answers:
            problems.append(f"{method} {path}: no 2xx answer")
        for code, answer in answers.items():
            content = answer.get("content") or {}
            if not content:
                problems.append(f"{method} {path} {code}: no content")
            for media, body in content.items():
                schema = body.get("schema") or {}
                why = undocumented(spec, schema) if media == JSON else (None if schema.get("type") else "no type")
                if why:
                    problems.append(f"{method} {path} {code} {media}: {why}")
    assert not problems, "\n".join(problems)


def test_every_error_answer_is_documented_as_an_error_body(spec: dict[str, Any]) -> None:
    problems = []
    for method, path, op in operations(spec):
        for code, answer in op["responses"].items():
            if code.startswith("2"):
                continue
            # Under the route's media type (FastAPI's choice): text/html for the status page.
            for media, body in (answer.get("content") or {"none": {}}).items():
                schema = resolve(spec, body.get("schema") or {})
                if "error" not in schema.get("required", ()):
                    problems.append(f"{method} {path} {code} {media}: {schema}")
    assert not problems, "\n".join(problems)


def test_job_routes_document_the_answers_they_give(spec: dict[str, Any]) -> None:
    ops = {(method, path): op for method, path, op in operations(spec)}
    for key, codes in {
        ("GET", "/jobs/{job_id}"): {"200", "401", "404", "422", "503"},
        ("POST", "/jobs/{job_id}/pause"): {"202", "401", "403", "404", "409", "422", "503"},
        ("PATCH", "/jobs/{job_id}"): {"200", "401", "403", "404", "409", "422", "503"},
        ("POST", "/jobs/{job_id}/checkpoints/{step}/export"): {"200", "202", "401", "403", "404", "422", "503"},
    }.items():
        assert codes <= set(ops[key]["responses"]), key
    invalid = resolve(spec, ops[("POST", "/jobs")]["responses"]["422"]["content"][JSON]["schema"])
    assert {"error", "fields", "more_errors"} <= set(invalid["properties"])
    assert "WWW-Authenticate" in ops[("GET", "/jobs")]["responses"]["401"]["headers"]
    status = resolve(spec, ops[("GET", "/jobs/{job_id}")]["responses"]["200"]["content"][JSON]["schema"])
    assert set(status["properties"]) == {
        "id",
        "name",
        "state",
        "step",
        "error",
        "created_at",
        "started_at",
        "spec",
        "last_metrics",
        "evals",
        "samples",
        "staleness",
        "reward_errors",
        "drop_skew",
        "generators",
        "usage",
    }
    usage = resolve(spec, status["properties"]["usage"])
    assert {"generator_seconds", "samples", "prompt_tokens", "completion_tokens", "by_generator", "adapters"} <= set(
        usage["properties"]
    )
