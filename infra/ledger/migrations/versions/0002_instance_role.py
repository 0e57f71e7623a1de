"""Instances get a role: `rollout` (every instance recorded so far) or `trainer` (the trainer's machine).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01

The column is added with its CHECK constraint in one `ALTER TABLE ... ADD COLUMN` (SQLite needs no
table rebuild, which would cascade-delete the usage rows of a ledger with foreign keys enforced),
and dropped the same way (SQLite 3.35+ drops a column whose only CHECK is its own).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add `instances.role`, `rollout` for the rows already there."""
    op.add_column(
        "instances",
        sa.Column(
            "role",
            sa.String(length=16),
            sa.CheckConstraint("role IN ('rollout', 'trainer')", name=op.f("ck_instances_role")),
            nullable=False,
            server_default="rollout",
        ),
    )


def downgrade() -> None:
    """Drop `instances.role`."""
    op.drop_column("instances", "role")
