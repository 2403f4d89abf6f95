"""Agent episodes in the generator (generator_svc/agents.py), without Redis or an engine: the calls
an agent makes, answered with scripted model turns, must record exactly the ids the engine was
given and sampled, and refuse what would break that."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncrl.tiny_model import CHAT_TEMPLATE, build_tokenizer
from generator_svc.agents import AgentEpisode, AgentError, AgentPlayer, split_tool_calls
from shared.environments.spec import EpisodeLimits
from shared.schema import AgentCall, AgentTask

TASK = AgentTask(
    job_id="j",
    msg_id="e1",
    group_id="g",
    policy_version=0,
    generator_id="gen",
    prompt_index=3,
    prompt="2+2",
    answer="4",
)


def tokenizer(template: bool):
    tok = build_tokenizer()
    if template:
        tok.chat_template = CHAT_TEMPLATE
    return tok


class Scripted:
    """The engine: each turn samples the next scripted text; records the contexts it was given."""

    def __init__(self, tok, texts: list[str]) -> None:
        self.tok, self.texts, self.contexts, self.rooms = tok, list(texts), [], []

    async def __call__(self, context: list[int], room: int):
        self.contexts.append(list(context))
        self.rooms.append(room)
        ids = self.tok(self.texts.pop(0), add_special_tokens=False)["input_ids"]
        return ids, [-0.5] * len(ids), "stop"


def player(tok, **limits) -> AgentPlayer:
    return AgentPlayer(
        None, tok, "auto", {}, EpisodeLimits(**{"max_turns": 3, "max_total_tokens": 300, **limits}), lambda: 7
    )  # type: ignore[arg-type]


def call(op: str, body: dict, n: int = 0) -> AgentCall:
    return AgentCall(job_id="j", msg_id=f"c{n}", episode_id="e1", op=op, body=json.dumps(body))


def turn(p: AgentPlayer, ae: AgentEpisode, gen: Scripted, op: str, body: dict) -> dict:
    return asyncio.run(p._turn(ae, call(op, body), gen, 0.0))


def ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_a_chat_episode_records_the_rendered_messages_and_the_sampled_ids_once() -> None:
    tok = tokenizer(template=True)
    p, ae = player(tok), AgentEpisode("e1", TASK)
    gen = Scripted(tok, ["calc", "4"])
    first = [{"role": "system", "content": "use the tool"}, {"role": "user", "content": "2+2"}]
    a = turn(p, ae, gen, "chat", {"model": "j", "messages": first, "logprobs": True})
    opening = ids(tok, "<|system|>use the tool\n<|user|>2+2\n<|assistant|>")
    assert a["prompt_token_ids"] == gen.contexts[0] == opening
    assert a["choices"][0]["token_ids"] == ids(tok, "calc")
    assert a["choices"][0]["message"] == {"role": "assistant", "content": "calc"}
    assert [x["logprob"] for x in a["choices"][0]["logprobs"]["content"]] == [-0.5] * 4
    assert a["policy_version"] == 7 and a["usage"]["completion_tokens"] == 4
    # the agent repeats the conversation (the client leaves None where it has no text) and adds a tool result
    second = [*first, {"role": "assistant", "content": "calc", "tool_calls": None}, {"role": "tool", "content": "4"}]
    b = turn(p, ae, gen, "chat", {"messages": second, "max_tokens": 5})
    # the template closes the model's turn ("\n"), then renders the tool message and the next prompt
    delta = ids(tok, "\n<|tool|>4\n<|assistant|>")
    assert b["prompt_token_ids"] == gen.contexts[1] == opening + ids(tok, "calc") + delta
    assert gen.rooms[1] == 5  # the agent's max_tokens caps the turn
    ep = ae.episode
    assert ep is not None
    assert ep.prompt_ids == opening
    assert ep.ids == ids(tok, "calc") + delta + ids(tok, "4")
    assert ep.mask == [1] * 4 + [0] * len(delta) + [1]
    assert ep.logprobs == [-0.5] * 4 + [0.0] * len(delta) + [-0.5]
    assert ep.num_turns == 2


def test_plain_text_where_the_model_has_no_template() -> None:
    tok = tokenizer(template=False)
    p, ae = player(tok), AgentEpisode("e1", TASK)
    gen = Scripted(tok, ["a", "b"])
    turn(p, ae, gen, "chat", {"messages": [{"role": "user", "content": "q"}]})
    turn(
        p,
        ae,
        gen,
        "chat",
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
                {"role": "tool", "content": "7"},
            ]
        },
    )
    assert gen.contexts[1] == tok("q", add_special_tokens=True)["input_ids"] + ids(tok, "a") + ids(
        tok, "\n<tool_response>\n7\n</tool_response>\n"
    )


def test_an_edited_history_is_refused_and_records_nothing() -> None:
    tok = tokenizer(template=True)
    p, ae = player(tok), AgentEpisode("e1", TASK)
    gen = Scripted(tok, ["x"])
    msgs = [{"role": "user", "content": "q"}]
    turn(p, ae, gen, "chat", {"messages": msgs})
    before = list(ae.episode.ids)  # type: ignore[union-attr]
    for edited in (
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}],
        [*msgs, {"role": "assistant", "content": "not what was sampled"}, {"role": "user", "content": "more"}],
        [*msgs, {"role": "assistant", "content": "x"}],  # nothing added
    ):
        with pytest.raises(AgentError) as e:
            turn(p, ae, gen, "chat", {"messages": edited})
        assert e.value.status == 409
    assert ae.episode.ids == before  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "body, says",
    [
        ({"messages": [{"role": "user", "content": "q"}], "stream": True}, "stream"),
        ({"messages": [{"role": "user", "content": "q"}], "n": 2}, "n must be 1"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "text content"),
    ],
)
def test_requests_it_cannot_serve_say_why(body: dict, says: str) -> None:
    tok = tokenizer(template=True)
    with pytest.raises(AgentError) as e:
        turn(player(tok), AgentEpisode("e1", TASK), Scripted(tok, ["x"]), "chat", body)
    assert e.value.status == 400 and says in str(e.value)


def test_limits_end_the_turns_and_the_reward_lands_on_the_last_turn() -> None:
    tok = tokenizer(template=True)
    p, ae = player(tok, max_turns=1), AgentEpisode("e1", TASK)
    gen = Scripted(tok, ["x"])
    msgs = [{"role": "user", "content": "q"}]
    turn(p, ae, gen, "chat", {"messages": msgs})
    with pytest.raises(AgentError) as e:
        turn(
            p,
            ae,
            gen,
            "chat",
            {"messages": [*msgs, {"role": "assistant", "content": "x"}, {"role": "user", "content": "again"}]},
        )
    assert e.value.status == 400 and "max_turns" in str(e.value)
    ep = p._end(ae, call("end", {"reward": 0.75, "details": {"tool_used": 1}}))
    assert ep.stop_reason == "max_turns"
    assert ep.metrics() == {"tool_used": 1.0, "reward": 0.75}
    with pytest.raises(AgentError):
        p._end(ae, call("end", {"reward": "high"}))


def test_completions_extend_the_text() -> None:
    tok = tokenizer(template=False)
    p, ae = player(tok), AgentEpisode("e1", TASK)
    gen = Scripted(tok, ["ab", "c"])
    a = turn(p, ae, gen, "completion", {"prompt": "Q:"})
    assert a["choices"][0]["text"] == "ab" and a["object"] == "text_completion"
    turn(p, ae, gen, "completion", {"prompt": "Q:ab\nA:"})
    assert gen.contexts[1] == tok("Q:", add_special_tokens=True)["input_ids"] + ids(tok, "ab") + ids(tok, "\nA:")
    assert ae.episode.mask == [1, 1, 0, 0, 0, 1]  # type: ignore[union-attr]
    with pytest.raises(AgentError) as e:
        turn(p, ae, gen, "completion", {"prompt": "something else"})
    assert e.value.status == 409


def test_tool_calls_in_a_turn_become_openai_tool_calls() -> None:
    content, calls = split_tool_calls(
        'let me add <tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>'
    )
    assert content == "let me add"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 2, "b": 2})
    ]
    assert split_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert split_tool_calls("just text") == ("just text", [])
