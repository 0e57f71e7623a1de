"""`rlboost up --database-url postgresql://...`: the stack's Prefect server on PostgreSQL.

Like the ledger's PostgreSQL tests, this needs `DATABASE_URL` (a PostgreSQL server whose role may
create databases); it creates a private database, brings the stack up on it, checks that the server
stores its deployments there, brings it down and drops the database. An unreachable PostgreSQL
fails `up` with the server's log and what to check.
"""

from __future__ import annotations

import os
import uuid

import pytest
from prefect.client.orchestration import SyncPrefectClient
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from infra.services.ports import free_port
from infra.stack.stack import StackError, down, up

pytestmark = pytest.mark.integration


@pytest.fixture
def postgres_database():
    """A fresh database on the server of $DATABASE_URL (dropped afterwards); its URL."""
    if not os.environ.get("DATABASE_URL"):
        pytest.skip(
            "DATABASE_URL is not set: set it to a PostgreSQL database to run the PostgreSQL stack test (`make test-full` does when one answers)"
        )
    admin_url = make_url(os.environ["DATABASE_URL"]).set(drivername="postgresql+psycopg")
    name = f"rlboost_stack_{uuid.uuid4().hex[:10]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin_url.set(drivername="postgresql", database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_stack_runs_its_prefect_server_on_postgresql(postgres_database, tmp_path):
    password = make_url(postgres_database).password
    state = up(state_dir=tmp_path, port=free_port(), database=postgres_database, echo=lambda _: None)
    try:
        assert state.database.startswith("postgresql+asyncpg://") and (not password or password not in state.database)
        with SyncPrefectClient(state.api_url) as client:
            assert client.read_deployment_by_name("rl-train/grpo").work_pool_name == "reserved"
        engine = create_engine(make_url(postgres_database).set(drivername="postgresql+psycopg"))
        with engine.connect() as connection:
            assert connection.execute(text("SELECT count(*) FROM deployment")).scalar() == 5
        engine.dispose()
    finally:
        down(state.state_dir, echo=lambda _: None)
    assert not any(p.members() for p in state.processes)


def test_unreachable_postgresql_fails_up_with_the_log_and_what_to_check(tmp_path):
    with pytest.raises(StackError) as caught:
        up(
            state_dir=tmp_path,
            database="postgresql://prefect:secret@127.0.0.1:9/prefect",
            timeout_s=120,
            echo=lambda _: None,
        )
    message = str(caught.value)
    assert "the Prefect server exited during start-up; check that PostgreSQL at 127.0.0.1:9 is running" in message
    assert "secret" not in message.split("Its log")[0]
    assert not (tmp_path / "stack.json").exists()
