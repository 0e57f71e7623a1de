"""The rlboost CLI rejects bad configuration before starting anything, naming file, line and field."""

from __future__ import annotations

from typer.testing import CliRunner

from infra.cli.app import app

runner = CliRunner()


def test_train_with_a_bad_config_exits_2_and_names_the_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  steps: 3\ngrpo:\n  clip_eps: 1.5\n  klcoef: 0.1\n")
    result = runner.invoke(app, ["train", "--config", str(bad)])
    assert result.exit_code == 2
    assert f"{bad}:4: grpo.clip_eps" in result.output
    assert f"{bad}:5: grpo.klcoef: unknown key" in result.output


def test_set_override_with_bad_value_and_bad_syntax():
    result = runner.invoke(app, ["pretrain", "--set", "pretrain.accuracy_threshold=2"])
    assert result.exit_code == 2 and "pretrain.accuracy_threshold" in result.output
    result = runner.invoke(app, ["pretrain", "--set", "no-equals-sign"])
    assert result.exit_code != 0 and "KEY=VALUE" in result.output


def test_missing_config_file_is_named(tmp_path):
    result = runner.invoke(app, ["train", "--config", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2 and "nope.yaml" in result.output
