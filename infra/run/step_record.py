"""The record of one RL step (`StepRecord`) and of the run so far (`History`): one field per figure,
its column in the step tables as field metadata (`Column`: header, format, the header a LoRA run
shows). The tables' columns derive from the fields (`step_columns`): a new field with a `Column`
is a new column. A step's `metrics.json` and the checkpoint's history rows are its fields as JSON
(`to_json`); a row written before a field existed loads with that field's default (`from_json`).
Runtime-free: pydantic and the standard library only."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict


@dataclass(frozen=True)
class Column:
    """A field's column in the step tables: its header, its `str.format` format, and the header a
    run with `model.lora` shows instead (its versions are adapters, not whole models)."""

    header: str
    format: str
    adapter_header: str | None = None

    def title(self, adapters: bool) -> str:
        return self.adapter_header if adapters and self.adapter_header else self.header

    def text(self, value: Any) -> str:
        """The value as the table shows it: blank for None, `lag:tokens ...` for a histogram."""
        if value is None:
            return ""
        if isinstance(value, dict):
            return " ".join(f"{k}:{self.format.format(v)}" for k, v in value.items())
        return self.format.format(int(value) if "d}" in self.format else value)


class StepRecord(BaseModel):
    """What one RL step measured. The flow sets every field; a field a row lacks (a partial record
    of a bench, a row older than the field) is None where unknown, else what a run without its
    feature measures (no staleness: lag 0, importance weight 1)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step: Annotated[int, Column("step", "{:d}")]
    reward: Annotated[float, Column("reward", "{:.3f}")]
    """Mean reward of the step's samples."""
    accuracy: Annotated[float | None, Column("train acc", "{:.3f}")] = None
    """Fraction of the step's samples that are correct."""
    eval_accuracy: Annotated[float | None, Column("held-out acc", "{:.3f}")] = None
    """Held-out accuracy after the step (None: not evaluated at this step)."""
    eval_pass_at_k: Annotated[dict[int, float] | None, Column("held-out pass@k", "{:.3f}")] = None
    """Held-out pass@k for each `eval.k` after the step, `k:value` (None: not evaluated at this step;
    `eval_accuracy` is its avg@k)."""
    tokens: Annotated[int, Column("tokens", "{:d}")]
    """Response tokens of the step's samples."""
    tokens_per_s: Annotated[float | None, Column("tokens/s", "{:.0f}")] = None
    rollout_s: Annotated[float | None, Column("rollout s", "{:.2f}")] = None
    train_s: Annotated[float | None, Column("train s", "{:.2f}")] = None
    train_overlap_s: Annotated[float | None, Column("train during rollout s", "{:.2f}")] = None
    """Seconds of training done while the rollout ran (groups trained as they completed)."""
    trainer_peak_rss_mb: Annotated[float | None, Column("trainer peak MiB", "{:.0f}")] = None
    step_s: Annotated[float | None, Column("step s", "{:.2f}")] = None
    entropy: Annotated[float | None, Column("entropy", "{:.3f}")] = None
    grad_norm: float | None = None
    kl: float | None = None
    preemptions: Annotated[int | None, Column("preemptions", "{:d}")] = None
    """Spot preemptions of the run so far (None: no fabric, the rollout ran in process)."""
    replaced: Annotated[int | None, Column("replaced", "{:d}")] = None
    """Failed rollout instances replaced during the step."""
    migrations: Annotated[int | None, Column("migrations", "{:d}")] = None
    """Samples continued on another instance from their logged tokens."""
    tokens_wasted: Annotated[int | None, Column("tokens wasted", "{:d}")] = None
    reaped_instances: int | None = None
    steals: int | None = None
    rejected_appends: int | None = None
    groups_dropped: int | None = None
    infra_failed: Annotated[dict[str, int] | None, Column("infra failed", "{}")] = None
    """Trajectories failed for the infrastructure (their environment), by kind, never scored
    (None: no fabric; `{}`: none failed)."""
    turns_mean: Annotated[float | None, Column("mean turns", "{:.2f}")] = None
    """Mean model turns per trajectory (None: no environment, one response per prompt)."""
    tool_calls: Annotated[int | None, Column("tool calls", "{:d}")] = None
    """Turns the environment answered with an observation (a tool's result), over the trajectories."""
    env_s: Annotated[float | None, Column("env s", "{:.2f}")] = None
    """Seconds the trajectories' environment steps took, summed over them."""
    tool_wait_fraction: Annotated[float | None, Column("tool wait", "{:.3f}")] = None
    """Of the trajectories' time from first claim to end, the fraction spent waiting for the
    environment's answers (summed over them)."""
    migrated_mid_turn: Annotated[int | None, Column("migrated mid-turn", "{:d}")] = None
    """Trajectories' continuations on another instance from inside a model turn (mid-generation,
    or a tool call awaiting its result)."""
    served_versions: Annotated[dict[str, int] | None, Column("served", "{}", adapter_header="served adapters")] = None
    """Alive rollout instances per policy version they held at the rollout's end, ``version:count``
    (None: no fabric)."""
    wrong_weight_instances: Annotated[int | None, Column("wrong weights", "{:d}")] = None
    """Of those, the instances whose weights sha differed from the publisher's for their version."""
    wrong_weights: int | None = None
    """Claims and flushes the token log refused during the rollout for a wrong weights sha: none of
    their tokens is trained."""
    t_local_s: float | None = None
    resumed_samples_done: int | None = None
    """Samples a dead attempt of this step had finished (a run resumed after a crash)."""
    resumed_samples_partial: int | None = None
    cost_usd: Annotated[float | None, Column("cost $", "{:.4f}")] = None
    policy_version: Annotated[int | None, Column("version", "{:d}", adapter_header="adapter version")] = None
    """The version published at the step's end."""
    weights_mb: Annotated[float | None, Column("weights MiB", "{:.1f}")] = None
    """Weight MiB the instances pulled during the step."""
    pulls: int | None = None
    pull_s: Annotated[float | None, Column("slowest pull s", "{:.2f}")] = None
    """The slowest weight pull's seconds (None: no pull)."""
    weight_fallbacks: Annotated[int | None, Column("weight fallbacks", "{:d}")] = None
    """Whole versions pulled instead of deltas, and payloads from other sources after a failed check."""
    version_lag_mean: Annotated[float, Column("version lag", "{:.2f}")] = 0.0
    version_lag_max: Annotated[int, Column("max lag", "{:d}")] = 0
    version_lag_histogram: Annotated[dict[str, int], Column("lag histogram", "{}")] = {}
    """Trained tokens per version lag."""
    objective: Annotated[str | None, Column("objective", "{}")] = None
    """The objective the trainer ran."""
    is_weight_mean: Annotated[float, Column("IS weight", "{:.3f}")] = 1.0
    is_weight_deviation: Annotated[float, Column("IS deviation", "{:.3f}")] = 0.0
    is_truncated_fraction: Annotated[float, Column("IS truncated", "{:.3f}")] = 0.0
    logprob_gap: Annotated[float | None, Column("logprob gap", "{:.4f}")] = None
    """Mean |trainer - engine| log-prob of the sampled tokens."""
    groups_generated_ahead: Annotated[int, Column("groups ahead", "{:d}")] = 0
    """Groups of later steps complete when this one ended (bounded staleness)."""

    def to_json(self) -> dict[str, Any]:
        """The record as `metrics.json` and the checkpoint's history hold it."""
        return self.model_dump(mode="json")

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> StepRecord:
        """A record from a stored row: fields it lacks take their defaults, keys no field has
        (a figure no longer recorded) are left out."""
        return cls.model_validate({key: value for key, value in row.items() if key in cls.model_fields})


@cache
def step_columns(record: type[StepRecord] = StepRecord) -> tuple[tuple[str, Column], ...]:
    """(field name, column) of each field of `record` that has a column, in field order."""
    return tuple(
        (name, meta) for name, info in record.model_fields.items() for meta in info.metadata if isinstance(meta, Column)
    )


@dataclass
class History:
    """What the run has measured so far (for artifacts, plots and the summary)."""

    steps: list[StepRecord] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    """(policy version, held-out accuracy) of each evaluation, the base policy's first."""

    def record(self, row: StepRecord) -> None:
        """Add a step's record (replacing an earlier record of the same step: a retried step)."""
        self.steps = [r for r in self.steps if r.step != row.step] + [row]

    def state(self) -> dict[str, Any]:
        """The history as a checkpoint holds it (JSON rows)."""
        return {"steps": [r.to_json() for r in self.steps], "evals": list(self.evals)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> History:
        """The history a checkpoint saved (rows of any earlier version of the record)."""
        return cls([StepRecord.from_json(r) for r in state["steps"]], [tuple(e) for e in state["evals"]])
