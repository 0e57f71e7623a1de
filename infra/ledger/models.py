"""The cost ledger's tables as SQLAlchemy 2 typed declarative models.

One row per run, per RL step, per instance (its lifecycle), per (step, instance) usage, per weight
transfer, per price quote and per VM the sweep deleted. Every table is keyed by the natural identity of what it records
(`run_id` first), which is what makes the writes of `infra.ledger.recorder` idempotent upserts.
Times are timezone-aware UTC datetimes (`UtcDateTime`, stored as TIMESTAMP WITH TIME ZONE on
PostgreSQL and as ISO text on SQLite). Money is USD, durations are seconds.

The schema is created and changed only by the Alembic migrations in `infra/ledger/migrations`;
a test checks that they produce exactly these models.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Double,
    ForeignKey,
    ForeignKeyConstraint,
    Integer,
    MetaData,
    String,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

CAPACITY_CLASSES = ("reserved", "ondemand", "spot")
INSTANCE_STATES = ("running", "terminating", "terminated")
TERMINATION_REASONS = ("preempted", "preempted_silent", "evicted", "scaled_down", "finished", "crashed")
"""Why an instance ended: the provider's reasons (`infra.providers.interface.TerminationReason`) plus
`evicted` (reaped by the controller after its heartbeat lapsed)."""
PREEMPTION_REASONS = ("preempted", "preempted_silent")
INSTANCE_ROLES = ("rollout", "trainer")
"""What an instance is to the run: `rollout` (it generates) or `trainer` (the machine the trainer
runs on; a co-located rollout instance is that machine, so it is recorded once, as `trainer`)."""

NAMING_CONVENTION = {
    "pk": "pk_%(table_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "ix": "ix_%(table_name)s_%(column_0_name)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
}


class UtcDateTime(TypeDecorator[datetime]):
    """An aware datetime, stored in UTC and read back as UTC on every backend. Naive values are refused."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value}: give the ledger timezone-aware times or epoch seconds")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UtcDateTime(), float: Double()}


class Run(Base):
    """One training run (one rollout fabric session)."""

    __tablename__ = "runs"

    run_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    name: Mapped[str | None] = mapped_column(String(256))
    """The run's configured name (`run.name`); several run ids may share it (resumes)."""
    started_at: Mapped[datetime]
    ended_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]
    """When the run's driver last said it is alive (every few seconds, `RunAccounting`; and every
    `fabric.cloud.sweep.interval_s` with cloud pools; None: never). The VM sweep deletes the VMs of
    a run whose heartbeat is stale; a report of a run that never ended bills up to it."""
    workload: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    """What the run ran, as `infra.run.workload.run_workload` describes it: `model`, `data`, `batch`,
    `pools` and `trainer` (None: recorded without one, or before migration 0004). A baseline
    comparison checks it; `rlboost cost --predict` maps it to a simulator scenario."""


class Step(Base):
    """One RL step of a run."""

    __tablename__ = "steps"
    __table_args__ = (CheckConstraint("tokens_trained >= 0", name="tokens_trained_nonnegative"),)

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    started_at: Mapped[datetime]
    ended_at: Mapped[datetime | None]
    tokens_trained: Mapped[int | None] = mapped_column(BigInteger)
    """Response tokens in the step's training batch (None until the step has trained)."""


class Instance(Base):
    """One instance of a run, with its lifecycle as last recorded."""

    __tablename__ = "instances"
    __table_args__ = (
        CheckConstraint(_one_of("capacity_class", CAPACITY_CLASSES), name="capacity_class"),
        CheckConstraint(_one_of("state", INSTANCE_STATES), name="state"),
        CheckConstraint(_one_of("reason", TERMINATION_REASONS), name="reason"),
        CheckConstraint("price_per_hour >= 0", name="price_nonnegative"),
    )

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    pool: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(
        String(16), CheckConstraint(_one_of("role", INSTANCE_ROLES), name="role"), server_default="rollout"
    )
    """`rollout` or `trainer` (`INSTANCE_ROLES`)."""
    provider: Mapped[str] = mapped_column(String(32))
    """`local`, `gcp` or `azure`."""
    zone: Mapped[str | None] = mapped_column(String(64))
    """Zone or region the instance ran in (None for local pools: priced in the reference region)."""
    machine_type: Mapped[str] = mapped_column(String(128))
    capacity_class: Mapped[str] = mapped_column(String(16))
    price_per_hour: Mapped[float | None]
    """What one hour of the instance costs (None: priced from the catalog by the report)."""
    launched_at: Mapped[datetime]
    ready_at: Mapped[datetime | None]
    """When it could first generate (engine loaded, weights pulled)."""
    notice_at: Mapped[datetime | None]
    terminated_at: Mapped[datetime | None]
    state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(String(32))
    exit_code: Mapped[int | None]


