"""Rewards written for verl, TRL and verifiers, called as those frameworks call them
(shared.rewards.conventions): the arguments each receives, the return types each may give, batching,
recognition from the signature, and errors that name the convention. Hand-computed numbers; each
in threads and in worker processes (the msgpack path)."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from shared.rewards import RewardInput, RewardLoadError, RewardResult, build_scorer
from shared.rewards.conventions import PlainParser, recognise
from shared.rewards.spec import RewardSpec

VERL = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # reward = 1 if the completion is one of the ground truths, plus extra_info's index / 10
    hit = solution_str.strip() in (ground_truth if isinstance(ground_truth, list) else [ground_truth])
    return {"score": float(hit) + extra_info["index"] / 10, "acc": hit, "pred": solution_str,
            "source_len": len(data_source)}

def plain(data_source, solution_str, ground_truth, extra_info=None):
    return 0.5 if data_source is None and extra_info is None else 2.0

def gives_list(data_source, solution_str, ground_truth, extra_info=None):
    return [1.0]

def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}

def old_style(data_source, solution_str, ground_truth):
    return 1.0
"""

TRL = """
CALLS = []

def accuracy(completions, solution, **kwargs):
    CALLS.append(len(completions))
    contents = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [None if s is None else float(c == s) for c, s in zip(contents, solution)]

def seen(prompts, completions, completion_ids, level, **kwargs):
    # 10 * level + the number of completion tokens + 100 if the prompt is a conversation
    return [10 * lv + len(ids) + (100 if isinstance(p, list) else 0)
            for p, ids, lv in zip(prompts, completion_ids, level)]

def short(completions, **kwargs):
    return [1.0] * (len(completions) - 1)

def no_completions(prompts):
    return []
"""

VERIFIERS = """
def correct(parser, completion, answer):
    return 1.0 if parser.parse_answer(completion) == answer else 0.0

def short(completion, **kwargs):
    text = completion[-1]["content"] if isinstance(completion, list) else completion
    return 1.0 / (1 + len(text))

def uses_info(info, task, state):
    return info["index"] + (10 if task == "default" else 20) + 100 * state["turn"]

def bad(completion):
    return "high"

RUBRIC = [correct, short]

class Rubric:
    def __init__(self, funcs, weights, parser=None):
        self.reward_funcs, self.reward_weights, self.parser = funcs, weights, parser

class Upper:
    def parse_answer(self, completion):
        return completion[-1]["content"].upper()

UPPER_RUBRIC = Rubric([correct], [2.0], parser=Upper())
"""


@pytest.fixture(scope="module")
def plugins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("conventions")
    for name, text in (("verl_reward", VERL), ("trl_reward", TRL), ("vf_rubric", VERIFIERS)):
        (d / f"{name}.py").write_text(textwrap.dedent(text))
    return d


def _score(spec: Any, items: list[RewardInput], workers: int = 0) -> list[RewardResult]:
    with build_scorer(spec, workers=workers) as scorer:
        return scorer.score_sync(items)


VERL_ROW = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": "2+3="}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": ["5", "five"]},
    "extra_info": {"split": "train", "index": 3},
}


@pytest.mark.parametrize("workers", [0, 1])
def test_verl_compute_score_gets_verls_arguments_and_its_dict_is_read_as_verl_reads_it(plugins, workers):
    spec = {"kind": "python", "function": f"{plugins}/verl_reward.py:compute_score", "convention": "verl"}
    items = [
        RewardInput(prompt="2+3=", completion=" five", answer="5", metadata=VERL_ROW),
        RewardInput(prompt="2+3=", completion="6", answer="5", metadata=VERL_ROW),
    ]
    got = _score(spec, items, workers)
    # hit: 1 + 3/10 = 1.3 (ground_truth is the stored list, " five".strip() is in it); miss: 0 + 0.3.
    # 'score' is the reward; acc (a bool) and source_len (len("openai/gsm8k") = 12) are components;
    # pred (text) is not a number and is left out.
    assert got == [
        RewardResult(1.3, components={"acc": 1.0, "source_len": 12.0}),
        RewardResult(0.3, components={"acc": 0.0, "source_len": 12.0}),
    ]


def test_verl_without_the_rows_columns_gets_none_and_the_task_answer(plugins):
    spec = {"kind": "python", "function": f"{plugins}/verl_reward.py:plain"}  # recognised: verl
    assert _score(spec, [RewardInput(prompt="p", completion="c", answer="5")]) == [RewardResult(0.5)]


