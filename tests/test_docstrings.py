"""Module docstrings say what their module owns, in at most 15 lines (issue 25): its job, its main
entry points, the invariants a caller must know, and where the detail lives (docs/<page>.md or
docs/internals.md §N). The detail itself is in docs/, once, not restated in every module."""

from __future__ import annotations

import ast

from tests.helpers import REPO_ROOT

PACKAGES = ("rl", "infra", "tasks", "flows", "bench")
MAX_LINES = 15


def module_docstring_lines() -> dict[str, int]:
    """Lines of each module's docstring (as `ast.get_docstring(..., clean=False)` gives it), by path."""
    lines = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            docstring = ast.get_docstring(ast.parse(path.read_text(), filename=str(path)), clean=False)
            if docstring:
                lines[str(path.relative_to(REPO_ROOT))] = len(docstring.splitlines())
    return lines


def test_module_docstrings_are_short():
    lines = module_docstring_lines()
    assert len(lines) > 50, f"found only {len(lines)} module docstrings: the walk is wrong"
    long = {path: count for path, count in lines.items() if count > MAX_LINES}
    assert not long, (
        f"module docstrings over {MAX_LINES} lines (say what the module owns and where the detail "
        "lives in docs/; move the detail there):\n" + "\n".join(f"  {n} {p}" for p, n in sorted(long.items()))
    )
