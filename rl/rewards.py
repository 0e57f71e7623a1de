"""Verifiable rewards: pure functions from (decoded response, reference answer) to a float.

Owns answer extraction (final number, last ``\\boxed{...}``, the answer after GSM8K's ``####``),
number normalisation, the correctness rewards (``exact_match``, ``boxed``), the format reward with
its patterns for the arithmetic families and the named ones (``boxed``, ``gsm8k``); the registry
(`rl.environments.registry.builtin_reward`) names them and combines them as
``correctness + format_weight * format``. Plain numbers are compared exactly here;
any other boxed or ``####`` answer is judged by `math_verify` (`answers_match`). Malformed model
output scores 0.0 and never raises; a reference answer that cannot be compared (e.g. a
non-numeric answer for ``exact_match``) is a dataset or configuration error and raises
``ValueError``.
"""

from __future__ import annotations

import functools
import re
import threading
from types import ModuleType
from typing import Protocol

ADD_FORMAT = r"-?\d+"
"""A response of the ``add`` family: just the sum, e.g. ``168``."""
CHAIN_FORMAT = r"\d+(?:\+\d+=\d+)+"
"""A response of the ``chain`` family: the first running sum, then one or more ``+N=M`` steps,
e.g. ``357+67=424+8=432``."""
BOXED_FORMAT = r"(?s).*\\boxed\{[^{}]+\}\.?"
"""A response that ends with its answer in a box, e.g. ``so it is \\boxed{12}.``"""
GSM8K_FORMAT = r"(?s).*#### ?[+-]?[0-9][0-9,]*(?:\.[0-9]+)?\.?"
"""A response that ends with ``#### <number>`` (GSM8K's convention), e.g. ``7 + 5 = 12. #### 12``."""
FORMAT_PATTERNS = {"add": ADD_FORMAT, "chain": CHAIN_FORMAT, "words": GSM8K_FORMAT}
"""Format pattern per arithmetic family (keys are `rl.problems.FAMILIES`)."""
NAMED_FORMATS = {"boxed": BOXED_FORMAT, "gsm8k": GSM8K_FORMAT}
"""Format patterns usable with any data source, by the name `reward.format` gives them."""

_DIGITS = r"(?P<int>[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?P<frac>\.[0-9]+)?"
_NUMBER_IN_TEXT = re.compile(
    r"(?:"
    r"(?<![\w.+)-])(?P<sign>[+-])?"  # a number starting a token, with an optional unary sign
    r"|(?<=[\w)][+-])"  # or the operand after a binary operator: "5-3" -> 3, not -3
    r")" + _DIGITS + r"(?!\w|[.,][0-9])"  # not glued to letters: "12a", "1.2.3" are no numbers
)
_NUMBER = re.compile(r"(?P<sign>[+-])?" + _DIGITS)
_LEADING_NUMBER = re.compile(r"\s*(?P<sign>[+-])?" + _DIGITS + r"(?!\w|[.,][0-9])")
_PLAIN_LEADING_NUMBER = re.compile(r"\s*(?P<sign>[+-])?" + _DIGITS + r"(?=$|\s|[,.;:!?)](?![0-9]))")
_BOXED = "\\boxed{"
_GSM8K = "####"
MATH_VERIFY_MAX_CHARS = 300
"""Longest answer text handed to `math_verify`; a longer one is compared as text only. Bounds
sympy's time where its signal-based timeout cannot run (any thread but the main one)."""
MATH_VERIFY_TIMEOUT_S = 5
"""`math_verify`'s parse and verify timeouts in the main thread (``signal.alarm``, whole seconds)."""


def normalize_number(s: str) -> str | None:
    """Canonical text of a number, or None if ``s`` (stripped) is not exactly one number.

    Accepts an optional sign, digits with optional thousands commas (``1,234``) and an optional
    decimal part. Commas, a leading ``+``, leading zeros and trailing decimal zeros are removed
    and ``-0`` becomes ``0``: ``"+1,234.50" -> "1234.5"``, ``"3.0" -> "3"``.
    """
    match = _NUMBER.fullmatch(s.strip())
    return None if match is None else _canonical(match)


def _canonical(match: re.Match[str]) -> str:
    integer = match["int"].replace(",", "").lstrip("0") or "0"
    fraction = (match["frac"] or "").rstrip("0").rstrip(".")
    text = integer + fraction
    return "-" + text if match["sign"] == "-" and text != "0" else text


def extract_final_number(text: str) -> str | None:
    """The last number in ``text``, normalised as by `normalize_number`; None if there is none.

    A number is not glued to letters, digits or dots on either side (``12a``, ``v1.2.3`` hold
    none) and a sign counts only as a unary sign: ``--3`` holds none, ``5-3`` ends with ``3``.
    """
    matches = list(_NUMBER_IN_TEXT.finditer(text))
    return _canonical(matches[-1]) if matches else None


def extract_boxed(text: str) -> str | None:
    """Stripped contents of the last ``\\boxed{...}`` (nested braces allowed).

    None if there is no ``\\boxed{`` or the last one's braces never balance.
    """
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth = 1
    begin = start + len(_BOXED)
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:index].strip()
    return None


