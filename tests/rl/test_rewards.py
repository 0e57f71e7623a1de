"""Reward functions: extraction, normalisation, correctness, format and their combination."""

from __future__ import annotations

import pickle
import re

import pytest

from rl.environments.registry import REWARD_KINDS, builtin_reward
from rl.problems import FAMILIES, eval_set
from rl.rewards import (
    ADD_FORMAT,
    BOXED_FORMAT,
    CHAIN_FORMAT,
    FORMAT_PATTERNS,
    GSM8K_FORMAT,
    NAMED_FORMATS,
    boxed_reward,
    exact_match_reward,
    extract_boxed,
    extract_final_number,
    extract_gsm8k,
    format_reward,
    normalize_number,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", "42"),
        ("  42 \n", "42"),
        ("+5", "5"),
        ("-5", "-5"),
        ("-0", "0"),
        ("+0", "0"),
        ("1,234", "1234"),
        ("-1,234,567", "-1234567"),
        ("2.50", "2.5"),
        ("3.0", "3"),
        ("-0.00", "0"),
        ("007", "7"),
        ("0.05", "0.05"),
        ("12345678901234567890.10", "12345678901234567890.1"),
    ],
)
def test_normalize_number(text: str, expected: str) -> None:
    assert normalize_number(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "12a", "--3", "1.2.3", "1 2", "12,34", ".5", "5."])
def test_normalize_number_rejects_non_numbers(text: str) -> None:
    assert normalize_number(text) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("168", "168"),
        ("The answer is 168.", "168"),
        ("12 then 13 then 14", "14"),
        ("357+67=424+8=432", "432"),
        ("x = -7", "-7"),
        ("x=-7", "-7"),
        ("5-3", "3"),
        ("(2)-4", "4"),
        ("total: 1,234 apples", "1234"),
        ("costs $2.50", "2.5"),
        ("about 3.0 units", "3"),
        ("+5", "5"),
        ("-0", "0"),
        ("12,34", "34"),
        ("168 <eos>", "168"),
    ],
)
def test_extract_final_number(text: str, expected: str) -> None:
    assert extract_final_number(text) == expected


@pytest.mark.parametrize("text", ["", "   ", "abc", "12a", "--3", "v1.2.3", "1e5", "x2"])
def test_extract_final_number_none_for_malformed(text: str) -> None:
    assert extract_final_number(text) is None


def test_extract_boxed() -> None:
    assert extract_boxed(r"so \boxed{42}") == "42"
    assert extract_boxed(r"\boxed{1} then \boxed{ 2 }") == "2"
    assert extract_boxed(r"\boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_boxed("no box here") is None
    assert extract_boxed(r"\boxed{12") is None
    assert extract_boxed(r"\boxed{1} and \boxed{\frac{1}{2}") is None  # the last is unbalanced


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("168", "168", 1.0),
        ("  168\n", "168", 1.0),
        ("168", "169", 0.0),
        ("+5", "5", 1.0),
        ("-5", "5", 0.0),
        ("-0", "0", 1.0),
        ("1,234", "1234", 1.0),
        ("1234", "1,234", 1.0),
        ("2.50", "2.5", 1.0),
        ("3.0", "3", 1.0),
        ("357+67=424+8=432", "432", 1.0),
        ("357+67=424+8=433", "432", 0.0),
        ("424 or 432", "424", 0.0),  # the last number wins
        (r"it is \boxed{7}, not 8", "7", 1.0),  # a box wins over the final number
        (r"\boxed{x = 7}", "7", 1.0),
        ("", "0", 0.0),
        ("abc", "0", 0.0),
        ("12a", "12", 0.0),
        ("--3", "3", 0.0),
        ("--3", "-3", 0.0),
        (r"\boxed{12", "12", 0.0),
    ],
)
def test_exact_match_reward(response: str, answer: str, expected: float) -> None:
    assert exact_match_reward(response, answer) == expected


def test_exact_match_rejects_non_numeric_answer() -> None:
    with pytest.raises(ValueError, match="not a number"):
        exact_match_reward("42", "forty-two")


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        (r"\boxed{42}", "42", 1.0),
        (r"\boxed{42.0}", "42", 1.0),
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),
        (r"\boxed{ \frac{1} {2} }", r"\frac{1}{2}", 1.0),
        (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}", 0.0),
        ("42", "42", 0.0),  # no box
        (r"\boxed{42", "42", 0.0),
        (r"\boxed{}", "42", 0.0),
    ],
)
def test_boxed_reward(response: str, answer: str, expected: float) -> None:
    assert boxed_reward(response, answer) == expected


@pytest.mark.parametrize(
    ("response", "pattern", "expected"),
    [
        ("168", ADD_FORMAT, 1.0),
        (" -168\n", ADD_FORMAT, 1.0),
        ("168 apples", ADD_FORMAT, 0.0),
        ("", ADD_FORMAT, 0.0),
        ("357+67=424+8=432", CHAIN_FORMAT, 1.0),
        ("357+67=424", CHAIN_FORMAT, 1.0),
        ("357", CHAIN_FORMAT, 0.0),
        ("357+67=", CHAIN_FORMAT, 0.0),
        ("357+67=424+", CHAIN_FORMAT, 0.0),
    ],
)
def test_format_reward(response: str, pattern: str, expected: float) -> None:
    assert format_reward(response, pattern) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_solutions_score_full_marks(family: str) -> None:
    pattern = FORMAT_PATTERNS[family]
    reward = builtin_reward("exact_match", format_weight=0.5, format_pattern=pattern)
    for problem in eval_set(family, 50):
        assert reward(problem.solution, problem.answer) == 1.5


