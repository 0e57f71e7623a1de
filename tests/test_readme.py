"""The README's configuration reference is generated from the config models; keep it in sync."""


from infra.run.config import reference_markdown
from tests.helpers import REPO_ROOT


def test_readme_has_current_configuration_reference():
    readme = (REPO_ROOT / "README.md").read_text()
    assert reference_markdown() in readme, (
        "README.md's configuration reference is stale: regenerate it from infra.run.config.reference_markdown()"
    )
    assert "make demo" in readme and "make test" in readme