def extract_gsm8k(text: str) -> str | None:
    """The number right after the last ``####`` (GSM8K's answer marker), normalised; None if the
    text has no ``####`` or no number follows it: ``"7 + 5 = 12\\n#### 12"`` -> ``"12"``."""
    start = text.rfind(_GSM8K)
    if start < 0:
        return None
    match = _LEADING_NUMBER.match(text, start + len(_GSM8K))
    return None if match is None else _canonical(match)


def gsm8k_answer(text: str) -> str | None:
    """The answer after the last ``####``, for comparison; None if the text has no ``####``.

    A plain number followed by the line's end, a space or punctuation is that number, normalised
    (``"#### 72 clips"`` -> ``"72"``); otherwise the rest of the line, stripped of a final dot, for
    `answers_match` to parse (``"#### 3/4"`` -> ``"3/4"``, ``"#### $1,234"`` -> ``"$1,234"``).
    """
    start = text.rfind(_GSM8K)
    if start < 0:
        return None
    rest = text[start + len(_GSM8K) :]
    match = _PLAIN_LEADING_NUMBER.match(rest)
    if match is not None:
        return _canonical(match)
    return rest.split("\n", 1)[0].strip().removesuffix(".").strip()


@functools.cache
def _math_verify() -> ModuleType:
    import math_verify  # here: sympy's import takes most of a second, and plain numbers never need it

    return math_verify


def answers_match(got: str, want: str) -> bool:
    """Whether the answer text ``got`` equals the reference ``want``.

    Two plain numbers (`normalize_number`) compare exactly; texts equal but for whitespace match.
    Anything else is parsed as LaTeX by `math_verify` (``parse`` the reference as the gold, then
    ``verify``): ``\\frac{1}{2}`` = ``0.5``, ``12\\text{ cm}`` = ``12``, ``x = 7`` = ``7``. Its
    signal-based timeouts run only in the main thread; elsewhere they are off and texts longer than
    `MATH_VERIFY_MAX_CHARS` are compared as text only.
    """
    got_number, want_number = normalize_number(got), normalize_number(want)
    if got_number is not None and want_number is not None:
        return got_number == want_number
    if "".join(got.split()) == "".join(want.split()):
        return True
    if not got.strip() or len(got) > MATH_VERIFY_MAX_CHARS or len(want) > MATH_VERIFY_MAX_CHARS:
        return False
    math_verify = _math_verify()
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    targets = [math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig()]
    gold = math_verify.parse(f"${want}$", extraction_config=targets, parsing_timeout=timeout)
    pred = math_verify.parse(f"${got}$", extraction_config=targets, parsing_timeout=timeout)
    return bool(gold and pred and math_verify.verify(gold, pred, timeout_seconds=timeout))


def _numeric_answer(answer: str) -> str:
    normalized = normalize_number(answer)
    if normalized is None and _GSM8K in answer:  # a GSM8K solution: "... #### 72"
        normalized = extract_gsm8k(answer)
    if normalized is None:
        raise ValueError(
            f"reference answer {answer!r} is not a number (nor a solution ending with '#### <number>'); "
            "exact_match needs numeric answers (use the 'boxed' reward for symbolic ones)"
        )
    return normalized


def exact_match_reward(response: str, answer: str) -> float:
    """1.0 if the response's answer equals the numeric ``answer`` (both normalised).

    A response containing ``\\boxed{`` is judged by its last box (an unbalanced box scores 0.0),
    one containing ``####`` by the answer after the last ``####`` (`gsm8k_answer`; nothing there
    scores 0.0), both through `answers_match`; any other by its final number. A GSM8K reference
    (a solution ending with ``#### 72``) counts as its number. Raises ValueError only if
    ``answer`` itself is not a number.
    """
    expected = _numeric_answer(answer)
    if _BOXED in response:
        boxed = extract_boxed(response)
        return 1.0 if boxed is not None and answers_match(boxed, expected) else 0.0
    if _GSM8K in response:
        got = gsm8k_answer(response)
        return 1.0 if got and answers_match(got, expected) else 0.0
    return 1.0 if extract_final_number(response.strip()) == expected else 0.0


def boxed_reward(response: str, answer: str) -> float:
    """1.0 if the last ``\\boxed{...}`` of the response matches ``answer`` (`answers_match`).

    A GSM8K reference (a solution ending with ``#### 72``) counts as its number. No (balanced)
    box, or an empty one, scores 0.0.
    """
    boxed = extract_boxed(response)
    if not boxed:
        return 0.0
    want = answer
    if normalize_number(answer) is None and _GSM8K in answer:  # a GSM8K reference: its number
        want = extract_gsm8k(answer) or answer
    return 1.0 if answers_match(boxed, want) else 0.0


def format_reward(response: str, pattern: str) -> float:
    """1.0 if the stripped response matches the regex ``pattern`` in full, else 0.0."""
    return 1.0 if re.fullmatch(pattern, response.strip()) else 0.0


class RewardFn(Protocol):
    """A reward: ``(decoded response, reference answer) -> float``."""

    def __call__(self, response: str, answer: str) -> float: ...
