"""Rewards: the built-ins by name, the spec's shapes, user plug-ins by import path (a file outside
the project, sync/async/batched, kwargs, components), weighted sums, and the time budget: a reward
that hangs for good costs one budget, in worker processes (killed and replaced) and in threads
(abandoned)."""

from __future__ import annotations

import json
import textwrap
import time
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from shared.jobspec import JobSpec, format_validation_error
from shared.rewards import (
    KINDS,
    REWARD_FUNCTIONS,
    REWARDS,
    RewardInput,
    RewardLoadError,
    RewardResult,
    build_scorer,
    exact_match,
    get_reward_fn,
    math_verify,
)
from shared.rewards import spec as rspec


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("42", "42", 1.0),
        ("= 42", "42", 1.0),
        ("the sum is 40 then 42", "42", 1.0),  # the last number counts
        ("42 then 40", "42", 0.0),
        ("-7", "-7", 1.0),
        ("1,234", "1234", 1.0),
        ("42.0", "42", 1.0),
        ("", "42", 0.0),
        ("no number", "42", 0.0),
        ("4", "42", 0.0),
        # integer-exact: neighbours a float cannot tell apart score 0 (issue 31)
        ("12345678901234567890", "12345678901234567891", 0.0),
        ("x = 12345678901234567891", "12345678901234567891", 1.0),
        ("9007199254740993", "9007199254740992", 0.0),
        ("0.1", "0.10000000000000001", 0.0),
        ("3.50", "3.5", 1.0),
        ("1,234.0", "1234", 1.0),
    ],
)
def test_exact_match(completion, answer, expected):
    assert exact_match(completion, answer) == expected


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("The answer is $\\frac{1}{2}$", "0.5", 1.0),
        ("The answer is 42", "42", 1.0),
        ("so x = 3/4", "0.75", 1.0),
        ("The answer is 41", "42", 0.0),
        ("", "42", 0.0),
    ],
)
def test_math_verify(completion, answer, expected):
    assert math_verify(completion, answer) == expected


def test_reward_registry_by_name():
    assert get_reward_fn("exact_match") is exact_match
    assert set(REWARD_FUNCTIONS) == {
        "environment",
        "exact_match",
        "math_verify",
        "python_exec",
        "reasoning_gym",
        "verifiers",
    }
    assert tuple(REWARD_FUNCTIONS) == REWARDS  # the spec's names are the functions'
    with pytest.raises(
        ValueError,
        match="unknown reward function 'f1'; valid: \\['environment', 'exact_match', 'math_verify', 'python_exec', "
        "'reasoning_gym', 'verifiers'\\]",
    ):
        get_reward_fn("f1")


def test_kind_registry_and_spec_union_name_the_same_kinds():
    tags = {typing.get_args(a)[1].tag for a in typing.get_args(rspec.RewardObject)}
    assert tags == set(rspec.KINDS) == set(KINDS)


# --- the spec's shapes -------------------------------------------------------------------------

EXAMPLES = [
    "exact_match",
    "my_rewards:score",
    "path/to/my_rewards.py:score",
    {"kind": "builtin", "name": "python_exec", "timeout_s": 20},
    {"kind": "python", "function": "my_rewards:score", "kwargs": {"scale": 2}, "on_failure": "drop"},
    {"kind": "python", "function": "/abs/rw.py:Scorer.batch", "batched": True, "batch_size": 32},
    {
        "kind": "sum",
        "terms": [
            {"name": "correct", "weight": 1.0, "reward": "exact_match"},
            {
                "name": "format",
                "weight": 0.2,
                "reward": {"kind": "python", "function": "my_rewards:fmt", "timeout_s": 5},
            },
            {
                "name": "nested",
                "weight": 0.5,
                "reward": {"kind": "sum", "terms": [{"name": "x", "reward": "math_verify"}]},
            },
        ],
    },
    {"kind": "http", "url": "http://scorer:8080/score", "batch_size": 16, "retries": 3, "timeout_s": 10},
    {
        "kind": "judge",
        "base_url": "http://judge:8000/v1",
        "model": "judge",
        "rule": "yes_no",
        "template": "Is {completion} the answer to {prompt} ({answer}, {metadata[id]})? yes or no",
    },
    {"kind": "model", "path": "/models/rm", "batch_size": 16},
]


