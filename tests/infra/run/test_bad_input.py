"""Bad input from the command line gets one line naming the field or argument and the fix, exit
status 2, before any work: an unsafe run name, a `--set` without `=`."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from infra.cli.app import app
from infra.run.config import ConfigError, load_config


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".hidden", "", "with space"])
def test_a_run_name_that_is_not_one_directory_name_is_refused(name):
    with pytest.raises(ConfigError, match=r"override run.name: run.name: .*letters, digits, '.', '_' and '-'"):
        load_config(None, {"run.name": name})


def test_a_safe_run_name_is_kept():
    assert load_config(None, {"run.name": "grpo_v2.1-b"}).run.directory.name == "grpo_v2.1-b"


@pytest.mark.parametrize("argument", ["run.steps", "=3"])
def test_set_without_key_equals_value_names_the_argument(argument):
    result = CliRunner().invoke(app, ["train", "--set", argument])
    assert result.exit_code == 2, result.output
    assert f"--set {argument!r}: expected key=value, e.g. --set run.steps=20" in result.output
    assert "Traceback" not in result.output
