"""The books add up: per-step costs and the named lines of what no step holds sum to the run's
total, on a real ledger (SQLite; PostgreSQL when DATABASE_URL is set), in the report, the summary,
`rlboost cost`'s tables, CSV and JSON.

The run, by hand (seconds from `at(0)`; the trainer $3.60/h = $0.001/s, spot $1.80/h = $0.0005/s):
trainer 0-1000 s; spot-0 0-450 s (preempted), booting until 150 s: its usage in step 1 is 250 s
of the step's 300; spot-1 500-1000 s. Step 1 is 100-400 s, an evaluation until step 2 at 500-800
s, then 200 s of shutdown. Egress: $0.05 for step 1's pull, $0.02 for a pull of no step.

- steps: step 1 = 300 s trainer + 250 s spot + $0.05 = $0.475; step 2 = 300 + 300 s = $0.45
- before step 1: 100 s trainer + 100 s spot-0 = $0.15; in step 1, not in usage: 50 s spot = $0.025
- between steps: 100 s trainer + 50 s spot-0 = $0.125 (the gap after step 1)
- after the last step: 200 s trainer + 200 s spot-1 = $0.30; egress outside steps: $0.02
- total: trainer $1.00 + spot 950 s $0.475 + egress $0.07 = $1.545 = 0.925 + 0.62
"""

from __future__ import annotations

import csv
import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from infra.cli.app import app
from infra.ledger.recorder import Ledger
from infra.providers.interface import InstanceRecord
from tests.infra.ledger.test_ledger import at

pytestmark = pytest.mark.integration

RUN = "books-1"
EXPECTED_LINES = {
    "before_step_1": 0.15,
    "between_steps": 0.125,
    "after_last_step": 0.30,
    "step_in_progress": 0.0,
    "in_steps_not_in_usage": 0.025,
    "egress_outside_steps": 0.02,
}


def record_run(ledger: Ledger, run_id: str = RUN) -> None:
    """The run of the module docstring, through the recorder API."""
    ledger.start_run(run_id, name="grpo-demo", started_at=at(0))
    machines = {
        "trainer": ("trainer", "reserved", 3.60, 0, 1000, "finished"),
        "spot-0": ("rollout", "spot", 1.80, 0, 450, "preempted"),
        "spot-1": ("rollout", "spot", 1.80, 500, 1000, "finished"),
    }
    for instance_id, (role, capacity_class, price, start, end, reason) in machines.items():
        record = InstanceRecord(instance_id, capacity_class, capacity_class, "a2-highgpu-1g", price, at(start))
        ledger.record_instance(run_id, record, provider="local", role=role)
        ended = replace(record, state="terminated", terminated_at=at(end), reason=reason)
        ledger.record_instance(run_id, ended, provider="local", role=role)
    ledger.record_transfer(run_id, "spot-0", 0, source="store", nbytes=10**9, egress_usd=0.02)
    ledger.record_transfer(run_id, "spot-0", 1, source="store", nbytes=10**9, egress_usd=0.05, step=1)
    for step, start, users in ((1, 100, {"trainer": 300, "spot-0": 250}), (2, 500, {"trainer": 300, "spot-1": 300})):
        ledger.record_step(run_id, step, started_at=at(start))
        for instance_id, seconds in users.items():
            ledger.record_usage(run_id, step, instance_id, seconds=seconds, tokens_generated=100)
        ledger.record_step(run_id, step, started_at=at(start), ended_at=at(start + 300), tokens_trained=1000)
    ledger.finish_run(run_id, ended_at=at(1000))


def test_the_steps_and_the_named_lines_add_up_to_the_total(ledger):
    record_run(ledger)
    report = ledger.report(RUN)
    assert [s.cost_usd for s in report.steps] == pytest.approx([0.475, 0.45])
    assert [s.idle_after_usd for s in report.steps] == pytest.approx([0.125, 0.0])
    assert {line.key: line.usd for line in report.unattributed} == pytest.approx(EXPECTED_LINES)
    assert report.total_usd == pytest.approx(1.545)
    parts = sum(s.cost_usd for s in report.steps) + sum(line.usd for line in report.unattributed)
    assert abs(parts - report.total_usd) < 1e-9
    assert abs(report.attributed_usd + report.unattributed_usd - report.total_usd) < 1e-9
    summary = report.summary()
    assert summary["unattributed_between_steps_usd"] == pytest.approx(0.125)
    keys = [key for key in summary if key.startswith("unattributed_") and key != "unattributed_usd"]
    assert abs(summary["attributed_usd"] + sum(summary[key] for key in keys) - summary["total_usd"]) < 1e-9


def test_egress_of_a_step_the_ledger_has_no_row_for_stays_in_the_books(ledger):
    """A pull reported for a step never recorded (e.g. the step of a driver that died before its
    `record_step`) is no step's cost: it is egress outside steps, and the books still add up."""
    record_run(ledger)
    ledger.record_transfer(RUN, "spot-1", 2, source="trainer", nbytes=10**9, egress_usd=0.04, step=9)
    report = ledger.report(RUN)
    assert [s.cost_usd for s in report.steps] == pytest.approx([0.475, 0.45])
    lines = {line.key: line.usd for line in report.unattributed}
    assert lines["egress_outside_steps"] == pytest.approx(0.02 + 0.04)
    assert report.egress_usd == pytest.approx(0.11) and report.total_usd == pytest.approx(1.545 + 0.04)
    assert abs(sum(s.cost_usd for s in report.steps) + report.unattributed_usd - report.total_usd) < 1e-9


