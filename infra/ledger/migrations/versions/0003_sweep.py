"""The VM sweep's records: runs get a heartbeat, and the VMs it deleted get a table.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

`runs.heartbeat_at` is a nullable column added in place (no table rebuild on SQLite, see 0002);
`swept_instances` refers to no other table: a swept VM's run may not be in this ledger at all.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add `runs.heartbeat_at` and `swept_instances`."""
    op.add_column("runs", sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "swept_instances",
        sa.Column("provider", sa.String(length=32), nullable=False),
        sa.Column("instance_id", sa.String(length=128), nullable=False),
        sa.Column("zone", sa.String(length=64), nullable=False),
        sa.Column("run_label", sa.String(length=128), nullable=False),
        sa.Column("pool_label", sa.String(length=128), nullable=False),
        sa.Column("swept_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("why", sa.String(length=512), nullable=False),
        sa.Column("swept_by", sa.String(length=128), nullable=False),
        sa.PrimaryKeyConstraint("provider", "instance_id", "zone", name=op.f("pk_swept_instances")),
    )


def downgrade() -> None:
    """Drop them again."""
    op.drop_table("swept_instances")
    op.drop_column("runs", "heartbeat_at")
