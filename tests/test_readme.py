"""The documentation stays true: its configuration reference is generated from the config models, CI
runs only what the README tells a user to run, and no relative link points at a missing file."""

import re

from infra.run.config import reference_markdown
from tests.helpers import REPO_ROOT

# `[text](target)` and `![alt](target)`; a target ends at whitespace (a title may follow) or `)`.
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def test_readme_has_current_configuration_reference():
    page = REPO_ROOT / "docs" / "configuration.md"
    assert reference_markdown() in page.read_text(), (
        "docs/configuration.md's configuration reference is stale: regenerate it from "
        "infra.run.config.reference_markdown() and paste it under its heading"
    )
    readme = (REPO_ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "(docs/configuration.md)" in readme, "README.md's docs index does not link docs/configuration.md"


def test_ci_runs_what_the_readme_tells_a_user_to_run():
    """`.ci/run` calls nothing a user is not told to run: each of its commands is in the README."""
    readme = (REPO_ROOT / "README.md").read_text()
    lines = [line.strip() for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line and not line.startswith(("#", "set ", "cd "))]
    assert commands, ".ci/run runs no command"
    for command in commands:
        assert f"`{command}`" in readme or f"\n{command} " in readme, f"{command!r} is not in README.md"


def markdown_files():
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def test_no_broken_relative_link():
    """Every relative link and image in README.md and docs/*.md names a file that exists."""
    broken = []
    checked = 0
    for path in markdown_files():
        for target in MARKDOWN_LINK.findall(path.read_text()):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            file_part = target.split("#", 1)[0]
            checked += 1
            if not (path.parent / file_part).exists():
                broken.append(f"{path.relative_to(REPO_ROOT)}: {target}")
    assert checked, "no relative link found: the link pattern is wrong"
    assert not broken, "broken relative links (file: target):\n" + "\n".join(broken)


def test_every_docs_page_is_in_the_readme_index():
    readme = (REPO_ROOT / "README.md").read_text()
    missing = [p.name for p in (REPO_ROOT / "docs").glob("*.md") if f"](docs/{p.name})" not in readme]
    assert not missing, f"docs pages not linked from README.md's docs index: {missing}"
