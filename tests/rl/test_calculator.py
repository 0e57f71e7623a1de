"""The calculator environment: a safe `calc` tool, seeded problems with a held-out split, a
terminal reward only for an answer after a tool result, replay, and noisy demonstrations."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from rl.environments.calculator import (
    FAMILY,
    MAX_EXPR_CHARS,
    Calculator,
    calc,
    demonstration,
    eval_set,
    problem_stream,
    transcript,
)
from rl.environments.protocol import StepKey, StepResult, ToolError, Turn
from rl.environments.tool_calls import ChatTemplateToolFormat, TextToolFormat
from rl.problems import take
from rl.tokenizer import build_char_tokenizer


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("417*36", "15012"),
        ("12+345+67+89", "513"),
        (" (2+3) * -4 ", "-20"),
        ("10-25", "-15"),
        ("+7", "7"),
        ("045+0", "45"),
    ],
)
def test_calc_evaluates_integer_arithmetic(expr: str, value: str) -> None:
    assert calc(expr) == value


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        ("__import__('os').system('true')", "calc takes whole numbers"),
        ("2**10", "calc takes whole numbers"),
        ("7/2", "calc takes whole numbers"),
        ("1.5*2", "calc takes whole numbers"),
        ("x*2", "calc takes whole numbers"),
        ("True+1", "calc takes whole numbers"),
        ("[1]*3", "calc takes whole numbers"),
        ("1+" * 17 + "1", "too many operations"),
        ("999999999*999999999", "a number is too large"),
        ("1" * (MAX_EXPR_CHARS + 1), "longer than"),
        ("2*(3", "not an expression"),
    ],
)
def test_calc_refuses_anything_else_as_the_models_mistake(expr: str, reason: str) -> None:
    with pytest.raises(ToolError, match=reason):
        calc(expr)
    with pytest.raises(ToolError, match="expr must be a string"):
        calc(12)  # type: ignore[arg-type]  # JSON can carry a number


def solved(env: Calculator, turns: list[str]) -> list[StepResult]:
    return [env.step(turn, StepKey("s", index)) for index, turn in enumerate(turns)]


@pytest.fixture
def env() -> Calculator:
    environment = Calculator()
    environment.use_format(TextToolFormat())
    environment.reset("417*36=", "15012")
    return environment


def test_an_answer_after_a_tool_result_scores_one(env: Calculator) -> None:
    call, answer = solved(env, ['<call>calc {"expr":"417*36"}</call>', "15012"])
    assert call == StepResult("15012", done=False)
    assert answer == StepResult(None, done=True, reward=1.0)


@pytest.mark.parametrize(
    "turns",
    [
        ["15012"],  # right, but without the tool: one turn is not a solution
        ['<call>calc {"expr":"417*36"}</call>', "15013"],
        ['<call>calc {"expr":"417*63"}</call>', "26271"],
    ],
)
def test_anything_else_scores_zero(env: Calculator, turns: list[str]) -> None:
    assert solved(env, turns)[-1] == StepResult(None, done=True, reward=0.0)


def test_a_refused_expression_is_an_observation(env: Calculator) -> None:
    [result] = solved(env, ['<call>calc {"expr":"417/36"}</call>'])
    assert result == StepResult("error: calc takes whole numbers, + - * and parentheses, e.g. 417*36", done=False)


def test_replaying_the_logged_turns_restores_the_state(env: Calculator) -> None:
    fresh = Calculator()
    fresh.use_format(TextToolFormat())
    fresh.reset("417*36=", "15012")
    fresh.replay('<call>calc {"expr":"417*36"}</call>', "15012", StepKey("s", 0))
    assert fresh.step("15012", StepKey("s", 1)).reward == 1.0


def test_reset_starts_over(env: Calculator) -> None:
    solved(env, ['<call>calc {"expr":"417*36"}</call>'])
    env.reset("12+34+56+78=", "180")
    assert env.step("180", StepKey("t", 0)).reward == 0.0


def test_problems_are_seeded_split_and_too_hard_for_the_head() -> None:
    train = take(problem_stream(seed=3), 400)
    assert train == take(problem_stream(seed=3), 400)
    assert train != take(problem_stream(seed=4), 400)
    held_out = {p.prompt for p in eval_set(200)}
    assert len(held_out) == 200 and not held_out & {p.prompt for p in train}
    kinds = Counter("*" in p.prompt for p in train)
    assert min(kinds.values()) > 100  # both kinds
    for problem in train:
        assert problem.family == FAMILY and problem.prompt.endswith("=")
        expr = problem.prompt[:-1]
        if "*" in expr:
            left, right = map(int, expr.split("*"))
            assert 100 <= left <= 999 and 10 <= right <= 99
        else:
            assert 4 <= len(expr.split("+")) <= 6
        assert calc(expr) == problem.answer


def test_chat_problems_ask_for_the_tool() -> None:
    [problem] = take(problem_stream(seed=0, chat=True), 1)
    [plain] = take(problem_stream(seed=0), 1)
    assert problem.prompt == f"What is {plain.prompt[:-1]}? Use the calc tool, then answer with the number."
    assert problem.answer == plain.answer


def test_demonstrations_solve_their_problem_in_two_turns(env: Calculator) -> None:
    rng = random.Random(0)
    for problem in eval_set(50) + eval_set(5, chat=True):
        turns = demonstration(problem, rng)
        assert len(turns) == 2 and transcript(turns) == problem.solution
        env.reset(problem.prompt, problem.answer)
        assert solved(env, [turn.text for turn in turns])[-1].reward == 1.0
        for turn in turns[:-1]:  # each logged observation is what the environment answers
            assert env.step(turn.text, StepKey("s", 0)).observation == turn.observation


def test_noisy_demonstrations_have_one_wrong_digit_where_noise_kinds_say(env: Calculator) -> None:
    rng = random.Random(1)
    problems = take(problem_stream(seed=1), 400)
    rewards = []
    for problem in problems:
        turns = demonstration(problem, rng, error_rate=0.5)
        env.reset(problem.prompt, problem.answer)
        rewards.append(solved(env, [turn.text for turn in turns])[-1].reward)
        assert turns[0].observation == calc(TextToolFormat().parse(turns[0].text).arguments["expr"])  # type: ignore[union-attr]
    wrong = rewards.count(0.0) / len(rewards)
    assert 0.35 < wrong < 0.5  # half corrupted; rarely a corrupted call keeps its answer (e.g. 2+3 -> 3+2)


def test_a_transcript_tokenizes_for_the_tiny_model() -> None:
    tokenizer = build_char_tokenizer()
    text = transcript((Turn('<call>calc {"expr":"1+2"}</call>', "3"), Turn("3")))
    assert text == '<call>calc {"expr":"1+2"}</call><result>3</result>3'
    assert tokenizer.unk_token_id not in tokenizer(text).input_ids


def test_with_a_chat_template_the_calculator_reads_chat_calls() -> None:
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
    environment = Calculator()
    environment.use_format(ChatTemplateToolFormat(tokenizer))
    environment.reset("What is 2*3?", "6")
    turns = ['<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call>', "The answer is 6."]
    assert [r.reward for r in solved(environment, turns)] == [None, 1.0]
