"""What a run cost: pure computations from a run's ledger rows (`RunRecords`) to a `CostReport`.

`build_report` prices every instance (its recorded `price_per_hour`, else the catalog's for its
class at its launch) and computes its spend (billed seconds up to `as_of`: default the run's end,
else its driver's last heartbeat, so a run whose driver died stops costing there), each step's cost
from the usage rows plus transfer egress (with its pulled bytes and slowest pull), and the books:
what no step holds, as named lines (`unattributed`, `infra.ledger.books`) that add up with the
steps to `total_usd`; $ per million generated and trained tokens, the trainer's share (role
`trainer`; `trainer_recorded`), trained tokens/s of step time, preemptions, evictions and failed (replaced) instances, boot
seconds per instance and class. `as_dict()` is the whole report as JSON-ready data, `summary()`
the run totals; a price neither ledger nor catalog gives raises `PriceNotFound`. Detail: docs/cost-ledger.md.

There is no on-demand figure here: re-pricing the same instance-seconds at on-demand prices says
nothing about what an on-demand run would cost (it would take a different time); comparing with
on-demand is `infra.ledger.comparison`'s job, against a measured baseline run (docs/internals.md §7).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, Protocol

from pydantic import BaseModel

from infra.ledger.books import Books, CostLine, books
from infra.ledger.models import CAPACITY_CLASSES, PREEMPTION_REASONS, Instance, Usage, WeightTransfer
from infra.ledger.reader import RunRecords
from infra.pricing.catalog import PriceNotFound

MILLION = 1_000_000
SECONDS_PER_HOUR = 3600.0


class PriceSource(Protocol):
    """Where prices the ledger lacks come from (an `infra.pricing.Catalog`)."""

    def price(
        self, provider: str, machine_type: str, region: str | None, capacity_class: str, at: datetime | None
    ) -> float: ...


class InstanceCost(BaseModel):
    instance_id: str
    pool: str
    role: str
    capacity_class: str
    machine_type: str
    usd_per_hour: float
    billed_seconds: float
    spend_usd: float
    reason: str | None
    boot_s: float | None
    """Seconds from launch to ready (None: no ready time recorded)."""


class StepCost(BaseModel):
    step: int
    started_at: datetime
    ended_at: datetime | None
    instances: int
    """Instances with usage in the step."""
    instance_seconds: float
    tokens_generated: int
    tokens_wasted: int
    tokens_trained: int
    preemptions: int
    replaced: int
    """Instances that failed in the step (reason `crashed`: a worker that exited or never registered);
    the capacity manager started another for each (`fabric.max_instance_failures`)."""
    cost_usd: float
    spot_usd: float
    """The part of `cost_usd` spent on spot instances."""
    trainer_usd: float
    """The part of `cost_usd` spent on the trainer's machine."""
    idle_after_usd: float
    """Instance cost between the step's end and the next step's start (not in `cost_usd`; the run's
    `between steps` line is their sum)."""
    usd_per_million_generated: float | None
    usd_per_million_trained: float | None
    transfer_bytes: int
    """Weight bytes the instances pulled for the step (every source, deltas and whole versions)."""
    pulls: int
    """Weight pulls recorded with the step: one per (instance, version), however many sources it used."""
    pull_s_max: float | None
    """Seconds of the step's slowest pull (None: no pull, or none recorded its time: before migration 0005)."""


class ClassSpend(BaseModel):
    capacity_class: str
    instances: int
    instance_hours: float
    spend_usd: float
    preemptions: int
    booted: int
    """Instances with a recorded ready time (`instances.ready_at`)."""
    boot_s_mean: float | None
    """Mean seconds from launch to ready over those (None: none recorded one)."""
    boot_usd: float
    """What they cost while booting: boot seconds x price."""


class CostReport(BaseModel):
    run_id: str
    run_name: str | None
    started_at: datetime
    ended_at: datetime | None
    as_of: datetime
    """Instances without a termination time are billed up to this time."""
    workload: dict[str, Any] | None
    """What the run ran (`runs.workload`: model, data, batch, pools, trainer; None: not recorded)."""
    steps: list[StepCost]
    classes: list[ClassSpend]
    """Spend per capacity class (reserved, ondemand, spot), classes with instances only."""
    instances: list[InstanceCost]
    instance_spend_usd: float
    egress_usd: float
    transfer_bytes: int
    total_usd: float
    attributed_usd: float
    """The steps' costs, summed."""
    unattributed: list[CostLine]
    """What no step holds, line by line (`infra.ledger.books`): with `attributed_usd` they make `total_usd`."""
    unattributed_usd: float
    tokens_generated: int
    tokens_wasted: int
    tokens_trained: int
    usd_per_million_generated: float | None
    usd_per_million_trained: float | None
    preemptions: int
    evictions: int
    replaced: int
    """Instances that failed (reason `crashed`) over the run."""
    trainer_usd: float
    trainer_recorded: bool
    """Whether the run recorded the trainer's machine (instances of role `trainer`)."""
    step_seconds: float
    """Wall seconds of the ended steps, summed."""
    trained_tokens_per_s: float | None

    def spend(self, capacity_class: str) -> float:
        """Spend on instances of one capacity class."""
        return sum((c.spend_usd for c in self.classes if c.capacity_class == capacity_class), 0.0)

    def summary(self) -> dict[str, object]:
        """The run totals as one flat dict (for the run summary artifact)."""
        totals = self.model_dump(mode="json", exclude={"steps", "classes", "instances", "unattributed", "workload"})
        totals.update({f"unattributed_{line.key}_usd": line.usd for line in self.unattributed})
        totals.update({f"spend_{name}_usd": self.spend(name) for name in CAPACITY_CLASSES})
        totals["steps"] = len(self.steps)
        return totals

    def as_dict(self) -> dict[str, object]:
        """The whole report as JSON-ready data."""
        return self.model_dump(mode="json")


