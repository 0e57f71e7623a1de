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
