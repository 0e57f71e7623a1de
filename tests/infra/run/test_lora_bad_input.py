"""Bad LoRA input through the real command line: an unknown target module, r < 1, a LoRA run
resuming a full run's checkpoint and the reverse. Each gets one line naming the key or file and
the fix, exit status 2, no traceback, and nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from infra.cli.app import app
from rl.checkpoint import save_checkpoint
from rl.config import GRPOConfig, LoraSettings, OptimConfig
from rl.models import load_policy
from tests.helpers import run_trainer, save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def files(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")} if root.exists() else {}


def train(model_dir: Path, runs: Path, *overrides: str):
    arguments = [f"model.path={model_dir}", f"run.output_dir={runs}", "run.name=lora", *overrides]
    return CliRunner().invoke(app, ["train", *(arg for pair in arguments for arg in ("--set", pair))])


def one_line_exit_2(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in text, text


def test_an_unknown_target_module_is_named_with_the_layers_there_are(model_dir, tmp_path):
    result = train(model_dir, tmp_path / "runs", "model.lora.target_modules=[q_proj, qproj]")
    one_line_exit_2(result, "model.lora.target_modules: 'qproj' matches no linear layer", "down_proj, gate_proj")
    assert not (tmp_path / "runs").exists()


def test_a_rank_below_one_is_named(model_dir, tmp_path):
    result = train(model_dir, tmp_path / "runs", "model.lora.r=0")
    one_line_exit_2(result, "model.lora.r", "greater than or equal to 1")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("saved", "flags", "message"),
    [
        (None, ["model.lora.r=4"], "holds a full fine-tuning run (every weight), but this run has model.lora set"),
        (LoraSettings(r=4), [], "holds LoRA adapters (model.lora r=4), but this run has no model.lora"),
    ],
)
def test_a_checkpoint_of_the_other_kind_is_refused_before_any_work(model_dir, tmp_path, saved, flags, message):
    checkpoints = tmp_path / "runs" / "lora" / "checkpoints"
    trainer = run_trainer(load_policy(model_dir), 0, GRPOConfig(), OptimConfig(), lora=saved)
    save_checkpoint(checkpoints, trainer, {"cursor": 0})
    before = files(tmp_path / "runs")
    result = train(model_dir, tmp_path / "runs", *flags)
    one_line_exit_2(result, "cannot start the run", str(checkpoints / "step_000000"), message)
    assert files(tmp_path / "runs") == before  # nothing written