class Usage(Base):
    """What one instance did during one step."""

    __tablename__ = "usage"
    __table_args__ = (
        ForeignKeyConstraint(["run_id", "step"], ["steps.run_id", "steps.step"], ondelete="CASCADE"),
        ForeignKeyConstraint(
            ["run_id", "instance_id"], ["instances.run_id", "instances.instance_id"], ondelete="CASCADE"
        ),
        CheckConstraint("seconds >= 0 AND tokens_generated >= 0 AND tokens_wasted >= 0", name="nonnegative"),
    )

    run_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    seconds: Mapped[float]
    """Instance-seconds the instance spent on the step."""
    tokens_generated: Mapped[int] = mapped_column(BigInteger)
    """Tokens it generated for the step, wasted ones included."""
    tokens_wasted: Mapped[int] = mapped_column(BigInteger)
    """Generated tokens that were lost (never flushed, or discarded) and generated again."""


class WeightTransfer(Base):
    """One instance pulling one policy version from one source."""

    __tablename__ = "weight_transfers"
    __table_args__ = (
        ForeignKeyConstraint(
            ["run_id", "instance_id"], ["instances.run_id", "instances.instance_id"], ondelete="CASCADE"
        ),
        CheckConstraint("bytes >= 0 AND egress_usd >= 0", name="nonnegative"),
    )

    run_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    source: Mapped[str] = mapped_column(String(128), primary_key=True)
    """`trainer`, `store` or the peer instance id the bytes came from."""
    step: Mapped[int | None]
    """The step the transfer served (None: not attributed to a step)."""
    bytes: Mapped[int] = mapped_column(BigInteger)
    egress_usd: Mapped[float]
    """What moving the bytes cost (cross-region or internet egress), USD."""
    transferred_at: Mapped[datetime | None]
    seconds: Mapped[float | None]
    """Wall seconds of the whole pull these bytes were part of (every source of it together, so the
    pull's rows carry the same figure; None: recorded without one, or before migration 0005)."""


class SweptInstance(Base):
    """A cloud VM the sweep deleted because its run was not alive (`infra.run.sweep`)."""

    __tablename__ = "swept_instances"

    provider: Mapped[str] = mapped_column(String(32), primary_key=True)
    """`gcp` or `azure`."""
    instance_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    """The VM's name."""
    zone: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_label: Mapped[str] = mapped_column(String(128))
    """Its `rlboost-run` label: the run that launched it (in label form: lowercase, at most 63 characters)."""
    pool_label: Mapped[str] = mapped_column(String(128))
    """Its `rlboost-pool` label."""
    swept_at: Mapped[datetime]
    why: Mapped[str] = mapped_column(String(512))
    """Why its run was judged not alive (ended, heartbeat stale, unknown)."""
    swept_by: Mapped[str] = mapped_column(String(128))
    """The run whose sweep deleted it, or `cli` (`rlboost cloud sweep`)."""


class PriceQuote(Base):
    """A price a provider quoted for a pool at a time."""

    __tablename__ = "price_quotes"
    __table_args__ = (
        CheckConstraint(_one_of("capacity_class", CAPACITY_CLASSES), name="capacity_class"),
        CheckConstraint("usd_per_hour >= 0", name="price_nonnegative"),
    )

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True)
    pool: Mapped[str] = mapped_column(String(128), primary_key=True)
    quoted_at: Mapped[datetime] = mapped_column(primary_key=True)
    provider: Mapped[str] = mapped_column(String(32))
    machine_type: Mapped[str] = mapped_column(String(128))
    zone: Mapped[str | None] = mapped_column(String(64))
    capacity_class: Mapped[str] = mapped_column(String(16))
    usd_per_hour: Mapped[float]