@pytest.mark.parametrize("reward", EXAMPLES, ids=lambda r: r if isinstance(r, str) else r["kind"])
def test_every_shape_validates_and_round_trips_through_the_job_spec(reward):
    spec = JobSpec(model_path="m", reward=reward)
    dumped = json.loads(spec.model_dump_json())
    assert JobSpec.model_validate(dumped) == spec
    if isinstance(reward, str):
        assert dumped["reward"] == reward  # a bare string stays what the user wrote
    else:
        assert {k: dumped["reward"][k] for k in reward if k != "terms"} == {
            k: v for k, v in reward.items() if k != "terms"
        }


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        (
            "bleu",
            "unknown reward 'bleu': give a built-in name (environment, exact_match, math_verify, python_exec, "
            "reasoning_gym, verifiers)",
        ),
        ("my rewards:score", "unknown reward"),
        ({"kind": "bleu"}, "'kind' is one of: builtin, python, sum, http, judge, model"),
        ({"name": "exact_match"}, "'kind' is one of"),
        ({"kind": "python", "function": "no_colon"}, "is not an import path 'package.module:function'"),
        ({"kind": "python", "function": "m:f", "kwargs": {"answer": 1}}, "is a sample input"),
        ({"kind": "python", "function": "m:f", "bogus": 1}, "Extra inputs are not permitted"),
        ({"kind": "builtin", "name": "exact_match", "timeout_s": 0}, "greater than 0"),
        ({"kind": "sum", "terms": []}, "at least 1 item"),
        (
            {"kind": "sum", "terms": [{"name": "a", "reward": "exact_match"}, {"name": "a", "reward": "math_verify"}]},
            "term names must be unique",
        ),
        (
            {
                "kind": "sum",
                "terms": [{"name": "a", "reward": {"kind": "builtin", "name": "exact_match", "on_failure": "drop"}}],
            },
            "set it on the sum",
        ),
        (
            {"kind": "judge", "base_url": "http://j/v1", "model": "m", "template": "{reply}"},
            "template field {reply} is unknown",
        ),
        ({"kind": "judge", "base_url": "http://j/v1", "model": "m", "template": "{"}, "write literal braces as {{"),
        ({"kind": "judge", "base_url": "http://j/v1", "model": "m", "rule": "maybe"}, "'number' or 'yes_no'"),
        ({"kind": "http", "url": "ftp://x"}, "should match pattern"),
        ({"kind": "model", "path": "/m", "template": "{metadata}"}, "template fields ['metadata'] are unknown"),
    ],
)
def test_invalid_specs_say_what_to_fix(reward, message):
    with pytest.raises(ValidationError) as err:
        JobSpec(model_path="m", reward=reward)
    assert message in str(err.value)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.sampled_from(["exact_match", "m:f", "{prompt}", "{", "sum", "python", "http://x/v1"]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "kind",
                    "name",
                    "function",
                    "terms",
                    "reward",
                    "weight",
                    "template",
                    "kwargs",
                    "timeout_s",
                    "on_failure",
                    "url",
                    "x",
                ]
            )
            | st.text(max_size=6),
            inner,
            max_size=4,
        )
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.sampled_from([e for e in EXAMPLES if isinstance(e, dict)]),
    edits=st.dictionaries(
        st.sampled_from(
            [
                "kind",
                "name",
                "function",
                "terms",
                "weight",
                "template",
                "kwargs",
                "timeout_s",
                "on_failure",
                "url",
                "rule",
                "bogus",
            ]
        ),
        json_values,
        max_size=3,
    ),
    whole=json_values,
)
def test_any_reward_json_is_a_spec_or_a_readable_error(base, edits, whole):
    for reward in ({**base, **edits}, whole):
        try:
            spec = JobSpec(model_path="m", reward=reward)
        except ValidationError as exc:
            out = format_validation_error(exc)
            assert out and all(e["message"] and e["field"].startswith("reward") for e in out)
            json.dumps(out)
            continue
        assert JobSpec.model_validate(json.loads(spec.model_dump_json())) == spec


