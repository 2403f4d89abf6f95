"""verifiers environments by module name (shared/vfenv.py), with verifiers 0.4 (`verifiers.v1`, the
`verifiers` extra) and the two tiny environment packages in tests/vf_envs (laid out as `vf init`
scaffolds them): the rows a task builds, the rubric as named reward terms (single-turn in the reward
scorer, multi-turn in the environment's episodes), the tools run through MCP in-process, the trace
stops, and the errors a spec gets."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from shared.datasets import load_task
from shared.environments import EpisodeLimits, load_environment, run_episode
from shared.jobspec import JobSpec, format_validation_error
from shared.rewards import build_scorer
from shared.rewards.base import RewardInput
from shared.vfenv import COLUMN, FAILED, VerifiersError, rubric_result, score_sample

pytest.importorskip("verifiers.v1")

REPO = Path(__file__).resolve().parents[2]
ENVS = REPO / "tests" / "vf_envs"
LIMITS = EpisodeLimits(max_turns=8, max_total_tokens=5000, step_timeout_s=10.0)


@pytest.fixture(autouse=True)
def _envs_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ENVS))


def spec(env: str, **task: Any) -> JobSpec:
    return JobSpec.model_validate({"model_path": "/m", "task": {"name": "verifiers", "env": env, **task}})


def spec_errors(task: dict[str, Any]) -> list[dict[str, Any]]:
    with pytest.raises(ValidationError) as exc:
        JobSpec.model_validate({"model_path": "/m", "task": task})
    return format_validation_error(exc.value)


# --- toy model and codec (one token per character) -------------------------------------------------


class Codec:
    def prompt_ids(self, opening: Any) -> list[int]:
        text = opening if isinstance(opening, str) else "\n".join(m["content"] for m in opening)
        return [ord(c) for c in text]

    def reply(self, messages: Any, model_ids: Any, role: str, text: str) -> tuple[dict[str, str], list[int]]:
        return {"role": role, "content": text}, [ord(c) for c in f"\n<{role}>{text}</{role}>\n"]

    def decode(self, ids: Any) -> str:
        return "".join(map(chr, ids))


def scripted(*turns: tuple[str, str]) -> Any:
    """generate() answering call k with turns[k] (text, finish reason); logprobs -0.5 each."""
    left = list(turns)

    async def generate(context: list[int], room: int) -> tuple[list[int], list[float], str]:
        text, finish = left.pop(0)
        ids = [ord(c) for c in text][:room]
        return ids, [-0.5] * len(ids), finish

    return generate


def play(problem: Any, *turns: tuple[str, str], job: JobSpec | None = None) -> Any:
    job = job or spec("vf_tiny_tools", args={"num_tasks": 6}, n_test=2)
    assert job.environment is not None
    row = {"prompt": problem.prompt, "answer": problem.answer, "metadata": dict(problem.metadata)}
    make = load_environment(job.environment)
    return asyncio.run(run_episode(make(), row, scripted(*turns), Codec(), LIMITS))


def call(name: str, **arguments: Any) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# --- rows -------------------------------------------------------------------------------------------


def test_a_task_by_module_name_builds_its_prompts_and_the_column_the_rubric_reads():
    job = spec("vf_tiny_reverse", args={"num_tasks": 12, "seed": 3}, n_test=4)
    assert job.reward == "verifiers" and job.environment is None  # no tools: an ordinary single-turn job
    train, test = load_task(job.task, seed=0)
    assert (len(train), len(test)) == (8, 4)
    p = train[0]
    assert p.messages is not None and p.messages[0] == {
        "role": "system",
        "content": "Reply with the letters in reverse order only.",
    }
    word = p.prompt.removeprefix("Reverse: ")
    info = p.metadata[COLUMN]
    assert info["env"] == "vf_tiny_reverse" and info["args"] == {"num_tasks": 12, "seed": 3}
    assert info["task"]["answer"] == word[::-1] and p.answer == ""  # answer_field null unless named
    assert not {q.prompt for q in train} & {q.prompt for q in test}
    assert load_task(job.task, seed=0) == (train, test) and load_task(job.task, seed=1) != (train, test)
    named = spec("vf_tiny_reverse", args={"num_tasks": 12}, n_test=4, answer_field="verifiers.task.answer")
    assert all(q.answer == q.metadata[COLUMN]["task"]["answer"] for q in load_task(named.task, 0)[0])


def test_eval_args_give_the_held_out_taskset():
    job = spec("vf_tiny_reverse", args={"num_tasks": 6, "seed": 0}, eval_args={"num_tasks": 3, "seed": 9}, n_test=3)
    train, test = load_task(job.task, seed=0)
    assert len(train) == 6 and [p.metadata[COLUMN]["args"]["seed"] for p in test] == [9, 9, 9]


# --- the rubric -------------------------------------------------------------------------------------


def test_rubric_result_is_the_weighted_sum_with_each_function_a_term():
    # 1.0 * 1.0 + 0.5 * 0.0 + 2.0 * 0.25 = 1.5
    r = rubric_result({"a": 1.0, "b": 0.0, "c": 0.25}, {"a": 1.0, "b": 0.5, "c": 2.0})
    assert r.reward == pytest.approx(1.5) and dict(r.components) == {"a": 1.0, "b": 0.0, "c": 0.25}


def test_a_single_turn_completion_is_scored_by_the_tasks_own_rubric_through_the_reward_scorer():
    job = spec("vf_tiny_reverse", args={"num_tasks": 6}, n_test=2)
    p = load_task(job.task, seed=0)[0][0]
    answer = p.metadata[COLUMN]["task"]["answer"]
    with build_scorer(job.reward) as scorer:
        got = scorer.score_sync(
            [
                RewardInput(prompt=p.prompt, completion=c, answer="", metadata=p.metadata)
                for c in (f" {answer} ", "x", answer + answer + "!", answer[::-1])
            ]
        )
    assert all(r.ok for r in got), got
    # reversed_exactly (weight 1) and short_reply (weight 0.5: at most twice the answer's length)
    assert [r.reward for r in got] == [1.5, 0.5, 0.0, 0.5]
    assert [dict(r.components) for r in got[:2]] == [
        {"reversed_exactly": 1.0, "short_reply": 1.0},
        {"reversed_exactly": 0.0, "short_reply": 1.0},
    ]


def test_the_reward_reads_an_episodes_scores_and_says_when_there_are_none():
    scored = {"tool_call": 0.5, "rubric_reward": 1.25, "rubric/correct": 1.0, "rubric/used_tool": 1.0}
    r = score_sample("31", {}, scored)
    assert r.reward == 1.25 and dict(r.components) == {"correct": 1.0, "used_tool": 1.0}
    with pytest.raises(VerifiersError, match="rubric raised while the generator scored"):
        score_sample("31", {}, {FAILED: 1.0})
    with pytest.raises(VerifiersError, match="runs in the environment 'verifiers'"):
        score_sample("31", {}, {"tool_call": 1.0})
    with pytest.raises(VerifiersError, match="metadata\\['verifiers'\\]"):
        score_sample("31", {"level": 1}, {})


# --- multi-turn: tools, stops, the last turn ---------------------------------------------------------


def tools_problem() -> tuple[Any, int, int]:
    p = load_task(spec("vf_tiny_tools", args={"num_tasks": 6}, n_test=2).task, seed=0)[0][0]
    return p, p.metadata[COLUMN]["task"]["a"], p.metadata[COLUMN]["task"]["b"]


def test_a_task_with_tools_plays_in_the_verifiers_environment_and_scores_its_whole_trace():
    job = spec("vf_tiny_tools", args={"num_tasks": 6}, n_test=2)
    assert job.environment is not None and job.environment.name == "verifiers"
    p, a, b = tools_problem()
    ep = play(p, (call("calc_add", a=a, b=b), "stop"), (str(a + b), "stop"))
    assert ep.stop_reason == "done" and ep.num_turns == 2
    reply = ep.turns[1]
    assert reply.kind == "env" and reply.text == str(a + b)  # the toolset's own add, run through MCP
    assert set(ep.mask) == {0, 1} and len(ep.mask) == len(ep.ids) == len(ep.logprobs)
    opening = Codec().decode(ep.prompt_ids)
    assert '"name": "calc_add"' in opening and '"name": "calc_negate"' in opening  # verifiers' names and schemas
    m = ep.metrics()
    # correct (weight 1) and used_tool (weight 0.25) from the task's own rewards, over the whole trace
    assert m["rubric_reward"] == 1.25 and m["rubric/correct"] == 1.0 and m["rubric/used_tool"] == 1.0
    assert m["tool_ok"] == 1.0 and m["tool_call"] == 0.5


def test_tool_errors_are_results_for_the_model_and_a_trace_stop_ends_the_episode():
    p, a, b = tools_problem()
    ep = play(
        p,
        (call("calc_add", a=a), "stop"),  # MCP's argument check: b is missing
        (call("abacus", x=1), "stop"),  # no such tool
        (call("calc_negate", x=a), "stop"),  # an async tool; the third tool message: enough_calls stops
        ("never", "stop"),
    )
    assert ep.stop_reason == "done" and ep.num_turns == 3
    texts = [t.text for t in ep.turns if t.kind == "env"]
    assert "Field required" in texts[0] and "unknown tool 'abacus'" in texts[1] and texts[2] == str(-a)
    m = ep.metrics()
    # used_tool looks for a calc_add tool message, which the failed call left in the trace
    assert m["tool_ok"] == pytest.approx(1 / 3) and m["rubric/used_tool"] == 1.0 and m["rubric/correct"] == 0.0


def test_a_malformed_call_is_answered_as_a_user_turn():
    p, _, _ = tools_problem()
    ep = play(p, ("<tool_call>{not json</tool_call>", "stop"), ("0", "stop"))
    assert ep.turns[1].text.startswith("error: the tool call is not valid JSON") and ep.messages[-2]["role"] == "user"


def test_the_turn_that_ends_an_episode_unstepped_is_the_reply_the_rubric_scores():
    p, a, b = tools_problem()
    ep = play(p, (str(a + b), "length"))  # cut by the engine: no step, but still the last message
    assert ep.stop_reason == "length" and ep.metrics()["rubric/correct"] == 1.0


# --- what a spec gets --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("task", "says"),
    [
        ({"env": "vf_no_such_env"}, "no verifiers environment 'vf_no_such_env' is installed here"),
        ({"env": "json"}, "is not a verifiers environment"),
        ({"env": "vf_tiny_reverse", "args": {"num_taks": 3}}, "refuses task.args"),
        ({"env": "vf_tiny_reverse", "args": {"num_tasks": 0}}, "has no tasks"),
        ({"env": "vf_tiny_reverse", "args": {"id": "x"}}, "task.args may not set id"),
        ({}, "task.env is required"),
        ({"env": "../x; rm"}, "String should match pattern"),
        ({"env": "vf_tiny_reverse", "path": "x.jsonl"}, "remove task.path"),
    ],
)
def test_a_spec_the_environment_refuses_is_an_error_saying_what_to_fix(task, says):
    errors = spec_errors({"name": "verifiers", **task})
    assert any(says in e["message"] for e in errors), errors


def test_verifiers_fields_on_another_task_are_refused():
    errors = spec_errors({"name": "arithmetic", "env": "vf_tiny_reverse"})
    assert "apply to task.name='verifiers' only" in errors[0]["message"]


REFUSED = {
    "multi-agent": (
        """
        class E(vf.Env[vf.SingleAgentEnvConfig]):
            async def run(self, task, agents): ...
        __all__ = ["T", "E"]
        """,
        "a multi-agent Env",
    ),
    "runtime reward": (
        """
        class K(vf.Task[vf.TaskData]):
            @vf.reward
            async def r(self, trace: vf.Trace, runtime: vf.Runtime) -> float: return 0.0
        """,
        "scores with a runtime",
    ),
    "response stop": (
        """
        class K(vf.Task[vf.TaskData]):
            @vf.reward
            async def r(self, trace: vf.Trace) -> float: return 0.0
            @vf.stop
            def s(self, response: vf.Response) -> bool: return False
        """,
        "reads a Response",
    ),
    "stateful toolset": (
        """
        class S(vf.State):
            n: int = 0
        class Tools(vf.Toolset[vf.ToolsetConfig, S]):
            @vf.tool
            def t(self) -> str: return ""
        class K(vf.Task[vf.TaskData]):
            @classmethod
            def toolsets(cls, config): return [Tools(vf.ToolsetConfig())]
            @vf.reward
            async def r(self, trace: vf.Trace) -> float: return 0.0
        """,
        "keeps a State of its own",
    ),
    "no reward": ("class K(vf.Task[vf.TaskData]): pass", "has no @vf.reward"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_this_project_does_not_run_is_refused_naming_it(case, tmp_path, monkeypatch):
    body, says = REFUSED[case]
    task = (
        "" if "class K" in body else textwrap.dedent(REFUSED["runtime reward"][0]).replace(", runtime: vf.Runtime", "")
    )
    name = f"vf_refused_{case.replace(' ', '_').replace('-', '_')}"
    source = (
        "import verifiers.v1 as vf\n"
        + textwrap.dedent(body)
        + "\n"
        + task
        + "\nclass T(vf.Taskset[K, vf.TasksetConfig]):\n    def load(self): return [K(vf.TaskData(prompt='q'))]\n"
    )
    if "__all__" not in source:
        source += '\n__all__ = ["T"]\n'
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    errors = spec_errors({"name": "verifiers", "env": name})
    assert any(says in e["message"] for e in errors), errors


def test_the_reward_imports_the_module_first_in_a_fresh_process():
    # a reward worker process imports shared.vfenv before anything of shared.environments (whose
    # registry imports it back): the import must not go round in a circle
    code = "import shared.vfenv, shared.environments; print(shared.environments.ENVIRONMENTS['verifiers'].__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "VerifiersEnv", out.stderr


def test_without_the_package_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # what `import verifiers.v1` meets when absent
    errors = spec_errors({"name": "verifiers", "env": "vf_tiny_reverse", "args": {"num_tasks": 5}})
    assert any("pip install 'asyncrl[verifiers]'" in e["message"] for e in errors), errors
