"""The rlboost CLI rejects bad configuration before starting anything, naming file, line and field."""

from __future__ import annotations

import pytest
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
    assert result.exit_code == 2 and "--set 'no-equals-sign': expected key=value" in result.output


def test_missing_config_file_is_named(tmp_path):
    result = runner.invoke(app, ["train", "--config", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2 and "nope.yaml" in result.output


@pytest.mark.integration
def test_train_on_a_checkpoint_of_another_trainer_exits_2_saying_what_to_set(prefect_harness, tmp_path):
    import torch

    from tests.helpers import save_tiny_model

    model = save_tiny_model(tmp_path / "base")
    checkpoint = tmp_path / "runs" / "mismatch" / "checkpoints" / "step_000003"
    checkpoint.mkdir(parents=True)
    state = {"backend": "deepspeed", "world_size": 2, "zero_stage": 2, "step": 3}
    torch.save({"trainer": state, "rng": None, "user": {}}, checkpoint / "trainer.pt")
    (checkpoint.parent / "latest").write_text(checkpoint.name)
    sets = [f"model.path={model}", f"run.output_dir={tmp_path / 'runs'}", "run.name=mismatch", "fabric.enabled=false"]
    result = runner.invoke(app, ["train", *(arg for s in sets for arg in ("--set", s))])
    assert result.exit_code == 2, result.output
    assert "written by the deepspeed trainer" in result.output
    assert "trainer.backend=deepspeed trainer.world_size=2" in result.output.replace("\n", " ")
