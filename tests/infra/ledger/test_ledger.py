"""The cost ledger on a real database (SQLite; PostgreSQL when DATABASE_URL is set): Alembic
migrations up and down, idempotent upserts, lifecycle updates, and clear errors.

`record_small_run` records a realistic one-hour run (also used by tests/infra/cli/test_cost.py):
one reserved and three spot a2-highgpu-1g instances, two 30-minute steps, a preemption with
notice, a silent preemption, a late-launched spot instance and two weight pulls.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from pydantic import ValidationError
from sqlalchemy import func, inspect, select
from sqlalchemy.orm import Session

from infra.ledger.config import LedgerConfig
from infra.ledger.db import LedgerUnavailable, create_ledger_engine, current_revision, downgrade_to, upgrade_to_head
from infra.ledger.models import Base, Instance, PriceQuote, Run, Step, Usage, WeightTransfer
from infra.ledger.reader import UnknownRun
from infra.ledger.recorder import Ledger, LedgerWriteError, as_utc
from infra.providers.interface import InstanceRecord
from infra.providers.pool import PoolSpec

pytestmark = pytest.mark.integration

T0 = datetime(2025, 6, 1, tzinfo=UTC)
RUN_ID = "grpo-demo-1a2b3c4d"
RESERVED_PRICE, SPOT_PRICE = 3.67, 1.10
LEDGER_TABLES = {"runs", "steps", "instances", "usage", "weight_transfers", "price_quotes", "swept_instances"}


def at(seconds: float) -> float:
    """Epoch seconds `seconds` after T0 (the provider clock's unit)."""
    return T0.timestamp() + seconds


def record_small_run(ledger: Ledger, run_id: str = RUN_ID) -> None:
    """A one-hour run, written in the order a training flow would write it.

    Instances (all a2-highgpu-1g, local pools): reserved-0 ($3.67/h) 0-3600 s; spot-0 ($1.10/h)
    0-1230 s, noticed at 1200 s; spot-1 0-2400 s, silently killed at 2400 s; spot-2 1500-3600 s.
    Step 1 is 0-1800 s, step 2 is 1800-3600 s."""

    def launch(instance_id: str, capacity_class: str, price: float, t: float) -> InstanceRecord:
        record = InstanceRecord(instance_id, capacity_class, capacity_class, "a2-highgpu-1g", price, at(t))
        ledger.record_instance(run_id, record, provider="local")
        return record

    def end(record: InstanceRecord, notice: float, t: float, reason: str, exit_code: int) -> None:
        ended = dataclasses.replace(
            record, state="terminated", notice_at=at(notice), terminated_at=at(t), reason=reason, exit_code=exit_code
        )
        ledger.record_instance(run_id, ended, provider="local")

    def usage(step: int, instance_id: str, seconds: float, generated: int, wasted: int = 0) -> None:
        ledger.record_usage(
            run_id, step, instance_id, seconds=seconds, tokens_generated=generated, tokens_wasted=wasted
        )

    ledger.start_run(run_id, name="grpo-demo", started_at=at(0))
    spot_pool = PoolSpec(
        name="spot", capacity_class="spot", size=3, machine_type="a2-highgpu-1g", price_per_hour=SPOT_PRICE
    )
    ledger.record_quote(run_id, spot_pool, SPOT_PRICE, quoted_at=at(0))
    reserved0 = launch("reserved-0", "reserved", RESERVED_PRICE, 0)
    spot0 = launch("spot-0", "spot", SPOT_PRICE, 0)
    spot1 = launch("spot-1", "spot", SPOT_PRICE, 0)
    ledger.record_step(run_id, 1, started_at=at(0))
    end(spot0, notice=1200, t=1230, reason="preempted", exit_code=0)
    spot2 = launch("spot-2", "spot", SPOT_PRICE, 1500)
    ledger.record_transfer(
        run_id, "spot-2", 1, source="spot-1", nbytes=10**9, step=1, transferred_at=at(1550), seconds=4.5
    )
    usage(1, "reserved-0", 1800, 1000)
    usage(1, "spot-0", 1230, 800, wasted=50)
    usage(1, "spot-1", 1800, 1200)
    usage(1, "spot-2", 200, 200)  # up at 1600 s: 100 s of boot are not attributed to the step
    ledger.record_step(run_id, 1, started_at=at(0), ended_at=at(1800), tokens_trained=3000)
    ledger.record_step(run_id, 2, started_at=at(1800))
    ledger.record_transfer(run_id, "spot-2", 2, source="store", nbytes=10**9, egress_usd=0.12, step=2, seconds=12.25)
    end(spot1, notice=2400, t=2400, reason="preempted_silent", exit_code=-9)
    usage(2, "reserved-0", 1800, 1000)
    usage(2, "spot-1", 600, 400, wasted=40)
    usage(2, "spot-2", 1800, 1300)
    ledger.record_step(run_id, 2, started_at=at(1800), ended_at=at(3600), tokens_trained=3500)
    end(reserved0, notice=3600, t=3600, reason="finished", exit_code=0)
    end(spot2, notice=3600, t=3600, reason="finished", exit_code=0)
    ledger.finish_run(run_id, ended_at=at(3600))


def _count(ledger: Ledger, model) -> int:
    with Session(ledger.engine) as session:
        return session.scalar(select(func.count()).select_from(model))


def _get(ledger: Ledger, model, *key):
    with Session(ledger.engine) as session:
        return session.get(model, key)


# --- migrations ---------------------------------------------------------------------------------


def test_migrations_go_up_to_exactly_the_models_and_back_down(ledger_url):
    engine = create_ledger_engine(ledger_url)
    try:
        assert current_revision(engine) is None
        upgrade_to_head(engine)
        assert current_revision(engine) == "0005"
        assert LEDGER_TABLES <= set(inspect(engine).get_table_names())
        with engine.connect() as connection:  # the migrated schema is the models' schema, nothing missing or extra
            assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
        upgrade_to_head(engine)  # a no-op when current
        downgrade_to(engine, "base")
        assert current_revision(engine) is None
        assert not LEDGER_TABLES & set(inspect(engine).get_table_names())
        upgrade_to_head(engine)
        assert LEDGER_TABLES <= set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_the_workload_migration_keeps_the_runs_and_the_workload_round_trips(ledger_url):
    """0004 adds `runs.workload` in place: runs recorded before it have none; a recorded one comes
    back as it was written, and a later `start_run` without one (a heartbeat) keeps it."""
    workload = {"model": {"path": "m", "params": 7}, "batch": {"group_size": 8}, "pools": [], "trainer": None}
    with Ledger(ledger_url) as ledger:
        record_small_run(ledger)
        downgrade_to(ledger.engine, "0003")
        assert "workload" not in {c["name"] for c in inspect(ledger.engine).get_columns("runs")}
        upgrade_to_head(ledger.engine)
        assert ledger.report(RUN_ID).workload is None and _count(ledger, Usage) == 7
        ledger.start_run(RUN_ID, name="grpo-demo", workload=workload)
        ledger.heartbeat(RUN_ID, at=at(3600))
        assert ledger.report(RUN_ID).workload == workload


def test_the_transfer_seconds_migration_upgrades_a_0004_ledger_and_records_the_pull_time(ledger_url):
    """0005 adds `weight_transfers.seconds` in place: the transfers of a 0004 ledger stay, with no
    time (their steps' slowest pull is unknown, not 0); a pull recorded after it carries its time."""
    with Ledger(ledger_url) as ledger:
        record_small_run(ledger)
        assert [(s.transfer_bytes, s.pulls, s.pull_s_max) for s in ledger.report(RUN_ID).steps] == [
            (10**9, 1, 4.5),
            (10**9, 1, 12.25),
        ]
        downgrade_to(ledger.engine, "0004")
        assert "seconds" not in {c["name"] for c in inspect(ledger.engine).get_columns("weight_transfers")}
        upgrade_to_head(ledger.engine)
        assert current_revision(ledger.engine) == "0005"
        assert (_count(ledger, Usage), _count(ledger, WeightTransfer)) == (7, 2)
        report = ledger.report(RUN_ID)
        assert [(s.transfer_bytes, s.pulls, s.pull_s_max) for s in report.steps] == [(10**9, 1, None), (10**9, 1, None)]
        assert report.total_usd == pytest.approx(5.540833, abs=1e-6)  # what it cost is untouched
        ledger.record_transfer(RUN_ID, "spot-2", 2, source="store", nbytes=10**9, egress_usd=0.12, step=2, seconds=3.0)
        assert _get(ledger, WeightTransfer, RUN_ID, "spot-2", 2, "store").seconds == 3.0
        assert ledger.report(RUN_ID).steps[1].pull_s_max == 3.0


def test_the_role_migration_keeps_every_row_both_ways(ledger_url):
    """0002 adds `instances.role` without rebuilding the table (which on SQLite would cascade-delete
    the usage rows); the instances recorded before it are `rollout`, and a downgrade keeps the rows."""
    with Ledger(ledger_url) as ledger:
        record_small_run(ledger)
        downgrade_to(ledger.engine, "0001")
        assert "role" not in {c["name"] for c in inspect(ledger.engine).get_columns("instances")}
        assert (_count(ledger, Usage), _count(ledger, WeightTransfer)) == (7, 2)
        upgrade_to_head(ledger.engine)
        assert (_count(ledger, Instance), _count(ledger, Usage), _count(ledger, WeightTransfer)) == (4, 7, 2)
        assert {i.role for i in ledger.report(RUN_ID).instances} == {"rollout"}
        with pytest.raises(LedgerWriteError, match="roles"):
            ledger.record_instance(
                RUN_ID, InstanceRecord("x-0", "x", "spot", "a2-highgpu-1g", 1.0, at(0)), provider="local", role="boss"
            )


def test_opening_a_ledger_migrates_it_and_reopening_keeps_the_data(ledger_url):
    with Ledger(ledger_url) as first:
        record_small_run(first)
    with Ledger(ledger_url, create=False) as again:
        assert current_revision(again.engine) == "0005"
        assert _count(again, Usage) == 7


def test_an_in_memory_ledger_keeps_its_data_across_connections():
    with Ledger("sqlite://") as ledger:
        record_small_run(ledger)
        assert ledger.report(RUN_ID).tokens_trained == 6500


# --- idempotent writes --------------------------------------------------------------------------


def test_recording_the_same_run_twice_changes_nothing(ledger):
    record_small_run(ledger)
    counts = {model: _count(ledger, model) for model in (Run, Step, Instance, Usage, WeightTransfer, PriceQuote)}
    before = ledger.report(RUN_ID).as_dict()
    record_small_run(ledger)  # a replay after a crash
    assert counts == {Run: 1, Step: 2, Instance: 4, Usage: 7, WeightTransfer: 2, PriceQuote: 1}
    assert {model: _count(ledger, model) for model in counts} == counts
    assert ledger.report(RUN_ID).as_dict() == before


def test_instance_lifecycle_fills_in_and_a_stale_replay_does_not_revive_it(ledger):
    ledger.start_run("r", started_at=at(0))
    launched = InstanceRecord("spot-0", "spot", "spot", "a2-highgpu-1g", SPOT_PRICE, at(0))
    ledger.record_instance("r", launched, provider="gcp", zone="us-central1-a")
    ledger.record_instance("r", launched, provider="gcp", zone="us-central1-a", ready_at=at(20))
    noticed = dataclasses.replace(launched, state="terminating", notice_at=at(100))
    ledger.record_instance("r", noticed, provider="gcp", zone="us-central1-a")
    ledger.record_instance(
        "r",
        dataclasses.replace(noticed, state="terminated", terminated_at=at(130), reason="preempted", exit_code=0),
        provider="gcp",
    )
    ledger.record_instance("r", launched, provider="gcp")  # a stale record, replayed

    row = _get(ledger, Instance, "r", "spot-0")
    assert (row.state, row.reason, row.exit_code, row.zone) == ("terminated", "preempted", 0, "us-central1-a")
    assert (row.ready_at, row.notice_at, row.terminated_at) == (
        T0 + timedelta(seconds=20),
        T0 + timedelta(seconds=100),
        T0 + timedelta(seconds=130),
    )
    assert row.launched_at.tzinfo == UTC

    ledger.record_instance("r", launched, provider="gcp", reason="evicted")  # reaped by the controller
    assert _get(ledger, Instance, "r", "spot-0").reason == "evicted"


def test_the_first_ready_time_is_kept(ledger):
    ledger.start_run("r", started_at=at(0))
    launched = InstanceRecord("spot-0", "spot", "spot", "a2-highgpu-1g", SPOT_PRICE, at(0))
    ledger.record_instance("r", launched, provider="gcp")
    ledger.record_instance("r", launched, provider="gcp", ready_at=at(95))
    ledger.record_instance("r", launched, provider="gcp", ready_at=at(400))  # registered again later
    ledger.record_instance(
        "r", dataclasses.replace(launched, state="terminated", terminated_at=at(500)), provider="gcp"
    )
    assert _get(ledger, Instance, "r", "spot-0").ready_at == T0 + timedelta(seconds=95)


def test_repeats_replace_totals_keep_the_first_start_and_keep_values_not_given(ledger):
    ledger.start_run("r", name="first", started_at=at(0))
    ledger.start_run("r", name="renamed", started_at=at(999))  # a resumed session
    run = _get(ledger, Run, "r")
    assert (run.name, run.started_at) == ("renamed", T0)

    ledger.record_step("r", 1, started_at=at(0), ended_at=at(60), tokens_trained=500)
    ledger.record_step("r", 1, started_at=at(0))  # None keeps what is stored
    step = _get(ledger, Step, "r", 1)
    assert (step.ended_at, step.tokens_trained) == (T0 + timedelta(seconds=60), 500)

    ledger.record_instance(
        "r", InstanceRecord("spot-0", "spot", "spot", "a2-highgpu-1g", SPOT_PRICE, at(0)), provider="local"
    )
    ledger.record_usage("r", 1, "spot-0", seconds=30, tokens_generated=300, tokens_wasted=3)
    ledger.record_usage("r", 1, "spot-0", seconds=60, tokens_generated=700, tokens_wasted=5)  # totals, not increments
    usage = _get(ledger, Usage, "r", 1, "spot-0")
    assert (usage.seconds, usage.tokens_generated, usage.tokens_wasted) == (60, 700, 5)

    ledger.record_transfer("r", "spot-0", 1, source="store", nbytes=10, egress_usd=0.5)
    ledger.record_transfer("r", "spot-0", 1, source="store", nbytes=20, egress_usd=0.25)
    transfer = _get(ledger, WeightTransfer, "r", "spot-0", 1, "store")
    assert (transfer.bytes, transfer.egress_usd, transfer.step) == (20, 0.25, None)


def test_price_quotes_are_keyed_by_pool_and_time(ledger):
    ledger.start_run("r", started_at=at(0))
    pool = PoolSpec(name="spot", capacity_class="spot", size=2, machine_type="a2-highgpu-1g", price_per_hour=SPOT_PRICE)
    ledger.record_quote("r", pool, 1.10, quoted_at=at(0))
    ledger.record_quote("r", pool, 1.20, quoted_at=at(0))
    ledger.record_quote("r", pool, 1.30, quoted_at=at(60), zone="us-central1-a")
    assert _count(ledger, PriceQuote) == 2
    quote = _get(ledger, PriceQuote, "r", "spot", T0)
    assert (quote.usd_per_hour, quote.provider, quote.machine_type, quote.capacity_class) == (
        1.20,
        "local",
        "a2-highgpu-1g",
        "spot",
    )


def test_the_small_run_costs_what_a_hand_computation_says(ledger):
    record_small_run(ledger)
    report = ledger.report(RUN_ID)
    # Billed: reserved-0 3600 s at $3.67/h; spot 1230 + 2400 + 2100 = 5730 s at $1.10/h; egress $0.12.
    assert report.total_usd == pytest.approx(3.67 + 5730 * 1.10 / 3600 + 0.12)  # 5.540833
    assert report.spend("spot") == pytest.approx(1.750833, abs=1e-6)
    # Step 1: 1800 s reserved + (1230 + 1800 + 200) s spot; step 2: 1800 s reserved + 2400 s spot + egress.
    assert [s.cost_usd for s in report.steps] == pytest.approx([2.821944, 2.688333], abs=1e-6)
    assert report.unattributed_usd == pytest.approx(100 * 1.10 / 3600)  # spot-2's boot
    assert (report.tokens_generated, report.tokens_wasted, report.tokens_trained) == (5900, 90, 6500)
    assert report.usd_per_million_generated == pytest.approx(939.124294, abs=1e-6)
    assert report.usd_per_million_trained == pytest.approx(852.435897, abs=1e-6)
    assert ([s.preemptions for s in report.steps], report.preemptions) == ([1, 1], 2)
    assert report.transfer_bytes == 2 * 10**9
    assert not report.trainer_recorded  # reserved-0 is a rollout instance; no trainer was recorded


# --- errors -------------------------------------------------------------------------------------


def test_writes_out_of_order_or_out_of_range_say_what_is_missing(ledger):
    with pytest.raises(LedgerWriteError, match=r"record_step\('nope', 1\).*start_run"):
        ledger.record_step("nope", 1, started_at=at(0))
    with pytest.raises(LedgerWriteError, match=r"finish_run\('nope'\): no such run"):
        ledger.finish_run("nope")
    ledger.start_run("r", started_at=at(0))
    with pytest.raises(LedgerWriteError, match=r"record_usage\('r', 1, 'ghost'\).*record_step, record_instance"):
        ledger.record_usage("r", 1, "ghost", seconds=1, tokens_generated=1)
    odd = InstanceRecord("x-0", "x", "preemptible", "a2-highgpu-1g", 1.0, at(0))  # not a capacity class
    with pytest.raises(LedgerWriteError, match="record_instance"):
        ledger.record_instance("r", odd, provider="local")
    assert _count(ledger, Instance) == 0


def test_naive_datetimes_are_refused():
    assert as_utc(at(0)) == T0 and as_utc(T0) == T0 and as_utc(None) is None
    with pytest.raises(ValueError, match="naive datetime"):
        as_utc(datetime(2025, 6, 1))


def test_an_unknown_run_lists_the_runs_there_are(ledger):
    with pytest.raises(UnknownRun, match="holds no runs yet"):
        ledger.report("nope")
    record_small_run(ledger)
    with pytest.raises(
        UnknownRun, match=r"no run 'nope'.*holds 1: grpo-demo-1a2b3c4d \(grpo-demo, started 2025-06-01 00:00 UTC\)"
    ):
        ledger.report("nope")


def test_an_unreachable_database_names_the_url_without_its_password():
    with pytest.raises(LedgerUnavailable) as error:
        Ledger("postgresql://ledger:s3cret@127.0.0.1:9/ledger")
    message = str(error.value)
    assert "postgresql+psycopg://ledger:***@127.0.0.1:9/ledger" in message and "s3cret" not in message
    assert "Fix:" in message and "RLBOOST_LEDGER_URL" in message


def test_a_bad_url_an_unsupported_database_or_a_missing_driver_or_file_is_explained(tmp_path):
    with pytest.raises(LedgerUnavailable, match="is not a database URL"):
        Ledger("not a url")
    with pytest.raises(
        LedgerUnavailable, match=r"mysql://u:\*\*\*@h/db: the ledger supports SQLite and PostgreSQL only"
    ):
        Ledger("mysql://u:pw@h/db")
    with pytest.raises(LedgerUnavailable, match=r"psycopg2://u:\*\*\*@h/db: no driver .*postgresql\+psycopg://"):
        Ledger("postgresql+psycopg2://u:pw@h/db")
    with pytest.raises(LedgerUnavailable, match=r"no ledger database at .*missing\.sqlite"):
        Ledger(f"sqlite:///{tmp_path / 'missing.sqlite'}", create=False)
    assert not (tmp_path / "missing.sqlite").exists()


def test_the_url_is_the_configured_one_else_the_environment_else_the_default(tmp_path, monkeypatch):
    monkeypatch.delenv("RLBOOST_LEDGER_URL", raising=False)
    assert LedgerConfig().resolved_url() == "sqlite:///.rlboost/ledger.sqlite"
    monkeypatch.setenv("RLBOOST_LEDGER_URL", f"sqlite:///{tmp_path / 'env.sqlite'}")
    assert LedgerConfig(url="sqlite:///run.sqlite").resolved_url() == "sqlite:///run.sqlite"
    with Ledger() as ledger:
        assert ledger.url.endswith("env.sqlite")
    assert (tmp_path / "env.sqlite").is_file()
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        LedgerConfig(path="ledger.sqlite")
