"""The README stays true: its configuration reference is generated from the config models, and CI
runs only what it tells a user to run."""

from infra.run.config import reference_markdown
from tests.helpers import REPO_ROOT


def test_readme_has_current_configuration_reference():
    readme = (REPO_ROOT / "README.md").read_text()
    assert reference_markdown() in readme, (
        "README.md's configuration reference is stale: regenerate it from infra.run.config.reference_markdown()"
    )
    assert "make demo" in readme and "make test" in readme


def test_ci_runs_what_the_readme_tells_a_user_to_run():
    """`.ci/run` calls nothing a user is not told to run: each of its commands is in the README."""
    readme = (REPO_ROOT / "README.md").read_text()
    lines = [line.strip() for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line and not line.startswith(("#", "set ", "cd "))]
    assert commands, ".ci/run runs no command"
    for command in commands:
        assert f"`{command}`" in readme or f"\n{command} " in readme, f"{command!r} is not in README.md"