def _per_million(usd: float, tokens: int) -> float | None:
    return usd * MILLION / tokens if tokens else None


def _catalog_price(prices: PriceSource, instance: Instance, capacity_class: str, purpose: str) -> float:
    try:
        return prices.price(
            instance.provider, instance.machine_type, instance.zone, capacity_class, instance.launched_at
        )
    except PriceNotFound as error:
        raise PriceNotFound(
            f"instance {instance.instance_id} (pool {instance.pool}, {instance.capacity_class}) needs {purpose}: {error}"
        ) from None


def hourly_price(instance: Instance, prices: PriceSource) -> float:
    """What one hour of the instance costs: its recorded price, else the catalog's for its class."""
    if instance.price_per_hour is not None:
        return instance.price_per_hour
    return _catalog_price(prices, instance, instance.capacity_class, "a price (none was recorded)")


def billed_seconds(instance: Instance, as_of: datetime) -> float:
    """Seconds from launch to termination (or `as_of` if it has not terminated)."""
    end = instance.terminated_at or as_of
    return max((end - instance.launched_at).total_seconds(), 0.0)


def boot_seconds(instance: Instance) -> float | None:
    """Seconds from launch to ready (its worker registered), None without a ready time."""
    if instance.ready_at is None:
        return None
    return max((instance.ready_at - instance.launched_at).total_seconds(), 0.0)


def _preempted_at(instance: Instance) -> datetime | None:
    if instance.reason not in PREEMPTION_REASONS:
        return None
    return instance.notice_at or instance.terminated_at


def _count_within(times: Iterable[datetime], start: datetime, end: datetime) -> int:
    return sum(1 for t in times if start <= t < end)


def _instance_costs(records: RunRecords, prices: PriceSource, as_of: datetime) -> list[InstanceCost]:
    costs = []
    for i in records.instances:
        rate, seconds = hourly_price(i, prices), billed_seconds(i, as_of)
        costs.append(
            InstanceCost(
                instance_id=i.instance_id,
                pool=i.pool,
                role=i.role,
                capacity_class=i.capacity_class,
                machine_type=i.machine_type,
                usd_per_hour=rate,
                billed_seconds=seconds,
                reason=i.reason,
                spend_usd=seconds * rate / SECONDS_PER_HOUR,
                boot_s=boot_seconds(i),
            )
        )
    return costs


def _step_costs(records: RunRecords, instances: list[InstanceCost], as_of: datetime, books: Books) -> list[StepCost]:
    by_id = {i.instance_id: i for i in instances}
    preemption_times = [t for i in records.instances if (t := _preempted_at(i)) is not None]
    failure_times = [i.terminated_at for i in records.instances if i.reason == "crashed" and i.terminated_at]
    egress_by_step: dict[int | None, float] = defaultdict(float)
    bytes_by_step: dict[int | None, int] = defaultdict(int)
    for transfer in records.transfers:
        egress_by_step[transfer.step] += transfer.egress_usd
        bytes_by_step[transfer.step] += transfer.bytes
    pulls_by_step = _pulls_by_step(records.transfers)
    usage_by_step: dict[int, list[Usage]] = defaultdict(list)
    for usage in records.usage:
        usage_by_step[usage.step].append(usage)

    def usd(rows: list[Usage]) -> float:
        return sum(u.seconds * by_id[u.instance_id].usd_per_hour for u in rows) / SECONDS_PER_HOUR

    steps = []
    for step in records.steps:
        rows, egress, pulls = usage_by_step[step.step], egress_by_step[step.step], pulls_by_step[step.step]
        timed = [seconds for seconds in pulls.values() if seconds is not None]
        cost = egress + usd(rows)
        generated, trained = sum(u.tokens_generated for u in rows), step.tokens_trained or 0
        steps.append(
            StepCost(
                step=step.step,
                started_at=step.started_at,
                ended_at=step.ended_at,
                instances=len(rows),
                instance_seconds=sum(u.seconds for u in rows),
                tokens_generated=generated,
                tokens_wasted=sum(u.tokens_wasted for u in rows),
                tokens_trained=trained,
                preemptions=_count_within(preemption_times, step.started_at, step.ended_at or as_of),
                replaced=_count_within(failure_times, step.started_at, step.ended_at or as_of),
                cost_usd=cost,
                spot_usd=usd([u for u in rows if by_id[u.instance_id].capacity_class == "spot"]),
                trainer_usd=usd([u for u in rows if by_id[u.instance_id].role == "trainer"]),
                idle_after_usd=books.idle_after.get(step.step, 0.0),
                usd_per_million_generated=_per_million(cost, generated),
                usd_per_million_trained=_per_million(cost, trained),
                transfer_bytes=bytes_by_step[step.step],
                pulls=len(pulls),
                pull_s_max=max(timed) if timed else None,
            )
        )
    return steps


