"""The ledger tests' databases: a SQLite file, and PostgreSQL when DATABASE_URL is set."""

from __future__ import annotations

import os
import uuid

import pytest
from sqlalchemy import create_engine, text

from infra.ledger.db import normalize_url
from infra.ledger.recorder import Ledger


def _postgres_url(schema: str) -> str:
    base = normalize_url(os.environ["DATABASE_URL"])
    return base.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(hide_password=False)


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request, tmp_path):
    """A fresh, empty database: a SQLite file, or a private schema in $DATABASE_URL (dropped after)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.sqlite'}"
        return
    if not os.environ.get("DATABASE_URL"):
        pytest.skip(
            "DATABASE_URL is not set: set it to a PostgreSQL database to run the PostgreSQL ledger tests (`make test-full` does when one answers)"
        )
    schema = f"ledger_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(normalize_url(os.environ["DATABASE_URL"]))
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield _postgres_url(schema)
    finally:
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def ledger(ledger_url):
    with Ledger(ledger_url) as opened:
        yield opened
