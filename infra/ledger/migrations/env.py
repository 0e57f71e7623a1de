"""Alembic environment of the cost ledger: migrates the connection that `infra.ledger.db` passes in.

Run migrations through `infra.ledger.db.upgrade_to_head(engine)` (there is no alembic.ini). To add a
revision after changing `infra.ledger.models`, autogenerate it against an up-to-date database:

    from alembic import command
    from infra.ledger.db import alembic_config, create_ledger_engine, upgrade_to_head
    engine = create_ledger_engine("sqlite:///scratch.sqlite"); upgrade_to_head(engine)
    with engine.begin() as connection:
        command.revision(alembic_config(connection), "what changed", autogenerate=True)

SQLite cannot ALTER most things, so migrations run in batch mode (`render_as_batch`).
"""

from alembic import context

from infra.ledger.models import Base, UtcDateTime


def render_item(kind, value, autogen_context):
    """Render `UtcDateTime` as the plain column type it stores, so revisions never import models."""
    if kind == "type" and isinstance(value, UtcDateTime):
        return "sa.DateTime(timezone=True)"
    return False


context.configure(
    connection=context.config.attributes["connection"],
    target_metadata=Base.metadata,
    render_as_batch=True,
    render_item=render_item,
)
with context.begin_transaction():
    context.run_migrations()