@pytest.mark.parametrize(
    "function,reason",
    [
        ("gives_list", "verl convention: gives_list returned list [1.0]; expected a float or a dict with 'score'"),
        ("no_score", "verl convention: no_score returned a dict without 'score' (keys: acc)"),
    ],
)
def test_verl_return_errors_name_the_convention(plugins, function, reason):
    (r,) = _score(f"{plugins}/verl_reward.py:{function}", [RewardInput("p", "c", "a", metadata=VERL_ROW)])
    assert r.status == "error" and r.reason.startswith(reason), r.reason


def test_verl_signature_that_verl_cannot_call_fails_the_build(plugins):
    with pytest.raises(RewardLoadError, match=r"verl convention: .*cannot be called as verl calls it.*extra_info"):
        build_scorer({"kind": "python", "function": f"{plugins}/verl_reward.py:old_style", "convention": "verl"})


TRL_ROWS = [
    {"prompt": [{"role": "user", "content": "2+3="}], "solution": "5", "level": 1},
    {"prompt": [{"role": "user", "content": "2+2="}], "solution": "4", "level": 2},
    {"prompt": [{"role": "user", "content": "1+1="}], "solution": None, "level": 3},
]


@pytest.mark.parametrize("workers", [0, 1])
def test_trl_reward_func_is_called_once_per_batch_with_messages_and_columns(plugins, workers):
    spec = {"kind": "python", "function": f"{plugins}/trl_reward.py:accuracy", "batch_size": 2}
    items = [
        RewardInput(prompt=r["prompt"][0]["content"], completion=c, answer="", metadata=r)
        for r, c in zip(TRL_ROWS, ["5", "5", "2"], strict=True)
    ]
    # conversational: completions are [{"role": "assistant", "content": c}]; "5"=="5" 1, "5"!="4" 0;
    # solution None -> the function returns None -> 0.0 (TRL's nansum)
    assert _score(spec, items, workers) == [RewardResult(1.0), RewardResult(0.0), RewardResult(0.0)]
    if workers == 0:  # in this process: the module's record of its calls (batches of 2, then 1)
        import sys

        (module,) = [m for n, m in sys.modules.items() if n.startswith("asyncrl_reward_trl_reward_")]
        assert module.CALLS[-2:] == [2, 1]


@pytest.mark.parametrize("workers", [0, 1])
def test_trl_gets_prompts_as_stored_and_completion_ids(plugins, workers):
    spec = {"kind": "python", "function": f"{plugins}/trl_reward.py:seen", "convention": "trl"}
    chat = RewardInput("x", "ab", "", metadata=TRL_ROWS[1], completion_ids=[7, 8, 9])
    text = RewardInput("1+1=", "ab", "", metadata={"prompt": "1+1=", "level": 4}, completion_ids=[7])
    # 10*2 + 3 ids + 100 (a conversation) = 123; 10*4 + 1 id + 0 (text) = 41
    assert _score(spec, [chat], workers) == [RewardResult(123.0)]
    assert _score(spec, [text], workers) == [RewardResult(41.0)]


def test_trl_errors_name_the_convention(plugins):
    items = [RewardInput("p", "c", "", metadata={"prompt": "p"})] * 2
    (r, _) = _score({"kind": "python", "function": f"{plugins}/trl_reward.py:short", "convention": "trl"}, items)
    assert r.status == "error"
    assert r.reason.startswith("trl convention: short returned 1 values for 2 completions"), r.reason
    with pytest.raises(
        RewardLoadError, match="trl convention: .*takes no \\*\\*kwargs nor completions, completion_ids"
    ):
        build_scorer({"kind": "python", "function": f"{plugins}/trl_reward.py:no_completions", "convention": "trl"})


CHAT_ROW = {"prompt": [{"role": "user", "content": "2+3="}], "answer": "5", "info": {"index": 4}}


@pytest.mark.parametrize("workers", [0, 1])
def test_verifiers_rubric_functions_each_a_weighted_term(plugins, workers):
    spec = {"kind": "python", "function": f"{plugins}/vf_rubric.py:RUBRIC", "weights": [1.0, 0.5]}
    items = [RewardInput("2+3=", "5", "5", metadata=CHAT_ROW), RewardInput("2+3=", "55", "5", metadata=CHAT_ROW)]
    # "5": correct 1.0 (the plain parser's answer is the assistant message), short 1/(1+1) = 0.5:
    #      1.0 * 1.0 + 0.5 * 0.5 = 1.25
    # "55": correct 0.0, short 1/3: 0.5 / 3
    got = _score(spec, items, workers)
    assert got[0] == RewardResult(1.25, components={"correct": 1.0, "short": 0.5})
    assert got[1].reward == pytest.approx(0.5 / 3) and got[1].components == {"correct": 0.0, "short": 1 / 3}