def test_builtin_reward_combines_correctness_and_format() -> None:
    reward = builtin_reward("exact_match", format_weight=0.25, format_pattern=ADD_FORMAT)
    assert reward("168", "168") == 1.25
    assert reward("168 is it", "168") == 1.0
    assert reward("167", "168") == 0.25
    assert reward("nonsense", "168") == 0.0
    assert builtin_reward("boxed")(r"\boxed{3}", "3") == 1.0
    assert builtin_reward("exact_match")("3", "3") == 1.0


def test_reward_fn_pickles() -> None:
    reward = builtin_reward("exact_match", format_weight=0.1, format_pattern=CHAIN_FORMAT)
    assert pickle.loads(pickle.dumps(reward))("1+2=3", "3") == pytest.approx(1.1)


def test_builtin_reward_errors() -> None:
    with pytest.raises(ValueError, match=re.escape(str(REWARD_KINDS))):
        builtin_reward("f1")
    with pytest.raises(ValueError, match="format_pattern"):
        builtin_reward("exact_match", format_weight=0.5)
    with pytest.raises(ValueError, match="not a regex"):
        builtin_reward("exact_match", format_weight=0.5, format_pattern="(")
    with pytest.raises(ValueError, match="format_weight"):
        builtin_reward("exact_match", format_weight=-1.0, format_pattern=ADD_FORMAT)


# --- GSM8K-style references and responses, named formats --------------------------------------

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (GSM8K_SOLUTION, "72"),
        ("#### 1,234", "1234"),
        ("so #### -5.", "-5"),
        ("####12 apples", "12"),
        ("#### 3 then #### 4", "4"),
        ("no marker 5", None),
        ("#### none", None),
        ("#### 12abc", None),
    ],
)
def test_extract_gsm8k(text: str, expected: str | None) -> None:
    assert extract_gsm8k(text) == expected


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("7 + 5 = 12.\n#### 12", GSM8K_SOLUTION.replace("72", "12"), 1.0),  # reference: a solution
        ("so the total is 72", GSM8K_SOLUTION, 1.0),
        ("#### 72", "72", 1.0),
        ("#### 72 clips, 3 more than before", "72", 1.0),  # judged by N, not the last number
        ("#### 71, or maybe 72", "72", 0.0),
        ("I think 72 ####", "72", 0.0),  # no number after the marker
        ("\\boxed{72} #### 5", "72", 1.0),  # a box still wins
    ],
)
def test_exact_match_with_gsm8k_answers(response: str, answer: str, expected: float) -> None:
    assert exact_match_reward(response, answer) == expected


def test_boxed_reward_with_a_gsm8k_reference() -> None:
    assert boxed_reward("\\boxed{72}", GSM8K_SOLUTION) == 1.0
    assert boxed_reward("\\boxed{71}", GSM8K_SOLUTION) == 0.0


def test_a_reference_that_is_neither_number_nor_gsm8k_is_a_dataset_error() -> None:
    with pytest.raises(ValueError, match="#### <number>"):
        exact_match_reward("#### 3", "the answer is #### three")


@pytest.mark.parametrize(
    ("response", "pattern", "expected"),
    [
        ("7 + 5 = 12.\n#### 12", GSM8K_FORMAT, 1.0),
        ("#### 1,234.", GSM8K_FORMAT, 1.0),
        ("#### 12 apples", GSM8K_FORMAT, 0.0),
        ("12", GSM8K_FORMAT, 0.0),
        ("so it is \\boxed{12}.", BOXED_FORMAT, 1.0),
        ("\\boxed{12} because", BOXED_FORMAT, 0.0),
        ("boxed 12", BOXED_FORMAT, 0.0),
    ],
)
def test_named_formats(response: str, pattern: str, expected: float) -> None:
    assert format_reward(response, pattern) == expected
    assert NAMED_FORMATS == {"boxed": BOXED_FORMAT, "gsm8k": GSM8K_FORMAT}


def test_reward_config_chooses_the_format() -> None:
    from pydantic import ValidationError

    from rl.config import RewardConfig

    assert RewardConfig().format_pattern("add") == ADD_FORMAT
    assert RewardConfig().format_pattern(None) is None  # file data has no family
    assert RewardConfig(format="gsm8k").format_pattern("add") == GSM8K_FORMAT
    assert RewardConfig(format="boxed").format_pattern(None) == BOXED_FORMAT
    assert RewardConfig(format=r"\d+ apples").format_pattern(None) == r"\d+ apples"
    with pytest.raises(ValidationError, match="format '\\(' is neither family, boxed, gsm8k nor a valid regex"):
        RewardConfig(format="(")
