"""Rewards judged by math-verify: where the library agrees with the hand parsing, where it is
looser (fractions, LaTeX, units) or stricter, plain numbers kept exact, and worker threads."""

from __future__ import annotations

import threading

import pytest

from rl.rewards import (
    MATH_VERIFY_MAX_CHARS,
    answers_match,
    boxed_reward,
    exact_match_reward,
    gsm8k_answer,
)


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        (r"\boxed{\frac{1}{2}}", "0.5"),  # fractions
        (r"\boxed{\dfrac12}", r"\frac{1}{2}"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{2^{1/2}}", r"\sqrt{2}"),  # LaTeX
        (r"\boxed{1+x}", "x+1"),
        (r"\boxed{(1, 2)}", "(1,2)"),
        (r"\boxed{12 \text{ cm}}", "12"),  # units
        (r"\boxed{\$72}", "72"),
        (r"\boxed{50\%}", "0.5"),  # a percent counts as its fraction ...
        (r"\boxed{50\%}", "50"),  # ... and as its number
    ],
)
def test_boxed_is_looser_than_text_comparison(response: str, answer: str) -> None:
    assert boxed_reward(response, answer) == 1.0


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        (r"\boxed{\frac{1}{3}}", "0.5"),
        (r"\boxed{\sqrt{3}}", r"\sqrt{2}"),
        (r"\boxed{12 apples and 3 pears}", "3"),
        (r"\boxed{x}", "y"),
    ],
)
def test_boxed_still_refuses_different_answers(response: str, answer: str) -> None:
    assert boxed_reward(response, answer) == 0.0


@pytest.mark.parametrize(
    ("response", "answer", "before", "now"),
    [
        (r"\boxed{\frac{1}{2}}", "0.5", 0.0, 1.0),  # looser: the final number inside was 2
        (r"so \boxed{12\text{ cm}}", "12", 1.0, 1.0),
        ("#### 3/4", "0.75", 0.0, 1.0),  # looser: a fraction after the marker
        ("#### $1,234", "1234", 0.0, 1.0),  # looser: a currency sign after the marker
        (r"#### \frac{3}{4}", "0.75", 0.0, 1.0),
        ("#### 3/4", "3", 1.0, 0.0),  # stricter: it was read as 3
        (r"\boxed{5-3}", "3", 1.0, 0.0),  # stricter: the box's value, not its final number
        (r"\boxed{12 apples and 3 pears}", "3", 1.0, 0.0),
    ],
)
def test_exact_match_where_the_library_differs(response: str, answer: str, before: float, now: float) -> None:
    del before  # what the hand parsing scored, for the reader (docs/configuration.md)
    assert exact_match_reward(response, answer) == now


@pytest.mark.parametrize(
    ("got", "want", "expected"),
    [
        ("0.1234568", "0.1234567", False),  # math_verify alone rounds to 6 places and says equal
        ("3.0000001", "3", False),
        ("1,000", "1000", True),
        ("-0", "0", True),
        ("12345678901234567891", "12345678901234567890", False),
    ],
)
def test_plain_numbers_compare_exactly(got: str, want: str, expected: bool) -> None:
    assert answers_match(got, want) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("#### 72 clips, 3 more", "72"),
        ("#### 71, or maybe 72", "71"),
        ("#### -5.", "-5"),
        ("#### 3/4\nthen more", "3/4"),
        ("#### $1,234.", "$1,234"),
        ("no marker", None),
        ("72 ####", ""),
    ],
)
def test_gsm8k_answer(text: str, expected: str | None) -> None:
    assert gsm8k_answer(text) == expected


def test_rewards_run_in_worker_threads() -> None:
    """math_verify's signal-based timeouts raise outside the main thread unless turned off."""
    results: list[float] = []
    errors: list[BaseException] = []

    def score() -> None:
        try:
            results.append(boxed_reward(r"\boxed{\frac{2}{4}}", "0.5"))
            results.append(exact_match_reward("#### 3/4", "0.75"))
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    thread = threading.Thread(target=score)
    thread.start()
    thread.join()
    assert errors == []
    assert results == [1.0, 1.0]


def test_long_answers_are_compared_as_text_only() -> None:
    long_sum = "+".join(["1"] * MATH_VERIFY_MAX_CHARS)
    assert answers_match(long_sum, str(MATH_VERIFY_MAX_CHARS)) is False
    assert answers_match(long_sum, long_sum) is True