def test_bare_names_mean_builtin_or_python_objects():
    assert rspec.as_object("exact_match") == rspec.BuiltinReward(name="exact_match")
    assert rspec.as_object("pkg.mod:fn") == rspec.PythonReward(function="pkg.mod:fn")


# --- python plug-ins -----------------------------------------------------------------------------

PLUGIN = textwrap.dedent(
    """
    import asyncio
    import os
    import time

    def plain(completion, answer):
        return 1.0 if completion == answer else 0.0

    def everything(completion: str, answer: str, *, prompt: str, metadata: dict, finish_reason, scale: float = 1.0):
        return scale * (len(prompt) + len(completion) + metadata["bonus"]) + (finish_reason == "stop")

    def takes_any(c, a, **kw):
        return {"keys": float(len(kw)), "scale": kw.get("scale", 0.0)}

    async def asynchronous(completion, answer, *, metadata):
        await asyncio.sleep(0.01)
        return float(metadata["x"])

    def batch(completions, answers, *, prompts, scale=1.0):
        return [scale * len(c) for c in completions]

    def short_batch(completions, answers):
        return [1.0]

    def components(completion, answer):
        return {"correct": float(completion == answer), "brevity": -0.01 * len(completion)}

    def raises(completion, answer):
        raise ValueError(f"cannot score {completion!r}")

    def returns_text(completion, answer):
        return "high"

    def hangs(completion, answer):
        if completion == "hang":
            time.sleep(10**6)
        return 1.0

    def spins(completion, answer):
        while completion == "hang":
            pass
        return 1.0

    async def hangs_async(completion, answer):
        if completion == "hang":
            await asyncio.sleep(10**6)
        return 1.0

    def dies(completion, answer):
        if completion == "die":
            os._exit(3)
        return 1.0

    def prints(completion, answer):
        print("noise on stdout must not break the worker protocol")
        return 2.0

    def one_arg(completion):
        return 0.0

    not_callable = 3
    """
)


@pytest.fixture
def plugin(tmp_path) -> str:
    """A reward module in a directory outside the project (and outside sys.path)."""
    path = tmp_path / "elsewhere" / "my_rewards.py"
    path.parent.mkdir()
    path.write_text(PLUGIN)
    return str(path)


def item(completion: str = "42", answer: str = "42", **kw) -> RewardInput:
    return RewardInput(prompt=kw.pop("prompt", "p?"), completion=completion, answer=answer, **kw)


def score(spec, items, workers=0) -> list[RewardResult]:
    with build_scorer(spec, workers=workers) as scorer:
        return scorer.score_sync(items)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_sync_function_from_a_file_gets_the_inputs_its_signature_names(plugin, workers):
    md = {"bonus": 100}
    (r,) = score(
        {"kind": "python", "function": f"{plugin}:everything", "kwargs": {"scale": 2.0}},
        [item("abc", prompt="pp", metadata=md, finish_reason="stop")],
        workers,
    )
    assert r == RewardResult(reward=2.0 * (2 + 3 + 100) + 1)
    (r,) = score(f"{plugin}:plain", [item("42", "42")], workers)  # the bare string form
    assert r.reward == 1.0
    (r,) = score({"kind": "python", "function": f"{plugin}:takes_any", "kwargs": {"scale": 3}}, [item()], workers)
    # **kwargs: every input (prompt, metadata, finish_reason, episode) plus the spec's kwarg
    assert r.components == {"keys": 5.0, "scale": 3.0} and r.reward == 8.0


@pytest.mark.parametrize("workers", [0, 1])
def test_the_environment_reward_is_the_episodes_own(workers):
    episode = {"ok": 1.0, "reward": 0.75}
    results = score(
        {"kind": "builtin", "name": "environment"}, [item(episode=episode), item()], workers
    )  # the second: single-turn, no episode
    assert [r.reward for r in results] == [0.75, 0.0]
    # weighted with a verifier: the environment's view added to exact match
    (r,) = score(
        {
            "kind": "sum",
            "terms": [
                {"name": "verifier", "reward": "exact_match"},
                {"name": "env", "reward": "environment", "weight": 0.5},
            ],
        },
        [item("42", "42", episode=episode)],
        workers,
    )
    assert r.reward == pytest.approx(1.0 + 0.375)


