"""`rlboost train` refuses a bad reward or environment before any work: one line naming the key,
what was found and the fix, exit status 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from infra.cli.app import app
from infra.run.config import parse_config

runner = CliRunner()


@pytest.fixture
def user_rewards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "user_rewards_37.py").write_text("def one(response):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (
            ["environment.name=calculater"],
            "override environment.name: environment.name: Value error, unknown environment 'calculater'; "
            "choose one of calculator, verifiers, or give class: 'package.module:Class'",
        ),
        (
            ["environment.class=no_such_pkg_37.envs:Shell"],
            "override environment.class: environment.class: Value error, no module named 'no_such_pkg_37' "
            "(in 'no_such_pkg_37.envs:Shell'); install its package here and in the rollout instances, or fix the path",
        ),
        (
            ["reward.function=user_rewards_37:one"],
            "override reward.function: reward.function: Value error, user_rewards_37:one takes (response) but a "
            "reward is called as fn(response, answer); give it the parameters (response: str, answer: str)",
        ),
        (
            ["environment.name=calculator", "environment.max_turns=0"],
            "override environment.max_turns: environment.max_turns: Input should be greater than or equal to 1",
        ),
        (
            ["reward.function=rl.rewards:boxed_reward", "reward.kind=boxed"],
            "override reward.function: reward: Value error, reward.kind and reward.function exclude each other",
        ),
    ],
)
def test_train_refuses_a_bad_environment_or_reward_in_one_line(
    user_rewards: None, tmp_path: Path, sets: list[str], line: str
) -> None:
    output_dir = tmp_path / "runs"
    arguments = ["train", "--set", f"run.output_dir={output_dir}"]
    for value in sets:
        arguments += ["--set", value]
    result = runner.invoke(app, arguments)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines[0] == "configuration error" and len(lines) == 2, result.output
    assert lines[1].startswith(line), result.output
    assert not output_dir.exists()  # before any work


def test_a_run_configuration_with_an_environment_and_a_user_reward() -> None:
    config = parse_config(
        "environment:\n  name: calculator\n  max_turns: 3\nreward:\n  function: rl.rewards:boxed_reward\n"
        "training:\n  infra_failed: renormalize\nfabric:\n  enabled: true\n"
    )
    assert config.environment is not None and config.environment.name == "calculator"
    assert (config.environment.max_turns, config.environment.step_timeout_s, config.environment.retries) == (3, 10.0, 1)
    assert config.reward.function == "rl.rewards:boxed_reward" and config.training.infra_failed == "renormalize"
    assert parse_config("").environment is None and parse_config("").training.infra_failed == "drop_group"


def test_an_environment_class_is_given_under_the_key_class() -> None:
    config = parse_config("environment:\n  class: rl.environments.calculator:Calculator\nfabric:\n  enabled: true\n")
    assert config.environment is not None and config.environment.class_ == "rl.environments.calculator:Calculator"
    with pytest.raises(ValueError, match="x.yaml:2: environment.args: Value error, Calculator\\(\\) does not take"):
        parse_config("environment:\n  args: {digits: 3}\n  name: calculator\n", "x.yaml")
    with pytest.raises(ValueError, match="not both or neither"):
        parse_config("environment:\n  name: calculator\n  class: rl.environments.calculator:Calculator\n")
