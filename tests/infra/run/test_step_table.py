"""The step table of the Prefect artifacts (`infra.run.reporting`): the version each step published,
labelled `adapter version` when the run trains LoRA adapters, the slowest weight pull, the failed
instances replaced during the step, and the table's description saying what an adapter version weighs."""

from __future__ import annotations

from infra.run.reporting import STEP_COLUMNS, step_table_rows, table_description
from infra.run.workload import AdapterSize

ROW = {"step": 3, "policy_version": 3, "weights_mb": 0.5, "pull_s": 1.25, "weight_fallbacks": 0}


def test_a_step_shows_the_version_it_published_and_its_slowest_pull():
    (full,) = step_table_rows([ROW])
    assert (full["version"], full["weights MiB"], full["slowest pull s"]) == ("3", "0.5", "1.25")
    assert "adapter version" not in full
    (adapters,) = step_table_rows([ROW], adapters=True)
    assert adapters["adapter version"] == "3" and "version" not in adapters
    assert len(adapters) == len(STEP_COLUMNS)
    (no_pull,) = step_table_rows([{**ROW, "pull_s": None}])
    assert no_pull["slowest pull s"] == ""  # no pull in the step: blank, not 0


def test_a_step_shows_the_failed_instances_it_replaced_after_its_preemptions():
    (row,) = step_table_rows([{**ROW, "preemptions": 4, "replaced": 2}])
    headers = list(row)
    assert row["replaced"] == "2" and headers.index("replaced") == headers.index("preemptions") + 1


def test_the_description_says_the_versions_are_adapters_and_what_one_weighs():
    assert table_description("Every RL step of the run", None) == "Every RL step of the run"
    described = table_description("Every RL step of the run", AdapterSize(parameters=163_840, nbytes=655_360))
    assert described == "Every RL step of the run. Versions are LoRA adapters (0.62 MiB, 163,840 parameters each)"
