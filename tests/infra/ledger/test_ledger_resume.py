"""A run whose driver died stops costing at its last heartbeat, and the driver that takes it over
(`Ledger.resume_run`) closes the dead attempt's instances there, in SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from infra.ledger.models import Instance
from infra.ledger.recorder import Ledger
from infra.providers.interface import InstanceRecord

RUN_ID = "identity-0a1b2c3d"
T0 = 1_750_000_000.0


def test_a_dead_attempt_costs_up_to_its_heartbeat_and_its_instances_close_there(ledger_url):
    with Ledger(ledger_url) as ledger:
        ledger.start_run(RUN_ID, name="identity", started_at=T0)
        for instance_id, launched in (("reserved-0", T0), ("spot-0", T0 + 10)):
            record = InstanceRecord(instance_id, instance_id[:-2], "spot", "a2-highgpu-1g", 3.6, launched)
            ledger.record_instance(RUN_ID, record, provider="local")
        late = InstanceRecord("spot-1", "spot", "spot", "a2-highgpu-1g", 3.6, T0 + 200)  # after the last beat
        ledger.record_instance(RUN_ID, late, provider="local")
        ledger.heartbeat(RUN_ID, at=T0 + 100)
        dead = ledger.report(RUN_ID)
        assert dead.as_of == datetime.fromtimestamp(T0 + 100, UTC)
        assert ledger.report(RUN_ID).total_usd == dead.total_usd  # not growing with the clock
        assert abs(dead.total_usd - 3.6 * (100 + 90) / 3600) < 1e-9

        assert ledger.resume_run(RUN_ID, at=T0 + 500) == 3
        ledger.start_run(RUN_ID, name="identity", started_at=T0 + 500)
        resumed = ledger.report(RUN_ID, as_of=T0 + 1000)
        with Session(ledger.engine) as session:
            rows = session.scalars(select(Instance).where(Instance.run_id == RUN_ID))
            ends = {i.instance_id: (i.terminated_at, i.reason) for i in rows}
        beat = datetime.fromtimestamp(T0 + 100, UTC)
        assert ends == {
            "reserved-0": (beat, "crashed"),
            "spot-0": (beat, "crashed"),
            "spot-1": (datetime.fromtimestamp(T0 + 200, UTC), "crashed"),  # never before its launch
        }
        assert resumed.total_usd == dead.total_usd and resumed.started_at == datetime.fromtimestamp(T0, UTC)
        assert ledger.resume_run(RUN_ID) == 0  # nothing left open
        assert ledger.resume_run("never-recorded") == 0