def test_verifiers_rubric_object_brings_its_weights_and_parser(plugins):
    spec = {"kind": "python", "function": f"{plugins}/vf_rubric.py:UPPER_RUBRIC"}
    # the rubric's parser upper-cases: "a" -> "A" == answer "A": 1.0, weight 2.0
    assert _score(spec, [RewardInput("q", "a", "A", metadata=CHAT_ROW)]) == [
        RewardResult(2.0, components={"correct": 1.0})
    ]


def test_verifiers_info_task_and_state(plugins):
    spec = {"kind": "python", "function": f"{plugins}/vf_rubric.py:uses_info"}  # recognised: info, state, task
    # info = the row's info column {"index": 4}: 4 + 10 (task "default") + 100 * turn 1 = 114
    assert _score(spec, [RewardInput("q", "a", "5", metadata=CHAT_ROW)]) == [
        RewardResult(114.0, components={"uses_info": 114.0})
    ]
    # no info column: info is the row's other columns; task from its task column: 7 + 20 + 100 = 127
    row = {"index": 7, "task": "math"}
    assert _score(spec, [RewardInput("q", "a", "5", metadata=row)])[0].reward == 127.0


def test_verifiers_errors_name_the_convention_and_the_function(plugins):
    spec = {"kind": "python", "function": f"{plugins}/vf_rubric.py:bad", "convention": "verifiers"}
    (r,) = _score(spec, [RewardInput("q", "a", "5")])
    assert (
        r.status == "error"
        and r.reason == "verifiers convention: rubric function 'bad' returned 'high'; expected a float"
    )
    with pytest.raises(RewardLoadError, match="verifiers convention: .* has 2 reward functions but 1 weights"):
        build_scorer({"kind": "python", "function": f"{plugins}/vf_rubric.py:RUBRIC", "weights": [1.0]})


def test_plain_parser_reads_the_last_assistant_turn():
    p = PlainParser()
    assert p.parse_answer("x") == "x"
    assert p.parse_answer([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]) == "a"
    assert p.parse_answer([{"role": "user", "content": "q"}]) is None


def _f_native(completion, answer, *, prompt, metadata): ...
def _f_native_batched(completions, answers, *, prompts): ...
def _f_verl(data_source, solution_str, ground_truth, extra_info=None): ...
def _f_trl(completions, **kwargs): ...
def _f_vf(completion, answer, state): ...
def _f_native_with_task(completion, answer, task=None): ...
def _f_native_named_completions(completions, answers): ...


@pytest.mark.parametrize(
    "obj,batched,convention",
    [
        (_f_native, False, "asyncrl"),
        (_f_native_batched, True, "asyncrl"),
        (_f_verl, False, "verl"),
        (_f_trl, False, "trl"),
        (_f_vf, False, "verifiers"),
        ([_f_vf, _f_native], False, "verifiers"),
        (_f_native_with_task, False, "asyncrl"),  # loadable natively: stays native
        (_f_native_named_completions, False, "asyncrl"),
    ],
)
def test_recognised_from_the_signature(obj, batched, convention):
    assert recognise(obj, batched)[0] == convention


def test_the_service_logs_the_convention_it_recognised(plugins, caplog):
    with caplog.at_level(logging.INFO, logger="shared.rewards.python"):
        build_scorer(f"{plugins}/verl_reward.py:plain").close()
    (line,) = [r.getMessage() for r in caplog.records if "convention" in r.getMessage()]
    assert line.endswith(
        "verl_reward.py:plain: called by the verl convention "
        "(its signature names data_source, solution_str and ground_truth)"
    ), line


@pytest.mark.parametrize(
    "edits,message",
    [
        ({"convention": "verl", "batched": True}, "remove batched"),
        ({"convention": "trl", "weights": [1.0]}, "weights weigh verifiers rubric functions"),
        ({"convention": "openai"}, "'asyncrl', 'verl', 'trl' or 'verifiers'"),
    ],
)
def test_spec_errors(edits, message):
    with pytest.raises(ValidationError, match=message):
        TypeAdapter(RewardSpec).validate_python({"kind": "python", "function": "m:f", **edits})
