"""`rlboost cost`: the report of a recorded run, printed and exported, and its error messages."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from infra.cli.app import app
from infra.ledger.recorder import Ledger
from infra.providers.interface import InstanceRecord
from tests.infra.ledger.test_ledger import RUN_ID, at, record_small_run
from tests.infra.ledger.test_ledger_comparison import record_baseline, record_hybrid, workload

runner = CliRunner()
WIDE = {"COLUMNS": "200"}


@pytest.fixture
def ledger_url(tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    with Ledger(url) as ledger:
        record_small_run(ledger)
    return url


def test_prints_cost_per_step_spend_per_class_and_totals_without_re_pricing(ledger_url):
    result = runner.invoke(app, ["cost", "--run", RUN_ID, "--db", ledger_url, "--wide"], env=WIDE)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    step1 = next(line for line in lines if line.startswith("│") and line.split("│")[1].strip() == "1")
    # step 1: 4 instances, 1800 + 1230 + 1800 + 200 instance-s, 3200 generated, 50 wasted, 3000 trained,
    # 1 preemption, 0 replaced, $2.8219
    expected = ["1", "4", "5030", "3200", "50", "3000", "1", "0", "2.8219"]
    assert [cell.strip() for cell in step1.split("│")[1:10]] == expected
    # spot-2 pulled version 1 (10^9 bytes) in 4.5 s during step 1, version 2 in 12.25 s in step 2
    assert [cell.strip() for cell in step1.split("│")[14:16]] == ["953.7", "4.50"]
    total = next(line for line in lines if line.startswith("│") and line.split("│")[1].strip() == "total")
    assert [cell.strip() for cell in total.split("│")[14:16]] == ["1907.3", "12.25"]
    assert any("spot" in line and "1.7508" in line and "2 │" in line for line in lines)  # 3 spot instances, 2 preempted
    for expected in ("5.5408", "939.12", "852.44", "2 / 0", "90 (2%)", "not recorded (set ledger.trainer)"):
        assert expected in result.output
    assert "1.8" in next(line for line in lines if "trained tokens/s" in line)  # 6500 tokens / 3600 s
    # The same instance-seconds re-priced at on-demand prices are no on-demand run: not shown.
    for gone in ("savings", "on-demand-only", "9.6402"):
        assert gone not in result.output


@pytest.mark.parametrize("flags", [[], ["--wide"], ["--columns", "generated,pulled MiB,pull_s_max"]])
def test_an_80_column_terminal_gets_every_cell_whole(ledger_url, tmp_path, flags):
    """By default the essential columns fit 80 columns; `--wide` and `--columns` print what was asked
    for whole (wider than the terminal if need be). No cell is ever cut to an ellipsis."""
    url = f"sqlite:///{tmp_path / 'both.sqlite'}"
    with Ledger(url) as ledger:
        record_baseline(ledger)
        record_hybrid(ledger)
    for args in (["--run", RUN_ID, "--db", ledger_url], ["--run", "hybrid-1", "--baseline", "base-1", "--db", url]):
        result = runner.invoke(app, ["cost", *args, *flags], env={"COLUMNS": "80"})
        assert result.exit_code == 0, result.output
        assert "…" not in result.output, result.output
        table = result.output.split("spend per capacity class")[0]
        if not flags:
            assert max(len(line) for line in result.output.splitlines()) <= 80, result.output
            assert "$/M trained" in table and "pulled MiB" not in table
        elif flags == ["--wide"]:
            assert "slowest pull s" in table and "trainer $" in table
        else:
            assert "pulled MiB" in table and "slowest pull s" in table and "cost $" not in table


def test_an_unknown_column_is_one_line_naming_the_choices(ledger_url):
    result = runner.invoke(app, ["cost", "--run", RUN_ID, "--db", ledger_url, "--columns", "cost_usd,speed"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [result.output.strip()]
    assert "unknown column 'speed'" in result.output and "pull_s_max" in result.output


def test_compares_with_a_measured_baseline_run_labelled_as_such(tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    with Ledger(url) as ledger:
        record_baseline(ledger)
        record_hybrid(ledger)
    json_path = tmp_path / "cost.json"
    result = runner.invoke(
        app, ["cost", "--run", "hybrid-1", "--baseline", "base-1", "--db", url, "--json", str(json_path)], env=WIDE
    )
    assert result.exit_code == 0, result.output
    totals, title, compared = result.output.partition("against a measured baseline run base-1 (grpo-demo)")
    assert title
    per_million = next(line for line in compared.splitlines() if "$ per million trained tokens" in line)
    assert "489.17" in per_million and "611.67" in per_million and "1.25x tokens per $" in per_million
    assert "2.00x" in next(line for line in compared.splitlines() if "trained tokens/s" in line)
    assert "1.8350 (63%)" in next(line for line in totals.splitlines() if "trainer's machine $" in line)
    comparison = json.loads(json_path.read_text())["comparison"]
    assert comparison["cost_efficiency"] == pytest.approx(3.67 / 2.935)
    assert comparison["throughput_ratio"] == pytest.approx(2.0)


def test_a_baseline_with_spot_instances_is_refused_with_the_fix(tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    with Ledger(url) as ledger:
        record_baseline(ledger)
        record_hybrid(ledger)
    result = runner.invoke(app, ["cost", "--run", "base-1", "--baseline", "hybrid-1", "--db", url], env=WIDE)
    assert result.exit_code == 2
    assert "baseline run hybrid-1 ran 2 spot instance(s)" in result.output and "reserved-only" in result.output


def test_a_baseline_of_another_model_and_batch_exits_2_naming_the_fields(tmp_path):
    """Through the real command line (a process, its console): one line naming each differing field, no traceback."""
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    with Ledger(url) as ledger:
        record_hybrid(ledger)
        record_baseline(ledger, "other-1", workload(**{"model.path": "models/other", "rollout.max_new_tokens": 64}))
    result = subprocess.run(
        [sys.executable, "-m", "infra.cli", "cost", "--run", "hybrid-1", "--baseline", "other-1", "--db", url],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "400"},
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output
    (line,) = [line for line in output.splitlines() if "differs in" in line]
    assert "model.path (run: '.rlboost/base-model', baseline: 'models/other')" in line
    assert "batch.max_new_tokens (run: 6, baseline: 64)" in line


def test_a_deepspeed_baseline_of_a_torch_trainer_run_exits_2_naming_the_backend(tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    with Ledger(url) as ledger:
        record_hybrid(ledger)
        record_baseline(ledger, "ds-1", workload(**{"trainer.backend": "deepspeed", "trainer.world_size": 2}))
    result = runner.invoke(app, ["cost", "--run", "hybrid-1", "--baseline", "ds-1", "--db", url], env=WIDE)
    assert result.exit_code == 2, result.output
    (line,) = [line for line in result.output.splitlines() if "differs in" in line]
    assert "trainer.backend (run: 'torch', baseline: 'deepspeed')" in line
    assert "trainer.world_size (run: 1, baseline: 2)" in line


def test_exports_csv_and_json_with_hand_computed_numbers(ledger_url, tmp_path):
    csv_path, json_path = tmp_path / "cost.csv", tmp_path / "cost.json"
    result = runner.invoke(
        app, ["cost", "--run", RUN_ID, "--db", ledger_url, "--csv", str(csv_path), "--json", str(json_path)], env=WIDE
    )
    assert result.exit_code == 0, result.output
    rows = [row for row in csv.DictReader(csv_path.open()) if row["step"] in ("1", "2", "total")]
    assert [row["step"] for row in rows] == ["1", "2", "total"]
    assert [float(row["cost_usd"]) for row in rows] == pytest.approx([2.821944, 2.688333, 5.540833], abs=1e-6)
    assert [float(row["spot_usd"]) for row in rows] == pytest.approx(
        [3230 * 1.1 / 3600, 2400 * 1.1 / 3600, 5730 * 1.1 / 3600]
    )
    assert [int(row["tokens_wasted"]) for row in rows] == [50, 40, 90]
    assert [int(row["transfer_bytes"]) for row in rows] == [10**9, 10**9, 2 * 10**9]
    assert [row["pulls"] for row in rows] == ["1", "1", ""]  # the total row: the run's bytes and slowest pull
    assert [float(row["pull_s_max"]) for row in rows] == [4.5, 12.25, 12.25]
    assert [int(row["preemptions"]) for row in rows] == [1, 1, 2]
    assert float(rows[2]["instance_seconds"]) == 3600 + 5730
    report = json.loads(json_path.read_text())
    assert report["run_id"] == RUN_ID and len(report["steps"]) == 2 and len(report["instances"]) == 4
    assert "savings_usd" not in report and "ondemand_only_usd" not in report and "comparison" not in report
    assert {c["capacity_class"]: c["spend_usd"] for c in report["classes"]} == pytest.approx(
        {"reserved": 3.67, "spot": 1.750833}, abs=1e-6
    )


def test_the_database_defaults_to_the_environment_variable(ledger_url, monkeypatch):
    monkeypatch.setenv("RLBOOST_LEDGER_URL", ledger_url)
    result = runner.invoke(app, ["cost", "--run", RUN_ID], env=WIDE)
    assert result.exit_code == 0 and "5.5408" in result.output


def test_an_unknown_run_lists_the_recorded_ones(ledger_url):
    result = runner.invoke(app, ["cost", "--run", "grpo-demo-00000000", "--db", ledger_url], env=WIDE)
    assert result.exit_code == 2
    assert "no run 'grpo-demo-00000000'" in result.output and f"{RUN_ID} (grpo-demo" in result.output


def test_a_machine_type_without_a_price_is_named_with_the_fix(ledger_url):
    with Ledger(ledger_url) as ledger:
        ledger.record_instance(
            RUN_ID, InstanceRecord("spot-9", "spot", "spot", "cpu-laptop", None, at(0)), provider="local"
        )
    result = runner.invoke(app, ["cost", "--run", RUN_ID, "--db", ledger_url], env=WIDE)
    assert result.exit_code == 2
    for expected in (
        "instance spot-9 (pool spot, spot)",
        "machine type 'cpu-laptop'",
        "(no region given)",
        "gcp_gpu_spot_price_changes.csv",
        "azure_gpu_prices.csv",
        "set the pool's price_per_hour",
    ):
        assert expected in result.output


def test_an_unreachable_or_missing_database_is_explained(tmp_path):
    result = runner.invoke(
        app, ["cost", "--run", RUN_ID, "--db", "postgresql://ledger:s3cret@127.0.0.1:9/ledger"], env=WIDE
    )
    assert result.exit_code == 1
    assert "postgresql+psycopg://ledger:***@127.0.0.1:9/ledger" in result.output and "s3cret" not in result.output
    result = runner.invoke(app, ["cost", "--run", RUN_ID, "--db", f"sqlite:///{tmp_path / 'none.sqlite'}"], env=WIDE)
    assert result.exit_code == 1 and "no ledger database at" in result.output and "--db" in result.output
