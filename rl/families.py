"""Every generated problem family by name (`data.family`, `pretrain.families`): the arithmetic ones
of `rl.problems` and the calculator's (`rl.environments.calculator`), solved with its tool:
`calculator` (3-digit by 2-digit products and sums of 4-6 numbers) and `calculator_products` (the
products alone: the tiny model copies an expression of one length reliably, a sum of 4-6 numbers
not; docs/environments.md, "The calculator demo").

`problem_stream` and `eval_set` dispatch to the family's module (each splits by problem, so the
held-out set is never trained on); with `chat` (`prompt.chat_template: true`) a tool family's
problems are written for an instruct model ("What is 417*36? Use the calc tool, then answer with
the number."), the same problems and answers. `environment_of` names the environment a tool family's problems
are solved in (None for the others): evaluation runs a trajectory in it, and a run on that family
needs it. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterator

from rl import problems
from rl.environments import calculator
from rl.problems import Problem

CALCULATOR_KINDS = {calculator.FAMILY: calculator.KINDS, "calculator_products": ("mul",)}
"""The calculator's families and the kinds of problem each draws."""
FAMILIES = (*problems.FAMILIES, *CALCULATOR_KINDS)
"""`add`, `chain`, `words`, `calculator` and `calculator_products`."""
TOOL_FAMILIES = dict.fromkeys(CALCULATOR_KINDS, "calculator")
"""Family -> the name of the environment its problems are solved in (`environment.name`)."""


def _check(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown problem family {family!r}; expected one of {FAMILIES}")


def problem_stream(family: str, seed: int, split: str = "train", chat: bool = False) -> Iterator[Problem]:
    """Endless stream of problems of one family from one split (`train` or `eval`)."""
    _check(family)
    if family in CALCULATOR_KINDS:
        return calculator.problem_stream(seed, split, chat, kinds=CALCULATOR_KINDS[family])
    return problems.problem_stream(family, seed, split)


def eval_set(family: str, size: int, seed: int = 12345, chat: bool = False) -> list[Problem]:
    """A fixed held-out evaluation set of `size` distinct problems of `family`."""
    _check(family)
    if family in CALCULATOR_KINDS:
        return calculator.eval_set(size, seed, chat, kinds=CALCULATOR_KINDS[family])
    return problems.eval_set(family, size, seed)


def environment_of(family: str) -> str | None:
    """The name of the environment `family`'s problems are solved in (None: one response)."""
    _check(family)
    return TOOL_FAMILIES.get(family)
