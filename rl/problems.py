"""Procedurally generated arithmetic problems with a held-out evaluation split (`FAMILIES`).

* ``add``: 2-3 digit addition in fixed width (operands 3 digits, sum 4): ``"123+045="`` ->
  ``"0168"``; the rewards compare numbers, so ``"168"`` is right too. Fixed width lets the tiny
  model learn the carries in a few hundred supervised steps on any CPU (why, with the figures:
  docs/demo.md, "Why the problems are written in fixed width"; `bench/pretrain.py`).
* ``chain``: 3-4 operands summed as a running chain, for longer responses (more mid-response
  preemptions): ``"12+345+67="`` -> ``"357+67=424"``; the last number is the answer.
* ``words``: one-step English word problems for instruct models (SmolLM2), answered GSM8K-style:
  ``"Sam has 7 apples and buys 5 more. ... End your answer with '#### <number>'."`` ->
  ``"Sam has 7 + 5 = 12 apples.\\n#### 12"``.

`problem_stream` and `eval_set` split by problem, not by draw: one whose operands hash into the
held-out bucket never appears in a training stream, so evaluation measures generalisation.
Everything is a pure function of its seed.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass

FAMILIES = ("add", "chain", "words")
HELD_OUT_BUCKETS = 10
"""One problem in this many is reserved for evaluation."""
ADD_OPERAND_DIGITS = 3
"""Width of an ``add`` operand (zero-padded): the largest operand has 3 digits."""
ADD_SUM_DIGITS = 4
"""Width of an ``add`` sum (zero-padded): two 3-digit operands sum to at most 4 digits."""


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    solution: str
    """A correct response (used as the supervised target in pretraining)."""
    family: str


def held_out(key: object) -> bool:
    """Whether a problem of `key` (its operands; with its family where families draw the same
    operands) is in the held-out split: one of `HELD_OUT_BUCKETS` buckets of its hash."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % HELD_OUT_BUCKETS == 0


def check_split(split: str) -> None:
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'eval'")


def distinct(stream: Iterator[Problem], size: int) -> list[Problem]:
    """The first `size` problems of `stream` with distinct prompts (an evaluation set)."""
    seen: set[str] = set()
    problems: list[Problem] = []
    for problem in stream:
        if problem.prompt not in seen:
            seen.add(problem.prompt)
            problems.append(problem)
        if len(problems) == size:
            return problems
    raise ValueError(f"the stream ended before {size} distinct problems")


WORDS_NAMES = ("Sam", "Mia", "Leo", "Ava", "Ben", "Zoe", "Max", "Lily")
WORDS_ITEMS = ("apples", "pencils", "marbles", "cookies", "stickers", "books", "coins", "cards")
WORDS_MAX = 20
"""Largest number a ``words`` problem starts from or adds (the difficulty knob). With 20 the base
SmolLM2-135M-Instruct is right on 31% greedily, 7.8% at temperature 1 (`bench/words_baseline.py`;
docs/your-model.md)."""
WORDS_SUFFIX = " End your answer with '#### <number>'."
"""What every ``words`` prompt asks for: GSM8K's answer convention (`rl.rewards.GSM8K_FORMAT`)."""
_WORDS_KINDS = ("buys", "gives")


def _operands(rng: random.Random, family: str) -> tuple[int, ...]:
    if family == "words":  # (kind, name, item, start, change)
        kind = rng.randrange(len(_WORDS_KINDS))
        start = rng.randint(2, WORDS_MAX)
        change = rng.randint(1, WORDS_MAX) if kind == 0 else rng.randint(1, start - 1)
        return (kind, rng.randrange(len(WORDS_NAMES)), rng.randrange(len(WORDS_ITEMS)), start, change)

    def number() -> int:
        return rng.randint(10, 99) if rng.random() < 0.5 else rng.randint(100, 999)

    count = 2 if family == "add" else rng.randint(3, 4)
    return tuple(number() for _ in range(count))


def _word_problem(operands: tuple[int, ...]) -> Problem:
    kind, name_index, item_index, start, change = operands
    name, item = WORDS_NAMES[name_index], WORDS_ITEMS[item_index]
    if _WORDS_KINDS[kind] == "buys":
        total = start + change
        question = f"{name} has {start} {item} and buys {change} more. How many {item} does {name} have now?"
        work = f"{name} has {start} + {change} = {total} {item}."
    else:
        total = start - change
        question = f"{name} has {start} {item} and gives {change} to a friend. How many {item} does {name} have left?"
        work = f"{name} has {start} - {change} = {total} {item} left."
    return Problem(question + WORDS_SUFFIX, str(total), f"{work}\n#### {total}", "words")


def make_problem(operands: tuple[int, ...], family: str) -> Problem:
    if family == "words":
        return _word_problem(operands)
    if family == "add":
        total = sum(operands)
        prompt = "+".join(f"{operand:0{ADD_OPERAND_DIGITS}d}" for operand in operands) + "="
        return Problem(prompt, str(total), f"{total:0{ADD_SUM_DIGITS}d}", family)
    prompt = "+".join(map(str, operands)) + "="
    if family == "chain":
        running = operands[0] + operands[1]
        steps = [str(running)]
        for operand in operands[2:]:
            running += operand
            steps.append(f"+{operand}={running}")
        return Problem(prompt, str(running), "".join(steps), family)
    raise ValueError(f"unknown problem family {family!r}; expected one of {FAMILIES}")


def problem_stream(family: str, seed: int, split: str = "train") -> Iterator[Problem]:
    """Endless stream of problems of one family from one split (`train` or `eval`)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown problem family {family!r}; expected one of {FAMILIES}")
    check_split(split)
    want_held_out = split == "eval"
    rng = random.Random(f"{family}:{split}:{seed}")
    while True:
        operands = _operands(rng, family)
        if held_out(operands) == want_held_out:
            yield make_problem(operands, family)


def take(stream: Iterator[Problem], n: int) -> list[Problem]:
    return [next(stream) for _ in range(n)]


def eval_set(family: str, size: int, seed: int = 12345) -> list[Problem]:
    """A fixed held-out evaluation set of distinct problems."""
    return distinct(problem_stream(family, seed, split="eval"), size)
