"""Weight transfers record how long their pull took.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03

`weight_transfers.seconds` is a nullable float column added in place (no table rebuild on SQLite,
see 0002): transfers recorded before it have none, and the report's slowest pull of their steps
is then unknown (None), not zero.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add `weight_transfers.seconds`."""
    op.add_column("weight_transfers", sa.Column("seconds", sa.Double(), nullable=True))


def downgrade() -> None:
    """Drop it again."""
    op.drop_column("weight_transfers", "seconds")
