"""`rlboost eval --run NAME [--checkpoint N]`: a run's checkpoint (the tiny model) evaluated in
process prints its pass@k record, the same as the evaluation called directly and as written under
the run's `evals/`; a k above `eval.samples`, an unknown run and an unknown checkpoint exit 2 with
one line, before any model is loaded."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infra.cli.app import app
from infra.run.identity import claim_identity
from tests.helpers import as_set_flags, save_tiny_model, tiny_run
from tests.infra.run.test_checkpoint_eval import checkpoint_of

runner = CliRunner()


@pytest.fixture
def run(tmp_path):
    """A run directory as a run leaves it: identity, and a checkpoint of step 3 (the tiny model)."""
    base = save_tiny_model(tmp_path / "base")
    overrides = tiny_run(base, tmp_path, "evaluated", None, {"eval.size": 4, "eval.samples": 4, "eval.k": [1, 2, 4]})
    directory = tmp_path / "runs" / "evaluated"
    directory.mkdir(parents=True)
    claim_identity(directory, "evaluated")
    checkpoint_of(base, directory, step=3)
    return overrides


def test_eval_prints_the_checkpoints_pass_at_k(run, tmp_path):
    flags = as_set_flags({**run, "run.name": "another"})  # --run names the run, whatever run.name says
    result = runner.invoke(app, ["eval", "--run", "evaluated", "--checkpoint", "3", "--in-process", "--json", *flags])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output.strip().splitlines()[-1])
    assert (record["run"], record["step"], record["where"], record["samples"]) == ("evaluated", 3, "in_process", 16)
    assert set(record["pass_at_k"]) == {"1", "2", "4"}
    written = json.loads((tmp_path / "runs" / "evaluated" / "evals" / "step_000003.in_process.json").read_text())
    assert written["pass_at_k"] == record["pass_at_k"]
    again = runner.invoke(app, ["eval", "--run", "evaluated", "--in-process", *flags])  # the newest checkpoint
    assert again.exit_code == 0 and "evaluated step 3: pass@1" in again.output, again.output


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--set", "eval.k=[1,8]"], "eval.k=[1, 8] has k=8 outside 1..eval.samples=4: raise eval.samples to 8"),
        (["--checkpoint", "5"], "has no checkpoint of step 5"),
        (["--run", "nobody"], "no run 'nobody'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(run, args, line):
    command = ["eval", "--run", "evaluated", "--in-process", *as_set_flags(run)]
    if args[0] == "--run":
        command[2] = args[1]
    else:
        command += args
    result = runner.invoke(app, command)
    assert result.exit_code == 2, result.output
    assert line in " ".join(result.output.split())