def test_a_module_on_the_path_loads_in_worker_processes_too(plugin, monkeypatch):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(plugin).parent))
    assert score("my_rewards:plain", [item("1", "1"), item("1", "2")], workers=1) == [
        RewardResult(reward=1.0),
        RewardResult(reward=0.0),
    ]


def test_async_and_batched_functions(plugin):
    results = score(
        {"kind": "python", "function": f"{plugin}:asynchronous"}, [item(metadata={"x": i}) for i in range(5)]
    )
    assert [r.reward for r in results] == [0.0, 1.0, 2.0, 3.0, 4.0]
    texts = ["a", "bb", "ccc", "dddd", "eeeee"]
    for workers in (0, 1):
        results = score(
            {
                "kind": "python",
                "function": f"{plugin}:batch",
                "batched": True,
                "batch_size": 2,
                "kwargs": {"scale": 10},
            },
            [item(t) for t in texts],
            workers,
        )
        assert [r.reward for r in results] == [10.0, 20.0, 30.0, 40.0, 50.0]
    short = score({"kind": "python", "function": f"{plugin}:short_batch", "batched": True}, [item(), item()])
    assert [r.status for r in short] == ["error", "error"]
    assert "returned 1 values for 2 samples" in short[0].reason


@pytest.mark.parametrize("workers", [0, 1])
def test_failures_are_results_with_the_reason(plugin, workers):
    (r,) = score(f"{plugin}:raises", [item("x")], workers)
    assert r.status == "error" and r.reward is None
    line = PLUGIN.splitlines().index('    raise ValueError(f"cannot score {completion!r}")') + 1
    assert r.reason == f"{plugin}:raises: ValueError: cannot score 'x' (at my_rewards.py:{line} in raises)"
    (r,) = score(f"{plugin}:returns_text", [item()], workers)
    assert r.status == "error" and "returned 'high' (str); expected a number" in r.reason
    (r,) = score(f"{plugin}:prints", [item()], workers)
    assert r.reward == 2.0


def test_a_worker_that_dies_is_the_sample_error_and_is_replaced(plugin):
    with build_scorer(f"{plugin}:dies", workers=1) as scorer:
        results = scorer.score_sync([item("die"), item("ok")])
        assert results[0].status == "error" and "the reward worker died (exit code 3)" in results[0].reason
        assert results[1].reward == 1.0
        assert scorer.runner.restarts == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("{dir}/missing.py:plain", "file '{dir}/missing.py' does not exist"),
        ("{plugin}:absent", "'{plugin}' has no attribute 'absent'"),
        ("{plugin}:not_callable", "is int, not callable"),
        ("{plugin}:one_arg", "cannot be called as one_arg(completion, answer)"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz': ModuleNotFoundError"),
        ("{dir}/broken.py:f", "importing '{dir}/broken.py' failed: ZeroDivisionError: division by zero"),
    ],
)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_plugin_that_does_not_load_fails_the_build_naming_what_failed(plugin, function, message, workers):
    d = plugin.rsplit("/", 1)[0]
    (__import__("pathlib").Path(d) / "broken.py").write_text("x = 1 / 0\n")
    with pytest.raises(RewardLoadError) as err:
        build_scorer(function.format(dir=d, plugin=plugin), workers=workers)
    assert message.format(dir=d, plugin=plugin) in str(err.value)
    with pytest.raises(RewardLoadError, match="got an unexpected keyword argument 'nope'"):
        build_scorer({"kind": "python", "function": f"{plugin}:plain", "kwargs": {"nope": 1}})


