"""The shipped tool environment (`environment.name: calculator`) and its problems.

Problems the tiny model cannot do in its head: a 3-digit by 2-digit product (``417*36=``) or a sum
of 4-6 numbers (``12+345+67+89=``), generated purely from a seed with a held-out split, as
`rl.problems` does. The tool `calc` takes ``{"expr": "417*36"}`` and evaluates integers with
``+ - *`` and parentheses through the AST (never `eval`), bounded in length, operations and size.
A solved trajectory has at least two turns: a call, then the answer after its result
(``<call>calc {"expr":"417*36"}</call><result>15012</result>15012``); the terminal reward is 1.0
when the answer turn's final number equals the answer and a tool result came before it, else 0.0.
Pure and replayable: the state is the count of tool results, rebuilt by replaying the turns.
`demonstration` writes solutions for pretraining, with noise (a wrong digit copied into the call
or out of the result) as `rl.problems`' corpus has noisy answers.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Iterator, Mapping
from typing import Any

from rl.environments.protocol import StepKey, StepResult, ToolCall, ToolEnvironment, ToolError, Turn
from rl.environments.tool_calls import TextToolFormat
from rl.problems import Problem, check_split, distinct, held_out
from rl.rewards import extract_final_number, normalize_number

FAMILY = "calculator"
"""`Problem.family` of the calculator's problems."""
KINDS = ("mul", "sum")
"""`mul`: a 3-digit number times a 2-digit one; `sum`: 4-6 numbers of 2-3 digits."""
TOOL = "calc"
MAX_EXPR_CHARS = 80
"""Longest expression `calc` evaluates."""
MAX_OPERATIONS = 16
"""Most operators (binary and unary) in one expression."""
MAX_MAGNITUDE = 10**15
"""Largest absolute value of a number, operand or intermediate result."""
CHAT_SUFFIX = " Use the calc tool, then answer with the number."
"""Appended to a problem written for an instruct model (`chat=True`)."""
NOISE_KINDS = ("call", "answer")
"""Where a noisy demonstration has its one wrong digit: in the expression it passes to `calc`
(the result and the answer then follow from the wrong expression), or in the answer it copies."""


_LEADING_ZEROS = re.compile(r"\b0+(\d)")
"""Zeros before a number's first digit (``045``, as the ``add`` family writes): Python refuses them."""
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _evaluate(node: ast.AST, budget: list[int]) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        budget[0] -= 1
        operand = _evaluate(node.operand, budget)
        value = -operand if isinstance(node.op, ast.USub) else operand
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        budget[0] -= 1
        value = _BINARY[type(node.op)](_evaluate(node.left, budget), _evaluate(node.right, budget))
    else:
        raise ToolError("calc takes whole numbers, + - * and parentheses, e.g. 417*36")
    if budget[0] < 0:
        raise ToolError(f"too many operations (at most {MAX_OPERATIONS})")
    if abs(value) > MAX_MAGNITUDE:
        raise ToolError(f"a number is too large (at most {MAX_MAGNITUDE})")
    return value


