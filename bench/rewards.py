"""Reward benchmark: the time of one reward call per kind of answer, in the main thread (with
math-verify's signal-based timeouts) and in a worker thread (without them).

    .venv/bin/python bench/rewards.py [--calls 200]

Prints one JSON line: per case, the median microseconds of one call after a warm-up
(``{"main_us": {case: us}, "thread_us": {case: us}, "import_s": s}``; ``import_s``: the first
call that imports math-verify, sympy with it). Cases: a plain number (``exact_match``, no
library), a number after ``####``, a numeric box, equal LaTeX (``\\frac`` against a decimal) and
unequal LaTeX (square roots) in a box. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rl.rewards import boxed_reward, exact_match_reward  # noqa: E402

CASES: dict[str, tuple[Callable[[str, str], float], str, str]] = {
    "plain_number": (exact_match_reward, "so the answer is 1,234", "1234"),
    "gsm8k_number": (exact_match_reward, "7 + 5 = 12\n#### 12", "12"),
    "boxed_number": (boxed_reward, r"so \boxed{42.0}", "42"),
    "boxed_latex_equal": (boxed_reward, r"so \boxed{\frac{1}{2}}", "0.5"),
    "boxed_latex_unequal": (boxed_reward, r"so \boxed{\sqrt{3}}", r"\sqrt{2}"),
}


def _median_us(calls: int) -> dict[str, float]:
    medians = {}
    for name, (reward, response, answer) in CASES.items():
        reward(response, answer)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            reward(response, answer)
            times.append(time.perf_counter() - start)
        medians[name] = round(statistics.median(times) * 1e6, 1)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description="Time one reward call per kind of answer.")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    start = time.perf_counter()
    boxed_reward(r"\boxed{\frac{1}{2}}", "0.5")
    import_s = time.perf_counter() - start
    main_us = _median_us(args.calls)
    thread_us: dict[str, float] = {}
    worker = threading.Thread(target=lambda: thread_us.update(_median_us(args.calls)))
    worker.start()
    worker.join()
    print(json.dumps({"main_us": main_us, "thread_us": thread_us, "import_s": round(import_s, 2)}))


if __name__ == "__main__":
    main()
