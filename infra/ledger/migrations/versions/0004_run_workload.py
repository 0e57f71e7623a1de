"""Runs record their workload: the model, data, batch, pools and trainer they ran.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03

`runs.workload` is a nullable JSON column added in place (no table rebuild on SQLite, see 0002):
runs recorded before it have none, and a baseline comparison refuses them (it cannot check that
both runs ran the same workload).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add `runs.workload`."""
    op.add_column("runs", sa.Column("workload", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Drop it again."""
    op.drop_column("runs", "workload")