# --- time budgets --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("function", "workers", "says"),
    [
        ("hangs", 1, "the reward worker was killed and replaced"),
        ("spins", 1, "the reward worker was killed and replaced"),
        ("hangs", 0, "its thread was abandoned"),
        ("hangs_async", 0, "cancelled"),
    ],
)
def test_a_reward_that_never_returns_costs_one_budget(plugin, function, workers, says):
    budget = 1.5
    batch = [item("a"), item("hang"), item("b"), item("c")]
    with build_scorer(
        {"kind": "python", "function": f"{plugin}:{function}", "timeout_s": budget}, workers=workers
    ) as scorer:
        t0 = time.monotonic()
        results = scorer.score_sync(batch)
        took = time.monotonic() - t0
        assert [r.status for r in results] == ["ok", "timeout", "ok", "ok"]
        assert says in results[1].reason and "time budget of 1.5 s" in results[1].reason
        assert budget <= took < budget + 5  # + a replacement worker's start on a busy box
        t0 = time.monotonic()
        assert [r.reward for r in scorer.score_sync(batch[:1] + batch[2:])] == [1.0, 1.0, 1.0]
        assert time.monotonic() - t0 < 5  # the next batch is not stuck behind the hung call


def test_on_failure_zero_or_drop():
    timeout = RewardResult(reward=None, status="timeout", reason="slow")
    ok = RewardResult(reward=0.5)
    with build_scorer({"kind": "builtin", "name": "exact_match"}) as zero:
        assert zero.on_failure == "zero" and zero.reward_for(timeout) == 0.0 and zero.reward_for(ok) == 0.5
    with build_scorer({"kind": "builtin", "name": "exact_match", "on_failure": "drop"}) as drop:
        assert drop.reward_for(timeout) is None and drop.reward_for(ok) == 0.5


# --- built-ins through the runners, sums -----------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 1])
def test_builtins_run_in_threads_and_workers(workers):
    # math-verify's own limits use SIGALRM, which a thread may not set: they are off there.
    results = score(
        {
            "kind": "sum",
            "terms": [
                {"name": "math", "reward": "math_verify"},
                {"name": "code", "reward": "python_exec"},
            ],
        },
        [item("```python\nprint(6 * 7)\n```\nso $42$", "42"), item("41", "42")],
        workers,
    )
    assert results[0] == RewardResult(reward=2.0, components={"math": 1.0, "code": 1.0})
    assert results[1] == RewardResult(reward=0.0, components={"math": 0.0, "code": 0.0})


def test_sum_weights_terms_and_logs_each_with_its_components(plugin):
    spec = {
        "kind": "sum",
        "terms": [
            {"name": "correct", "weight": 1.0, "reward": "exact_match"},
            {"name": "style", "weight": 0.5, "reward": f"{plugin}:components"},
            {
                "name": "inner",
                "weight": -2.0,
                "reward": {"kind": "sum", "terms": [{"name": "a", "weight": 3.0, "reward": f"{plugin}:plain"}]},
            },
        ],
    }
    (r,) = score(spec, [item("42", "42")], workers=1)
    style = 1.0 - 0.02  # correct 1.0 + brevity -0.01 * 2
    assert r.components == pytest.approx(
        {"correct": 1.0, "style": style, "style/correct": 1.0, "style/brevity": -0.02, "inner": 3.0, "inner/a": 1.0}
    )
    assert r.reward == pytest.approx(1.0 + 0.5 * style - 2.0 * 3.0)

    failing = {
        "kind": "sum",
        "terms": [
            {"name": "correct", "reward": "exact_match"},
            {"name": "bad", "reward": f"{plugin}:raises"},
            {"name": "slow", "reward": {"kind": "python", "function": f"{plugin}:hangs", "timeout_s": 0.5}},
        ],
    }
    (r,) = score(failing, [item("hang")])
    assert r.status == "timeout" and r.reward is None  # a timeout among the failures: the sample timed out
    assert r.reason.startswith("term 'bad': ") and "; term 'slow': " in r.reason


def test_the_json_form_is_validated():
    with pytest.raises(ValidationError):
        build_scorer({"kind": "python"})
    assert TypeAdapter(rspec.RewardSpec).validate_python("exact_match") == "exact_match"