def _pulls_by_step(transfers: Iterable[WeightTransfer]) -> dict[int | None, dict[tuple[str, int], float | None]]:
    """Per step, each pull (instance, version) with its seconds (its rows, one per source, carry
    the same figure; None where none was recorded)."""
    pulls: dict[int | None, dict[tuple[str, int], float | None]] = defaultdict(dict)
    for t in transfers:
        key = (t.instance_id, t.version)
        timed = [seconds for seconds in (pulls[t.step].get(key), t.seconds) if seconds is not None]
        pulls[t.step][key] = max(timed) if timed else None
    return pulls


def _class_spends(instances: list[InstanceCost]) -> list[ClassSpend]:
    classes = []
    for name in CAPACITY_CLASSES:
        members = [c for c in instances if c.capacity_class == name]
        if members:
            boots = [(c.boot_s, c.usd_per_hour) for c in members if c.boot_s is not None]
            classes.append(
                ClassSpend(
                    capacity_class=name,
                    instances=len(members),
                    instance_hours=sum(c.billed_seconds for c in members) / SECONDS_PER_HOUR,
                    spend_usd=sum(c.spend_usd for c in members),
                    preemptions=sum(1 for c in members if c.reason in PREEMPTION_REASONS),
                    booted=len(boots),
                    boot_s_mean=sum(s for s, _ in boots) / len(boots) if boots else None,
                    boot_usd=sum(s * rate for s, rate in boots) / SECONDS_PER_HOUR,
                )
            )
    return classes


def build_report(records: RunRecords, prices: PriceSource, as_of: datetime | None = None) -> CostReport:
    """The `CostReport` of one run (definitions in the module docstring)."""
    run = records.run
    as_of = as_of or run.ended_at or run.heartbeat_at or datetime.now(UTC)
    instances = _instance_costs(records, prices, as_of)
    lines = books(records, {c.instance_id: c.usd_per_hour for c in instances}, as_of)
    steps = _step_costs(records, instances, as_of, lines)
    egress = sum(t.egress_usd for t in records.transfers)
    total = egress + sum(c.spend_usd for c in instances)
    attributed = sum(s.cost_usd for s in steps)
    trainers = [c for c in instances if c.role == "trainer"]
    step_seconds = sum((s.ended_at - s.started_at).total_seconds() for s in steps if s.ended_at is not None)
    trained_in_ended = sum(s.tokens_trained for s in steps if s.ended_at is not None)
    generated = sum(s.tokens_generated for s in steps)
    trained = sum(s.tokens_trained for s in steps)
    return CostReport(
        run_id=run.run_id,
        run_name=run.name,
        started_at=run.started_at,
        ended_at=run.ended_at,
        as_of=as_of,
        workload=run.workload,
        steps=steps,
        classes=_class_spends(instances),
        instances=instances,
        instance_spend_usd=total - egress,
        egress_usd=egress,
        transfer_bytes=sum(t.bytes for t in records.transfers),
        total_usd=total,
        attributed_usd=attributed,
        unattributed=lines.lines,
        unattributed_usd=sum(line.usd for line in lines.lines),
        tokens_generated=generated,
        tokens_wasted=sum(s.tokens_wasted for s in steps),
        tokens_trained=trained,
        usd_per_million_generated=_per_million(total, generated),
        usd_per_million_trained=_per_million(total, trained),
        preemptions=sum(1 for i in records.instances if i.reason in PREEMPTION_REASONS),
        evictions=sum(1 for i in records.instances if i.reason == "evicted"),
        replaced=sum(1 for i in records.instances if i.reason == "crashed"),
        trainer_usd=sum(c.spend_usd for c in trainers),
        trainer_recorded=bool(trainers),
        step_seconds=step_seconds,
        trained_tokens_per_s=trained_in_ended / step_seconds if step_seconds > 0 else None,
    )
