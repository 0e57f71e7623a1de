"""`rlboost train` refuses a bad reward or environment before any work: one line naming the key,
what was found and the fix, exit status 2, nothing written; a model asked to call tools through a
chat template that cannot render them is refused the same way. The configuration's import paths
find modules in the current directory, as `python -m` would."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from infra.cli.app import app
from infra.run.config import parse_config
from rl.models import build_tiny_llama, save_model
from tests.helpers import tiny_shape
from tests.rl.test_tool_calls import STRICT

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


@pytest.mark.integration  # 15 s: imports the flow and Prefect, as `rlboost train` does before its preflight
def test_train_refuses_a_chat_template_that_cannot_render_the_tool_calls_it_is_asked_for(tmp_path: Path) -> None:
    model, tokenizer = build_tiny_llama(tiny_shape(smallest=True))
    tokenizer.chat_template = STRICT  # raises on a `tool` message
    save_model(model, tokenizer, tmp_path / "model")
    output_dir = tmp_path / "runs"
    sets = [f"model.path={tmp_path / 'model'}", f"run.output_dir={output_dir}", "environment.name=calculator"]
    sets += ["prompt.chat_template=true", "fabric.enabled=true"]
    result = runner.invoke(app, ["train", *(arg for value in sets for arg in ("--set", value))])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines[0] == "cannot start the run" and len(lines) == 2, result.output
    assert lines[1].startswith(
        f"prompt.chat_template: the model at {tmp_path / 'model'} is asked to call tools, but the chat template "
        "cannot render a tool message (Conversation roles must alternate"
    ), result.output
    assert "prompt.chat_template: false for the text format" in lines[1]
    assert not output_dir.exists()  # before any work


def test_train_finds_a_reward_in_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "here_rewards_37.py").write_text("def one(response):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    result = runner.invoke(app, ["train", "--set", "reward.function=here_rewards_37:one"])
    assert result.exit_code == 2, result.output
    assert "here_rewards_37:one takes (response) but a reward is called as fn(response, answer)" in result.output
