"""`rlboost simulate`: a bad scenario exits 2 naming file, line, field and fix; a small one prints
the table and writes the plot and the metrics."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from infra.cli.app import app
from tests.infra.sim.test_simulator import SMALL

runner = CliRunner()


def test_bad_scenario_exits_2_and_names_the_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nreserved:\n  gpu: H200\navailability:\n  trace: skynomad/h100/us-central1-b\n")
    result = runner.invoke(app, ["simulate", "--scenario", str(bad)])
    assert result.exit_code == 2
    assert f"{bad}:3: reserved.gpu: unknown GPU type 'H200'" in result.output and "Fix:" in result.output


def test_small_scenario_prints_the_table_and_writes_plot_and_json(tmp_path):
    scenario = tmp_path / "small.yaml"
    scenario.write_text(SMALL.replace("duration_s: 900", "duration_s: 200"))
    plot, metrics = tmp_path / "out" / "small.png", tmp_path / "small.json"
    result = runner.invoke(app, ["simulate", "-s", str(scenario), "--plot", str(plot), "--json", str(metrics)])
    assert result.exit_code == 0, result.output
    assert "rlboost_no_steal" in result.output and "x on-demand" in result.output
    assert plot.stat().st_size > 10_000
    data = json.loads(metrics.read_text())
    assert set(data["metrics"]) >= {"ondemand", "rlboost", "paper", "restart", "ondemand_equal_cost"}
