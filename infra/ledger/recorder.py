"""The ledger's write API: `Ledger(url)` records runs, steps, instances, usage, weight transfers
and price quotes, builds a run's `CostReport` and compares a run with a measured baseline run.

Every write is one transaction and an idempotent upsert keyed by what it records (a run; (run,
step); (run, instance); (run, step, instance) for usage, which takes totals, not increments; ...),
so calling it again (a retry, a resumed controller after a crash) never duplicates anything; an
instance's `state` never goes back, and `resume_run` closes a dead attempt's open instances at its
last heartbeat. Times are epoch seconds (the provider clock of `InstanceRecord`) or timezone-aware
datetimes. Rows refer to each other: record the run before its steps and instances, and a step and
an instance before their usage, else `LedgerWriteError` says what is missing; an unreachable
database raises `LedgerUnavailable` (URL without password, and the fix). Every method's key and
what a repeat does: docs/cost-ledger.md ("In code").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Protocol

from sqlalchemy import case, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError

from infra.ledger.comparison import BaselineComparison, compare
from infra.ledger.config import resolve_ledger_url
from infra.ledger.db import LedgerUnavailable, create_ledger_engine, translate_errors, upgrade_to_head
from infra.ledger.models import (
    INSTANCE_STATES,
    Base,
    Instance,
    PriceQuote,
    Run,
    Step,
    SweptInstance,
    Usage,
    WeightTransfer,
)
from infra.ledger.reader import load_run
from infra.ledger.report import CostReport, build_report
from infra.pricing.catalog import Catalog, default_catalog

Moment = float | datetime
"""Epoch seconds or a timezone-aware datetime."""
_INSERTS = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}


class LedgerWriteError(ValueError):
    """A write the database refused (a missing run, step or instance; a value out of range)."""


class InstanceLike(Protocol):
    """What `record_instance` reads: the fields of `infra.providers.interface.InstanceRecord`."""

    @property
    def instance_id(self) -> str: ...
    @property
    def pool(self) -> str: ...
    @property
    def capacity_class(self) -> str: ...
    @property
    def machine_type(self) -> str: ...
    @property
    def price_per_hour(self) -> float | None: ...
    @property
    def launched_at(self) -> Moment: ...
    @property
    def state(self) -> str: ...
    @property
    def notice_at(self) -> Moment | None: ...
    @property
    def terminated_at(self) -> Moment | None: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def exit_code(self) -> int | None: ...


class PoolLike(Protocol):
    """What `record_quote` reads: the fields of `infra.providers.pool.PoolSpec`."""

    @property
    def name(self) -> str: ...
    @property
    def provider(self) -> str: ...
    @property
    def machine_type(self) -> str: ...
    @property
    def capacity_class(self) -> str: ...


def _later_state(new: Any, stored: Any) -> Any:
    """The further along of two instance states (a replayed stale record never revives an instance)."""
    rank = {state: index for index, state in enumerate(INSTANCE_STATES)}
    return case((case(rank, value=new) >= case(rank, value=stored), new), else_=stored)


def _first_time(new: Any, stored: Any) -> Any:
    """The stored time if there is one, else the new one (a first ready time is never overwritten)."""
    return func.coalesce(stored, new)


def as_utc(moment: Moment | None) -> datetime | None:
    """Epoch seconds or an aware datetime as an aware UTC datetime (None stays None; naive is refused)."""
    if moment is None:
        return None
    if not isinstance(moment, datetime):
        return datetime.fromtimestamp(moment, UTC)
    if moment.tzinfo is None:
        raise ValueError(f"naive datetime {moment}: give the ledger timezone-aware times or epoch seconds")
    return moment.astimezone(UTC)


class Ledger:
    """The cost ledger at one database URL (see the module docstring for the write semantics)."""

    def __init__(self, url: str | None = None, *, create: bool = True) -> None:
        """Open the ledger at `url` (default: `resolve_ledger_url()`) and migrate it to the current
        schema. `create=False` refuses a SQLite file that does not exist yet."""
        self.url = resolve_ledger_url(url)
        self.engine = create_ledger_engine(self.url, must_exist=not create)
        self._insert = _INSERTS[self.engine.dialect.name]
        try:
            upgrade_to_head(self.engine)
        except LedgerUnavailable:
            self.engine.dispose()
            raise

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # --- writes --------------------------------------------------------------------------------

    def start_run(
        self,
        run_id: str,
        *,
        name: str | None = None,
        started_at: Moment | None = None,
        workload: dict[str, Any] | None = None,
    ) -> None:
        """Record a run (`started_at` defaults to now; a repeat keeps the first one) and what it runs
        (`workload`, `models.Run.workload`; a repeat with one replaces it)."""
        values = {
            "run_id": run_id,
            "name": name,
            "started_at": as_utc(started_at) or datetime.now(UTC),
            "workload": workload,
        }
        self._upsert(Run, values, f"start_run({run_id!r})", insert_only=("started_at",))

    def finish_run(self, run_id: str, *, ended_at: Moment | None = None) -> None:
        """Mark a run finished (`ended_at` defaults to now)."""
        statement = update(Run).where(Run.run_id == run_id).values(ended_at=as_utc(ended_at) or datetime.now(UTC))
        with self._writing(f"finish_run({run_id!r})") as connection:
            if connection.execute(statement).rowcount == 0:
                raise LedgerWriteError(f"finish_run({run_id!r}): no such run; call start_run first")

    def heartbeat(
        self, run_id: str, *, at: Moment | None = None, name: str | None = None, reopen: bool = False
    ) -> None:
        """The run's driver is alive at `at` (default now); records the run first if it is new.
        `reopen`: the run (re)starts now, so an `ended_at` of an earlier session is cleared."""
        at_utc = as_utc(at) or datetime.now(UTC)
        self.start_run(run_id, name=name, started_at=at_utc)
        values: dict[str, Any] = {"heartbeat_at": at_utc}
        if reopen:
            values["ended_at"] = None
        with self._writing(f"heartbeat({run_id!r})") as connection:
            connection.execute(update(Run).where(Run.run_id == run_id).values(**values))

    def record_swept(
        self,
        *,
        provider: str,
        instance_id: str,
        zone: str,
        run_label: str,
        pool_label: str,
        why: str,
        swept_by: str,
        swept_at: Moment | None = None,
    ) -> None:
        """Record a VM the sweep deleted (`swept_at` defaults to now)."""
        values = {
            "provider": provider,
            "instance_id": instance_id,
            "zone": zone,
            "run_label": run_label,
            "pool_label": pool_label,
            "why": why[:512],
            "swept_by": swept_by,
            "swept_at": as_utc(swept_at) or datetime.now(UTC),
        }
        self._upsert(SweptInstance, values, f"record_swept({provider}, {instance_id!r})")

    def resume_run(self, run_id: str, *, at: Moment | None = None) -> int:
        """A new driver takes the run over: every instance of it still open (a dead attempt's) is
        terminated `crashed` at the run's last heartbeat (or `at` if it has none; never before the
        instance's launch), and the run is no longer ended. Returns how many instances it closed;
        0 for a run the ledger does not hold yet."""
        fallback = as_utc(at) or datetime.now(UTC)
        with self._writing(f"resume_run({run_id!r})") as connection:
            run = connection.execute(select(Run.heartbeat_at).where(Run.run_id == run_id)).first()
            if run is None:
                return 0
            last_alive = run.heartbeat_at or fallback
            open_instances = (Instance.run_id == run_id) & Instance.terminated_at.is_(None)
            closed = connection.execute(
                update(Instance)
                .where(open_instances)
                .values(
                    state="terminated",
                    reason="crashed",
                    terminated_at=case((Instance.launched_at > last_alive, Instance.launched_at), else_=last_alive),
                )
            ).rowcount
            connection.execute(update(Run).where(Run.run_id == run_id).values(ended_at=None))
        return closed

    def record_step(
        self,
        run_id: str,
        step: int,
        *,
        started_at: Moment,
        ended_at: Moment | None = None,
        tokens_trained: int | None = None,
    ) -> None:
        """Record RL step `step` of a run: when it started, and once known when it ended and how
        many response tokens it trained on."""
        values = {
            "run_id": run_id,
            "step": step,
            "started_at": as_utc(started_at),
            "ended_at": as_utc(ended_at),
            "tokens_trained": tokens_trained,
        }
        self._upsert(Step, values, f"record_step({run_id!r}, {step})")

    def record_instance(
        self,
        run_id: str,
        instance: InstanceLike,
        *,
        provider: str,
        zone: str | None = None,
        ready_at: Moment | None = None,
        reason: str | None = None,
        role: str = "rollout",
    ) -> None:
        """Record an instance from its `InstanceRecord` (call again whenever its state changes).

        `provider` is its pool's provider (`local`, `gcp`, `azure`); `zone` where it runs (None for
        local pools); `ready_at` when it could first generate (the first one recorded is kept); `reason` overrides the record's
        termination reason (pass `evicted` for an instance the controller reaped); `role` is
        `trainer` for the machine the trainer runs on (`infra.ledger.models.INSTANCE_ROLES`)."""
        values = {
            "run_id": run_id,
            "instance_id": instance.instance_id,
            "pool": instance.pool,
            "role": role,
            "provider": provider,
            "zone": zone,
            "machine_type": instance.machine_type,
            "capacity_class": instance.capacity_class,
            "price_per_hour": instance.price_per_hour,
            "launched_at": as_utc(instance.launched_at),
            "ready_at": as_utc(ready_at),
            "notice_at": as_utc(instance.notice_at),
            "terminated_at": as_utc(instance.terminated_at),
            "state": instance.state,
            "reason": reason or instance.reason,
            "exit_code": instance.exit_code,
        }
        self._upsert(
            Instance,
            values,
            f"record_instance({run_id!r}, {instance.instance_id!r})",
            merge={"state": _later_state, "ready_at": _first_time},
        )

    def record_usage(
        self,
        run_id: str,
        step: int,
        instance_id: str,
        *,
        seconds: float,
        tokens_generated: int,
        tokens_wasted: int = 0,
    ) -> None:
        """Record what an instance did in a step: its instance-seconds on the step, the tokens it
        generated (wasted included) and the tokens wasted. Totals so far, not increments."""
        values = {
            "run_id": run_id,
            "step": step,
            "instance_id": instance_id,
            "seconds": seconds,
            "tokens_generated": tokens_generated,
            "tokens_wasted": tokens_wasted,
        }
        self._upsert(Usage, values, f"record_usage({run_id!r}, {step}, {instance_id!r})")

    def record_transfer(
        self,
        run_id: str,
        instance_id: str,
        version: int,
        *,
        source: str,
        nbytes: int,
        egress_usd: float = 0.0,
        step: int | None = None,
        transferred_at: Moment | None = None,
        seconds: float | None = None,
    ) -> None:
        """Record that an instance pulled `nbytes` of policy `version` from `source` (`trainer`,
        `store` or a peer's instance id), what the egress cost, the step it served, and how many
        `seconds` the whole pull took (all its sources together)."""
        values = {
            "run_id": run_id,
            "instance_id": instance_id,
            "version": version,
            "source": source,
            "bytes": nbytes,
            "egress_usd": egress_usd,
            "step": step,
            "transferred_at": as_utc(transferred_at),
            "seconds": seconds,
        }
        self._upsert(WeightTransfer, values, f"record_transfer({run_id!r}, {instance_id!r}, v{version}, {source!r})")

    def record_quote(
        self,
        run_id: str,
        pool: PoolLike,
        usd_per_hour: float,
        *,
        quoted_at: Moment | None = None,
        zone: str | None = None,
    ) -> None:
        """Record the price a provider quoted for `pool` (`Provider.quote(pool)`), at `quoted_at`
        (default now)."""
        values = {
            "run_id": run_id,
            "pool": pool.name,
            "quoted_at": as_utc(quoted_at) or datetime.now(UTC),
            "provider": pool.provider,
            "machine_type": pool.machine_type,
            "zone": zone,
            "capacity_class": pool.capacity_class,
            "usd_per_hour": usd_per_hour,
        }
        self._upsert(PriceQuote, values, f"record_quote({run_id!r}, {pool.name!r})")

    # --- reads ---------------------------------------------------------------------------------

    def report(self, run_id: str, *, catalog: Catalog | None = None, as_of: Moment | None = None) -> CostReport:
        """The cost report of a run (`UnknownRun` lists the recorded runs). Instances still running
        are billed up to `as_of`: default the run's end, else now. Prices missing from the ledger
        come from `catalog` (default: `infra.pricing.default_catalog()`)."""
        with translate_errors(self.engine):
            records = load_run(self.engine, run_id)
        return build_report(records, catalog or default_catalog(), as_of=as_utc(as_of))

    def compare(
        self, run_id: str, baseline_run_id: str, *, catalog: Catalog | None = None, as_of: Moment | None = None
    ) -> BaselineComparison:
        """Run `run_id` against the measured reserved-only run `baseline_run_id`
        (`infra.ledger.comparison`; `BaselineMismatch` if they cannot be compared)."""
        report = self.report(run_id, catalog=catalog, as_of=as_of)
        return compare(report, self.report(baseline_run_id, catalog=catalog))

    # --- internals -----------------------------------------------------------------------------

    @contextmanager
    def _writing(self, what: str) -> Iterator[Any]:
        try:
            with translate_errors(self.engine), self.engine.begin() as connection:
                yield connection
        except IntegrityError as error:
            reason = (str(error.orig).strip().splitlines() or ["constraint violated"])[0]
            raise LedgerWriteError(
                f"{what} was refused by the ledger database: {reason}. Record the run first (start_run), "
                f"then steps and instances (record_step, record_instance) before their usage and transfers; "
                f"capacity classes, roles, states and reasons must be those of infra.ledger.models."
            ) from None

    def _upsert(
        self,
        model: type[Base],
        values: dict[str, Any],
        what: str,
        insert_only: tuple[str, ...] = (),
        merge: dict[str, Callable[[Any, Any], Any]] | None = None,
    ) -> None:
        """Insert `values`; on a key conflict set the given non-None values, except `insert_only`
        columns (kept) and `merge` columns (`merge[name](new, stored)` decides)."""
        table = model.__table__
        keys = [column.name for column in table.primary_key.columns]
        statement = self._insert(table).values(values)
        changes = {
            name: func.coalesce(statement.excluded[name], table.c[name])
            for name in values
            if name not in keys and name not in insert_only
        }
        for name, combine in (merge or {}).items():
            changes[name] = combine(statement.excluded[name], table.c[name])
        statement = statement.on_conflict_do_update(index_elements=keys, set_=changes)
        with self._writing(what) as connection:
            connection.execute(statement)