def calc(expr: str) -> str:
    """Evaluate an integer expression of + - * and parentheses, e.g. 417*36."""
    if not isinstance(expr, str):
        raise ToolError('expr must be a string, e.g. {"expr": "417*36"}')
    if len(expr) > MAX_EXPR_CHARS:
        raise ToolError(f"the expression is longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(_LEADING_ZEROS.sub(r"\1", expr.strip()), mode="eval")
    except SyntaxError:
        raise ToolError(f"not an expression: {expr!r}") from None
    return str(_evaluate(tree.body, [MAX_OPERATIONS]))


class Calculator(ToolEnvironment):
    """One tool, `calc`; the answer is the final number of the first turn that calls no tool."""

    replayable = True

    def __init__(self) -> None:
        self.tools = {TOOL: calc}
        self._answer: str | None = None
        self._results = 0

    def reset(self, prompt: str, answer: str, meta: Mapping[str, Any] | None = None) -> None:
        expected = normalize_number(answer)
        if expected is None:
            raise ValueError(f"the calculator's answers are numbers, got {answer!r}")
        self._answer, self._results = expected, 0

    def call_tool(self, call: ToolCall) -> str:
        self._results += 1
        return super().call_tool(call)

    def answer(self, turn_text: str, key: StepKey) -> StepResult:
        correct = self._results > 0 and extract_final_number(turn_text) == self._answer
        return StepResult(observation=None, done=True, reward=1.0 if correct else 0.0)


def _operands(rng: random.Random, kinds: tuple[str, ...] = KINDS) -> tuple[int, ...]:
    kind = KINDS.index(kinds[rng.randrange(len(kinds))])
    if KINDS[kind] == "mul":
        return (kind, rng.randint(100, 999), rng.randint(10, 99))
    return (kind, *(rng.randint(10, 999) for _ in range(rng.randint(4, 6))))


def expression(operands: tuple[int, ...]) -> str:
    """The expression of a problem's operands (kind index first): ``417*36``, ``12+345+67+89``."""
    kind, *numbers = operands
    return ("*" if KINDS[kind] == "mul" else "+").join(map(str, numbers))


def make_problem(operands: tuple[int, ...], chat: bool = False) -> Problem:
    """The problem of `operands`; its `solution` is the correct demonstration in the text format."""
    expr = expression(operands)
    answer = calc(expr)
    prompt = f"What is {expr}?{CHAT_SUFFIX}" if chat else f"{expr}="
    return Problem(prompt, answer, transcript(_turns(expr, answer)), FAMILY)


def problem_stream(
    seed: int, split: str = "train", chat: bool = False, kinds: tuple[str, ...] = KINDS
) -> Iterator[Problem]:
    """Endless stream of calculator problems from one split (`train` or `eval`), of `kinds` only."""
    check_split(split)
    if not kinds or not set(kinds) <= set(KINDS):
        raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {kinds}")
    rng = random.Random(f"{FAMILY}:{split}:{seed}")
    while True:
        operands = _operands(rng, kinds)
        if held_out((FAMILY, operands)) == (split == "eval"):
            yield make_problem(operands, chat)


def eval_set(size: int, seed: int = 12345, chat: bool = False, kinds: tuple[str, ...] = KINDS) -> list[Problem]:
    """A fixed held-out evaluation set of distinct problems (of `kinds` only)."""
    return distinct(problem_stream(seed, "eval", chat, kinds), size)


def _turns(expr: str, answer: str) -> tuple[Turn, ...]:
    call = TextToolFormat().call_text(TOOL, {"expr": expr})
    return (Turn(call, calc(expr)), Turn(answer))


def _wrong_digit(text: str, rng: random.Random) -> str:
    position = rng.choice([i for i, ch in enumerate(text) if ch.isdigit()])
    wrong = rng.choice([d for d in "0123456789" if d != text[position]])
    return text[:position] + wrong + text[position + 1 :]


def demonstration(problem: Problem, rng: random.Random, error_rate: float = 0.0) -> tuple[Turn, ...]:
    """A solution of `problem` as turns (a call with its result, then the answer). With
    probability `error_rate` one digit is wrong, where `NOISE_KINDS` says (chosen by `rng`)."""
    expr = _expression(problem.prompt)
    if rng.random() >= error_rate:
        return _turns(expr, problem.answer)
    if rng.choice(NOISE_KINDS) == "call":
        wrong = _wrong_digit(expr, rng)
        return _turns(wrong, calc(wrong))
    call, answer = _turns(expr, problem.answer)
    return (call, Turn(_wrong_digit(answer.text, rng)))


def _expression(prompt: str) -> str:
    """The expression a problem's prompt asks for (either style of `make_problem`)."""
    if prompt.endswith("="):
        return prompt[:-1]
    return prompt.removeprefix("What is ").removesuffix(f"?{CHAT_SUFFIX}")


def transcript(turns: tuple[Turn, ...], format: TextToolFormat | None = None) -> str:
    """The turns as one text: each turn, then its observation rendered by `format` (text format)."""
    format = format or TextToolFormat()
    return "".join(
        turn.text + (format.render(turn.observation) if turn.observation is not None else "") for turn in turns
    )
