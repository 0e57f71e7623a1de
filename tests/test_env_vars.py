"""Environment variables are spelled once (`rl/env_vars.py`): no `RLBOOST_` string literal in the
code outside it (docstrings and comments may name them), and docs/environment.md is generated
from it."""

from __future__ import annotations

import ast
import re

from rl import env_vars
from tests.helpers import REPO_ROOT

PACKAGES = ("rl", "infra", "tasks", "flows", "bench")


def literals(path) -> list[int]:
    """Lines of the string literals (f-string parts included) that contain `RLBOOST_`, docstrings
    (a string expression statement: a module's, class's, function's or attribute's) excepted."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and "RLBOOST_" in node.value
        and id(node) not in docstrings
    ]


def test_no_rlboost_literal_outside_env_vars():
    found: dict[str, list[int]] = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            name = str(path.relative_to(REPO_ROOT))
            if name != "rl/env_vars.py" and (lines := literals(path)):
                found[name] = lines
    assert not found, (
        "RLBOOST_ names spelled outside rl/env_vars.py (use its constants; a new variable goes there "
        f"with its description): {found}"
    )


def test_the_checker_sees_literals_not_docstrings(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        '"""RLBOOST_A"""\nX = 1\n"""RLBOOST_B"""\nY = "${RLBOOST_C}"\nZ = f"$RLBOOST_E {Y}"  # RLBOOST_F\n\n\n'
        'def f():\n    """RLBOOST_D"""\n'
    )
    assert literals(path) == [4, 5]


def test_every_variable_once_with_a_description():
    names = [v.name for v in env_vars.VARIABLES]
    assert len(names) == len(set(names)) >= 20
    for v in env_vars.VARIABLES:
        assert re.fullmatch(r"RLBOOST_[A-Z0-9_]+", v.name) and v.description.endswith("."), v
        assert getattr(env_vars, v.name.removeprefix("RLBOOST_")) == v.name, f"{v.name}: its constant"


def test_environment_page_is_generated_from_env_vars():
    page = REPO_ROOT / "docs" / "environment.md"
    assert page.read_text() == env_vars.page(), (
        "docs/environment.md is stale: regenerate it with `python -m rl.env_vars`"
    )
    assert all(f"`{v.name}`" in page.read_text() for v in env_vars.VARIABLES)
