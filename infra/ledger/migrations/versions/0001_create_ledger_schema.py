"""Create the ledger schema: runs, steps, instances, usage, weight transfers, price quotes.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create the runs, steps, instances, usage, weight_transfers and price_quotes tables."""
    op.create_table(
        "runs",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=256), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_runs")),
    )
    op.create_table(
        "instances",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("instance_id", sa.String(length=128), nullable=False),
        sa.Column("pool", sa.String(length=128), nullable=False),
        sa.Column("provider", sa.String(length=32), nullable=False),
        sa.Column("zone", sa.String(length=64), nullable=True),
        sa.Column("machine_type", sa.String(length=128), nullable=False),
        sa.Column("capacity_class", sa.String(length=16), nullable=False),
        sa.Column("price_per_hour", sa.Double(), nullable=True),
        sa.Column("launched_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ready_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("notice_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("terminated_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.String(length=32), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.CheckConstraint(
            "capacity_class IN ('reserved', 'ondemand', 'spot')", name=op.f("ck_instances_capacity_class")
        ),
        sa.CheckConstraint(
            "reason IN ('preempted', 'preempted_silent', 'evicted', 'scaled_down', 'finished', 'crashed')",
            name=op.f("ck_instances_reason"),
        ),
        sa.CheckConstraint("state IN ('running', 'terminating', 'terminated')", name=op.f("ck_instances_state")),
        sa.CheckConstraint("price_per_hour >= 0", name=op.f("ck_instances_price_nonnegative")),
        sa.ForeignKeyConstraint(["run_id"], ["runs.run_id"], name=op.f("fk_instances_run_id_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "instance_id", name=op.f("pk_instances")),
    )
    op.create_table(
        "price_quotes",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("pool", sa.String(length=128), nullable=False),
        sa.Column("quoted_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("provider", sa.String(length=32), nullable=False),
        sa.Column("machine_type", sa.String(length=128), nullable=False),
        sa.Column("zone", sa.String(length=64), nullable=True),
        sa.Column("capacity_class", sa.String(length=16), nullable=False),
        sa.Column("usd_per_hour", sa.Double(), nullable=False),
        sa.CheckConstraint(
            "capacity_class IN ('reserved', 'ondemand', 'spot')", name=op.f("ck_price_quotes_capacity_class")
        ),
        sa.CheckConstraint("usd_per_hour >= 0", name=op.f("ck_price_quotes_price_nonnegative")),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name=op.f("fk_price_quotes_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "pool", "quoted_at", name=op.f("pk_price_quotes")),
    )
    op.create_table(
        "steps",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("tokens_trained", sa.BigInteger(), nullable=True),
        sa.CheckConstraint("tokens_trained >= 0", name=op.f("ck_steps_tokens_trained_nonnegative")),
        sa.ForeignKeyConstraint(["run_id"], ["runs.run_id"], name=op.f("fk_steps_run_id_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "step", name=op.f("pk_steps")),
    )
    op.create_table(
        "usage",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("instance_id", sa.String(length=128), nullable=False),
        sa.Column("seconds", sa.Double(), nullable=False),
        sa.Column("tokens_generated", sa.BigInteger(), nullable=False),
        sa.Column("tokens_wasted", sa.BigInteger(), nullable=False),
        sa.CheckConstraint(
            "seconds >= 0 AND tokens_generated >= 0 AND tokens_wasted >= 0", name=op.f("ck_usage_nonnegative")
        ),
        sa.ForeignKeyConstraint(
            ["run_id", "instance_id"],
            ["instances.run_id", "instances.instance_id"],
            name=op.f("fk_usage_run_id_instances"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id", "step"], ["steps.run_id", "steps.step"], name=op.f("fk_usage_run_id_steps"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "step", "instance_id", name=op.f("pk_usage")),
    )
    op.create_table(
        "weight_transfers",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("instance_id", sa.String(length=128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("source", sa.String(length=128), nullable=False),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("egress_usd", sa.Double(), nullable=False),
        sa.Column("transferred_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("bytes >= 0 AND egress_usd >= 0", name=op.f("ck_weight_transfers_nonnegative")),
        sa.ForeignKeyConstraint(
            ["run_id", "instance_id"],
            ["instances.run_id", "instances.instance_id"],
            name=op.f("fk_weight_transfers_run_id_instances"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "instance_id", "version", "source", name=op.f("pk_weight_transfers")),
    )


def downgrade() -> None:
    """Drop every ledger table."""
    op.drop_table("weight_transfers")
    op.drop_table("usage")
    op.drop_table("steps")
    op.drop_table("price_quotes")
    op.drop_table("instances")
    op.drop_table("runs")