def test_a_step_in_progress_is_its_own_line(ledger):
    record_run(ledger)
    ledger.record_step(RUN, 3, started_at=at(900))
    report = ledger.report(RUN)
    lines = {line.key: line.usd for line in report.unattributed}
    assert lines["step_in_progress"] == pytest.approx(100 * 0.001 + 100 * 0.0005)  # 900-1000 s: trainer, spot-1
    assert lines["after_last_step"] == pytest.approx(0.0)
    assert lines["between_steps"] == pytest.approx(0.125 + 100 * 0.0015)  # 800-900 s too, after step 2
    assert [s.idle_after_usd for s in report.steps] == pytest.approx([0.125, 0.15, 0.0])
    assert abs(sum(s.cost_usd for s in report.steps) + report.unattributed_usd - report.total_usd) < 1e-9


def test_the_cli_tables_csv_and_json_add_up(ledger_url, tmp_path):
    with Ledger(ledger_url) as ledger:
        record_run(ledger)
    csv_path, json_path = tmp_path / "cost.csv", tmp_path / "cost.json"
    result = CliRunner().invoke(
        app,
        ["cost", "--run", RUN, "--db", ledger_url, "--csv", str(csv_path), "--json", str(json_path)],
        env={"COLUMNS": "220"},
    )
    assert result.exit_code == 0, result.output
    for name, value in (("between steps", "0.1250"), ("before step 1", "0.1500"), ("egress outside steps", "0.0200")):
        assert any(line.startswith(f"│ {name}") and value in line for line in result.output.splitlines()), name
    assert "1.5450" in next(line for line in result.output.splitlines() if line.startswith("│ total "))
    rows = list(csv.DictReader(csv_path.open()))
    *parts, total = rows
    assert [row["step"] for row in parts] == ["1", "2", *(name for name in _names())]
    assert total["step"] == "total"
    assert abs(sum(float(row["cost_usd"]) for row in parts) - float(total["cost_usd"])) < 1e-9
    report = json.loads(json_path.read_text())
    parts_usd = sum(s["cost_usd"] for s in report["steps"]) + sum(line["usd"] for line in report["unattributed"])
    assert abs(parts_usd - report["total_usd"]) < 1e-9


def _names() -> list[str]:
    from infra.ledger.books import LINES

    return [name for name, _ in LINES.values()]


def test_the_plots_bars_and_the_run_summary_add_up_to_the_total(ledger, tmp_path):
    from infra.run.reporting import cost_bars, plot_curves
    from infra.run.step_record import StepRecord
    from infra.run.summary import cost_summary

    record_run(ledger)
    report = ledger.report(RUN)
    rows = [
        StepRecord(step=1, reward=0.2, tokens=10, cost_usd=0.475),
        StepRecord(step=2, reward=0.4, tokens=10, cost_usd=0.45),
    ]
    bars = cost_bars(rows, report)
    assert bars.x == [0, 1, 2, 3]
    heights = {label: values for label, _, values in bars.series}
    assert heights["between steps ($)"] == pytest.approx([0, 0.125, 0, 0])
    assert heights["before step 1 ($)"][0] == pytest.approx(0.15)
    assert heights["after the last step, other lines ($)"][-1] == pytest.approx(0.30 + 0.025 + 0.02)
    assert abs(sum(sum(values) for values in heights.values()) - report.total_usd) < 1e-9
    assert plot_curves(rows, [(2, 0.5)], tmp_path / "curves.png", report).stat().st_size > 0
    summary = cost_summary(report.summary())
    parts = [value for key, value in summary.items() if key.startswith("unattributed_")]
    assert len(parts) == 5  # every non-zero line (no step in progress)
    assert abs(summary["attributed_usd"] + sum(parts) - summary["total_usd"]) < 1e-9


def test_a_run_recorded_by_its_accounting_adds_up_with_the_costs_its_steps_reported(ledger):
    """The demo's shape through `RunAccounting`: 60 s before step 1 (boot, base evaluation), three
    30 s steps with 20 s evaluations between them, 40 s after the last; the trainer alone at
    $3.60/h. The per-step costs the flow plots (`step_cost_usd`, $0.03 each) left out the $0.14 of
    the other 140 s; the lines hold it."""
    from infra.ledger.config import TrainerMachine
    from infra.run.accounting import RunAccounting
    from tests.infra.ledger.test_ledger_comparison import Clock

    clock = Clock()
    trainer = TrainerMachine(machine_type="a2-highgpu-1g", price_per_hour=3.60)
    accounting = RunAccounting(ledger, "demo-1", "grpo-demo", (), None, clock=clock, trainer=trainer)
    clock.now += 60
    plotted = []
    for step in (1, 2, 3):
        accounting.begin_step(step)
        clock.now += 30
        accounting.end_step(step, tokens_trained=100)
        plotted.append(accounting.step_cost_usd(step))
        clock.now += 20 if step < 3 else 40
    report = accounting.report()
    accounting.finish()
    assert plotted == pytest.approx([0.03, 0.03, 0.03])
    lines = {line.key: line.usd for line in report.unattributed}
    assert (lines["before_step_1"], lines["between_steps"], lines["after_last_step"]) == pytest.approx(
        (0.06, 0.04, 0.04)
    )
    assert report.total_usd == pytest.approx(0.23)
    assert abs(sum(plotted) + report.unattributed_usd - report.total_usd) < 1e-9
