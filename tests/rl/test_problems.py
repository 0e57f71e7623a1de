"""Tests for rl/problems.py: split hygiene, determinism and correct solutions."""

from __future__ import annotations

import re

import pytest

from rl.problems import FAMILIES, eval_set, make_problem, problem_stream, take


def _operands(prompt: str) -> list[int]:
    assert prompt.endswith("=")
    return [int(x) for x in prompt[:-1].split("+")]


@pytest.mark.parametrize("family", FAMILIES)
def test_train_and_eval_splits_are_disjoint(family):
    train = {p.prompt for p in take(problem_stream(family, 0, "train"), 3000)}
    train |= {p.prompt for p in take(problem_stream(family, 7, "train"), 1000)}
    held_out = {p.prompt for p in take(problem_stream(family, 0, "eval"), 1000)}
    held_out |= {p.prompt for p in eval_set(family, 500)}
    assert len(train) > 2000 and len(held_out) > 500
    assert not train & held_out


@pytest.mark.parametrize("family", FAMILIES)
def test_streams_are_deterministic_and_seeded(family):
    a = take(problem_stream(family, 3), 50)
    assert a == take(problem_stream(family, 3), 50)
    assert a != take(problem_stream(family, 4), 50)


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_set_is_distinct_and_deterministic(family):
    problems = eval_set(family, 300)
    assert len(problems) == 300
    assert len({p.prompt for p in problems}) == 300
    assert eval_set(family, 300) == problems
    assert eval_set(family, 100) == problems[:100]
    assert eval_set(family, 50, seed=1) != problems[:50]


def test_add_solution_is_the_sum():
    for problem in take(problem_stream("add", 1), 500):
        operands = _operands(problem.prompt)
        assert len(operands) == 2
        assert all(10 <= x <= 999 for x in operands)
        assert problem.answer == str(sum(operands))
        assert problem.solution == f"{sum(operands):04d}"  # fixed width: 4 digits
        assert re.fullmatch(r"\d{3}\+\d{3}=", problem.prompt)
        assert problem.family == "add"


def test_chain_solutions_are_arithmetically_right_and_end_with_the_answer():
    for problem in take(problem_stream("chain", 2), 500):
        operands = _operands(problem.prompt)
        assert 3 <= len(operands) <= 4
        assert problem.answer == str(sum(operands))
        assert problem.solution.endswith("=" + problem.answer)
        assert re.fullmatch(r"\d+(?:\+\d+=\d+)+", problem.solution)
        # Walk the chain: first running sum, then "+operand=running" steps.
        first, *steps = problem.solution.split("+")
        running = int(first)
        assert running == operands[0] + operands[1]
        used = operands[2:]
        assert len(steps) == len(used)
        for step, operand in zip(steps, used):
            added, total = step.split("=")
            assert int(added) == operand
            running += operand
            assert int(total) == running


def test_make_problem_known_values():
    assert make_problem((12, 345, 67), "chain").solution == "357+67=424"
    assert make_problem((12, 345, 67, 8), "chain").solution == "357+67=424+8=432"
    problem = make_problem((123, 45), "add")
    assert (problem.prompt, problem.answer, problem.solution) == ("123+045=", "168", "0168")
    assert make_problem((999, 999), "add").solution == "1998"
    assert make_problem((10, 10), "add").prompt == "010+010="


def test_unknown_family_and_split_error():
    with pytest.raises(ValueError, match="mul"):
        next(problem_stream("mul", 0))
    with pytest.raises(ValueError, match="mul"):
        make_problem((1, 2), "mul")
    with pytest.raises(ValueError, match="mul"):
        eval_set("mul", 3)
    with pytest.raises(ValueError, match="test"):
        next(problem_stream("add", 0, split="test"))


def test_held_out_fraction_is_about_one_in_ten():
    from rl.problems import HELD_OUT_BUCKETS, held_out

    pairs = [(a, b) for a in range(10, 110) for b in range(100, 150)]
    fraction = sum(map(held_out, pairs)) / len(pairs)
    assert abs(fraction - 1 / HELD_OUT_BUCKETS) < 0.02
    # Every eval problem is held out, no train problem is.
    assert all(held_out(tuple(_operands(p.prompt))) for p in eval_set("add", 200))
    assert not any(held_out(tuple(_operands(p.prompt))) for p in take(problem_stream("add", 0), 500))


def test_words_problems_are_right_and_ask_for_the_gsm8k_answer():
    from rl.problems import WORDS_MAX, WORDS_SUFFIX
    from rl.rewards import GSM8K_FORMAT, exact_match_reward, format_reward

    kinds = set()
    for problem in take(problem_stream("words", 5), 500):
        assert problem.family == "words" and problem.prompt.endswith(WORDS_SUFFIX)
        match = re.fullmatch(
            r"(\w+) has (\d+) (\w+) and (buys|gives) (\d+) (more|to a friend)\. How many \3 does \1 have (now|left)\?",
            problem.prompt.removesuffix(WORDS_SUFFIX),
        )
        assert match, problem.prompt
        start, change, kind = int(match[2]), int(match[5]), match[4]
        kinds.add(kind)
        assert 2 <= start <= WORDS_MAX and 1 <= change <= WORDS_MAX
        total = start + change if kind == "buys" else start - change
        assert total >= 1 and problem.answer == str(total)
        assert problem.solution.endswith(f"\n#### {total}")
        assert exact_match_reward(problem.solution, problem.answer) == 1.0
        assert format_reward(problem.solution, GSM8K_FORMAT) == 1.0
    assert kinds == {"buys", "gives"}


def test_words_known_values():
    problem = make_problem((0, 0, 0, 7, 5), "words")
    assert problem.prompt == (
        "Sam has 7 apples and buys 5 more. How many apples does Sam have now? End your answer with '#### <number>'."
    )
    assert (problem.answer, problem.solution) == ("12", "Sam has 7 + 5 = 12 apples.\n#### 12")
    assert make_problem((1, 1, 2, 9, 4), "words").answer == "5"
