"""`<run>/identity.json`: the first driver of a run directory makes the run's id, every later one
reads it back as the next attempt; a damaged file is refused, naming it."""

from __future__ import annotations

import json

import pytest

from infra.run.identity import claim_identity


def test_every_driver_of_a_run_directory_is_the_same_run(tmp_path):
    first = claim_identity(tmp_path, "demo")
    assert first.run_id.startswith("demo-") and first.attempt == 1 and first.instance_prefix == ""
    second = claim_identity(tmp_path, "demo")
    assert (second.run_id, second.attempt, second.instance_prefix) == (first.run_id, 2, "a2-")
    assert json.loads((tmp_path / "identity.json").read_text()) == {"run_id": first.run_id, "attempt": 2}
    (tmp_path / "other").mkdir()
    assert claim_identity(tmp_path / "other", "demo").run_id != first.run_id  # another directory, another run


def test_a_damaged_identity_file_is_refused_naming_it(tmp_path):
    (tmp_path / "identity.json").write_text('{"run_id": "demo-1')
    with pytest.raises(
        ValueError, match=rf"{tmp_path / 'identity.json'} is damaged .*remove it to start the run under a new id"
    ):
        claim_identity(tmp_path, "demo")


def test_rlboost_train_refuses_a_damaged_identity_file_before_any_work(tmp_path):
    from typer.testing import CliRunner

    from infra.cli.app import app
    from tests.helpers import save_tiny_model

    model = save_tiny_model(tmp_path / "base")
    run = tmp_path / "runs" / "damaged"
    run.mkdir(parents=True)
    (run / "identity.json").write_text("not json")
    sets = [f"model.path={model}", f"run.output_dir={tmp_path / 'runs'}", "run.name=damaged", "fabric.enabled=false"]
    result = CliRunner().invoke(app, ["train", *(arg for s in sets for arg in ("--set", s))])
    assert result.exit_code == 2, result.output
    assert "cannot start the run" in result.output and "identity.json is damaged" in result.output
    assert (run / "identity.json").read_text() == "not json", "nothing was written"
