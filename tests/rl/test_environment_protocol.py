"""The environment protocol: a ToolEnvironment's step turns a turn's tool call into the tool's
result, a policy's mistakes into `error: ...` observations, and anything else into an exception
(an infrastructure failure, never a reward)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from rl.environments.protocol import (
    StepKey,
    StepResult,
    ToolEnvironment,
    ToolError,
    Trajectory,
    Turn,
)
from rl.environments.tool_calls import TextToolFormat

KEY = StepKey("s0", 0)


def lookup(word: str, limit: int = 3) -> str:
    """Look a word up in the dictionary.

    The rest of the docstring is not in the schema."""
    if word == "crash":
        raise RuntimeError("the dictionary server fell over")
    if not word:
        raise ToolError("give a word")
    return word.upper()[:limit]


class Dictionary(ToolEnvironment):
    def __init__(self) -> None:
        self.tools = {"lookup": lookup}
        self.steps: list[str] = []

    def reset(self, prompt: str, answer: str, meta: Mapping[str, Any] | None = None) -> None:
        self.answer_text = answer

    def step(self, turn_text: str, key: StepKey) -> StepResult:
        self.steps.append(turn_text)
        return super().step(turn_text, key)

    def answer(self, turn_text: str, key: StepKey) -> StepResult:
        return StepResult(observation=None, done=True, reward=float(turn_text.strip() == self.answer_text))


@pytest.fixture
def env() -> Dictionary:
    environment = Dictionary()
    environment.use_format(TextToolFormat())
    environment.reset("define cat", "CAT")
    return environment


def test_a_tool_call_gets_the_tools_result_and_an_answer_ends_the_trajectory(env: Dictionary) -> None:
    assert env.step('<call>lookup {"word":"cat"}</call>', KEY) == StepResult("CAT", done=False)
    assert env.step('<call>lookup {"word":"horse","limit":5}</call>', StepKey("s0", 1)).observation == "HORSE"
    assert env.step("CAT", StepKey("s0", 2)) == StepResult(None, done=True, reward=1.0)
    assert env.step("DOG", StepKey("s0", 2)).reward == 0.0


@pytest.mark.parametrize(
    ("turn", "observation"),
    [
        ('<call>lookup {"word":""}</call>', "error: give a word"),
        ('<call>lookup {"word":"cat","wort":1}</call>', "error: lookup: got an unexpected keyword argument 'wort'"),
        ("<call>lookup</call>", "error: lookup: missing a required argument: 'word'"),
        ('<call>search {"q":"cat"}</call>', "error: unknown tool 'search' (tools: lookup)"),
        ('<call>lookup {"word":</call>', "error: arguments: not JSON (Expecting value at character 8)"),
    ],
)
def test_the_policys_mistakes_are_observations_not_failures(env: Dictionary, turn: str, observation: str) -> None:
    assert env.step(turn, KEY) == StepResult(observation, done=False)


def test_a_tool_that_fails_otherwise_raises_an_infrastructure_failure(env: Dictionary) -> None:
    with pytest.raises(RuntimeError, match="fell over"):
        env.step('<call>lookup {"word":"crash"}</call>', KEY)


def test_a_tool_environment_needs_a_format() -> None:
    with pytest.raises(RuntimeError, match="use_format"):
        Dictionary().step("CAT", KEY)


def test_replay_steps_again_by_default(env: Dictionary) -> None:
    env.replay('<call>lookup {"word":"cat"}</call>', "CAT", KEY)
    assert env.steps == ['<call>lookup {"word":"cat"}</call>']
    assert env.session() is None and env.replayable


def test_tool_schemas_come_from_signatures_and_docstrings(env: Dictionary) -> None:
    [schema] = env.tool_schemas()
    assert schema == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up in the dictionary.",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["word"],
            },
        },
    }


def test_trajectory_response_is_the_last_turn() -> None:
    trajectory = Trajectory("p", "a", (Turn("<call>x</call>", "1"), Turn("final")))
    assert trajectory.response == "final"
    assert Trajectory("p", "a", ()).response == ""
