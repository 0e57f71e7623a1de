"""The step record and the step table of the Prefect artifacts (`infra.run.step_record`,
`infra.run.reporting`): the table's columns are the record's fields that have a column (a new field
is a new column), the version each step published is labelled `adapter version` when the run trains
LoRA adapters, history rows written before a field existed still load, and the table's description
says what an adapter version weighs."""

from __future__ import annotations

from typing import Annotated

from infra.run.reporting import progress_status, step_table_rows, table_description
from infra.run.step_record import Column, History, StepRecord, step_columns
from infra.run.workload import AdapterSize

ROW = StepRecord(step=3, reward=0.5, tokens=40, policy_version=3, weights_mb=0.5, pull_s=1.25, weight_fallbacks=0)

FIRST_ROW = {  # a history row as the first version of the flow wrote it (no cost, version, lag, ...)
    "step": 1,
    "reward": 0.25,
    "accuracy": 0.25,
    "eval_accuracy": None,
    "tokens": 96,
    "tokens_per_s": 480.0,
    "rollout_s": 0.2,
    "train_s": 0.1,
    "entropy": 1.5,
    "grad_norm": 0.8,
    "kl": 0.0,
    "step_s": 0.4,
}

FLOW_KEYS = [  # every key metrics.json had while the step row was a dict (users and benches read them)
    *FIRST_ROW,
    *("train_overlap_s", "trainer_peak_rss_mb", "cost_usd", "policy_version", "weights_mb", "pulls", "pull_s"),
    *("weight_fallbacks", "version_lag_mean", "version_lag_max", "version_lag_histogram", "objective"),
    *("is_weight_mean", "is_weight_deviation", "is_truncated_fraction", "logprob_gap", "groups_generated_ahead"),
    *("tokens_wasted", "migrations", "reaped_instances", "steals", "rejected_appends", "groups_dropped"),
    *("t_local_s", "preemptions", "replaced", "resumed_samples_done", "resumed_samples_partial"),
]


def test_a_step_shows_the_version_it_published_and_its_slowest_pull():
    (full,) = step_table_rows([ROW])
    assert (full["version"], full["weights MiB"], full["slowest pull s"]) == ("3", "0.5", "1.25")
    assert "adapter version" not in full
    (adapters,) = step_table_rows([ROW], adapters=True)
    assert adapters["adapter version"] == "3" and "version" not in adapters
    assert len(adapters) == len(step_columns())
    (no_pull,) = step_table_rows([ROW.model_copy(update={"pull_s": None})])
    assert no_pull["slowest pull s"] == ""  # no pull in the step: blank, not 0


def test_a_step_shows_the_failed_instances_it_replaced_after_its_preemptions():
    (row,) = step_table_rows([ROW.model_copy(update={"preemptions": 4, "replaced": 2})])
    headers = list(row)
    assert row["replaced"] == "2" and headers.index("replaced") == headers.index("preemptions") + 1


def test_the_tables_columns_are_the_records_fields_so_a_new_field_is_a_new_column():
    (row,) = step_table_rows([ROW.model_copy(update={"version_lag_histogram": {"0": 30, "1": 10}})])
    assert list(row) == [column.header for _, column in step_columns()]
    assert len(set(row)) == len(row) and row["lag histogram"] == "0:30 1:10" and row["step"] == "3"

    class WithTurns(StepRecord):  # what a helper adding a figure writes: a field, and nothing in reporting
        turns: Annotated[int | None, Column("turns", "{:d}")] = None
        """Turns of the step's trajectories."""

    (row,) = step_table_rows([WithTurns(step=1, reward=0.5, tokens=8, turns=3)])
    assert list(row)[-1] == "turns" and row["turns"] == "3"


def test_metrics_json_keeps_every_key_the_step_row_had():
    assert set(FLOW_KEYS) <= set(ROW.to_json())
    assert StepRecord.from_json(ROW.to_json()) == ROW


def test_history_rows_written_before_a_field_existed_load_with_its_default():
    state = {"steps": [FIRST_ROW, {**FIRST_ROW, "step": 2, "lr": 1e-5}], "evals": [[0, 0.25], [2, 0.5]]}
    history = History.from_state(state)  # "lr": a figure no longer recorded, left out
    first = history.steps[0]
    assert (first.step, first.reward, first.tokens, first.kl) == (1, 0.25, 96, 0.0)
    assert (first.version_lag_mean, first.version_lag_max, first.version_lag_histogram) == (0.0, 0, {})
    assert (first.is_weight_mean, first.is_truncated_fraction, first.groups_generated_ahead) == (1.0, 0.0, 0)
    assert first.cost_usd is first.pull_s is first.preemptions is first.objective is None
    assert history.evals == [(0, 0.25), (2, 0.5)]
    (row,) = step_table_rows(history.steps[:1])
    assert (row["reward"], row["cost $"], row["preemptions"], row["IS weight"]) == ("0.250", "", "", "1.000")
    assert History.from_state(history.state()) == history  # the checkpoint's round trip
    history.record(ROW.model_copy(update={"step": 2}))  # a retried step replaces its record
    assert [r.step for r in history.steps] == [1, 2] and history.steps[-1].policy_version == 3


def test_the_description_says_the_versions_are_adapters_and_what_one_weighs():
    assert table_description("Every RL step of the run", None) == "Every RL step of the run"
    described = table_description("Every RL step of the run", AdapterSize(parameters=163_840, nbytes=655_360))
    assert described == "Every RL step of the run. Versions are LoRA adapters (0.62 MiB, 163,840 parameters each)"


def test_the_progress_line_counts_preemptions_and_migrations_on_the_fabric_only():
    """A preemption is the demo's point: the progress line counts them (and the samples migrated,
    over the run), the instances' own lines go to the run log; an in-process rollout shows neither."""
    history = History(evals=[(0, 0.25), (2, 0.5)])
    history.record(StepRecord(step=1, reward=0.5, tokens=10, preemptions=1, migrations=3))
    history.record(StepRecord(step=2, reward=0.75, tokens=10, preemptions=2, migrations=4))
    assert progress_status(history) == "reward 0.75  held-out acc 0.50  preempted 2  migrated 7"
    in_process = History([StepRecord(step=1, reward=0.5, tokens=10)], [(0, 0.25)])
    assert progress_status(in_process) == "reward 0.50  held-out acc 0.25"
