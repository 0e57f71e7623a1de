"""`rlboost import-model`: converts a model directory, says whether a chat template came along,
and refuses a missing source, a directory without a model and a non-empty output cleanly (exit 2,
no traceback)."""

from __future__ import annotations

from typer.testing import CliRunner

from infra.cli.app import app
from rl.models import load_model
from tests.helpers import save_tiny_model

runner = CliRunner()


def test_import_model_converts_and_reports_a_missing_chat_template(tmp_path):
    source = save_tiny_model(tmp_path / "tiny")
    result = runner.invoke(app, ["import-model", str(source), "--output", str(tmp_path / "out"), "--dtype", "fp16"])
    assert result.exit_code == 0, result.output
    assert "fp16" in result.output and "chat template: none" in result.output
    model, tokenizer = load_model(tmp_path / "out")
    assert next(model.parameters()).numel() > 0 and tokenizer("1+2=").input_ids


def test_import_model_errors_are_clean(tmp_path):
    cases = [
        ([str(tmp_path / "missing"), "--output", str(tmp_path / "o1")], "does not exist"),
        ([str(tmp_path), "--output", str(tmp_path / "o2")], "holds no model"),
    ]
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "file").write_text("x")
    source = save_tiny_model(tmp_path / "sub" / "tiny")
    cases.append(([str(source), "--output", str(taken)], "--force"))
    cases.append(([str(source), "--output", str(tmp_path / "o3"), "--dtype", "int8"], "--dtype"))
    for args, expected in cases:
        result = runner.invoke(app, ["import-model", *args])
        assert result.exit_code == 2, result.output
        assert expected in result.output and "Traceback" not in result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
