"""Bad bounded-staleness input is refused before any work, with one line naming the key and the
fix: a negative K, a non-positive `tis_cap`, the off-policy objective without staleness, a K the
token log does not retain, or a K without the fabric; the CLI prints it and exits 2."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from infra.cli.app import app
from infra.run.config import ConfigError, load_config


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"training.max_staleness": -1}, r"training.max_staleness: Input should be greater than or equal to 0"),
        ({"grpo.tis_cap": 0}, r"grpo.tis_cap: Input should be greater than 0"),
        ({"grpo.objective": "decoupled"}, r"set training.max_staleness >= 1, or grpo.objective: auto"),
        (
            {"training.max_staleness": 4, "fabric.retain_steps": 3},
            r"keeps up to 5 steps open .* set fabric.retain_steps >= 5",
        ),
        (
            {"training.max_staleness": 1, "fabric.enabled": False},
            r"fabric.enabled is false .* set fabric.enabled: true, or training.max_staleness: 0",
        ),
        ({"optim.updates_per_step": 0}, r"optim.updates_per_step: Input should be greater than or equal to 1"),
        (
            {"optim.updates_per_step": 2, "trainer.backend": "deepspeed", "trainer.world_size": 2},
            r"set trainer.backend: torch, or optim.updates_per_step: 1",
        ),
    ],
)
def test_bad_staleness_settings_name_the_key_and_the_fix(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, overrides)


def test_the_objective_follows_the_staleness():
    assert load_config().objective == "grpo"
    assert load_config(None, {"training.max_staleness": 2}).objective == "decoupled"
    assert load_config(None, {"training.max_staleness": 2, "grpo.objective": "grpo"}).objective == "grpo"


def test_the_cli_refuses_it_in_one_line_with_exit_2():
    result = CliRunner().invoke(app, ["train", "--set", "training.max_staleness=-2"])
    assert result.exit_code == 2, result.output
    assert "training.max_staleness" in result.output and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) <= 3, result.output
