"""Recording what a training run costs while it runs: the bridge from the fabric to the ledger.

`RunAccounting` writes into the cost ledger (`infra.ledger`, docs/internals.md §7): at the start
the run and a price quote per pool, and the trainer's machine (`TrainerMachine`) as instance
`trainer` of role `trainer`, up until `finish()` (a co-located pool's instance runs on that machine,
so it takes role `trainer` instead; the configuration refuses both); per step (`begin_step`,
`end_step`) its times and trained tokens, every instance with its lifecycle and ready time (its
worker's first registration seen), each instance's seconds and generated tokens inside the step,
and the weight pulls this attempt's instances reported, with their seconds (returned summed); a
heartbeat every `heartbeat_s`, so a killed driver's run is billed only up to its last beat; at the
end the run's end. `report()` is the cost report so far, `baseline_summary(id)` its comparison with
a measured reserved-only run. A step's wasted tokens go evenly to the instances that stopped in it,
else to the one that generated most. Writes are idempotent per (run, step, instance); a re-run's
instances carry the attempt's prefix, never overwriting the dead attempt's (the session closes
those with `Ledger.resume_run` first). Detail: docs/cost-ledger.md ("In code").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from infra.ledger.comparison import BaselineMismatch
from infra.ledger.config import TrainerMachine
from infra.ledger.reader import UnknownRun
from infra.ledger.recorder import Ledger
from infra.ledger.report import CostReport
from infra.providers.interface import InstanceRecord, Provider
from infra.providers.pool import PoolSpec
from infra.weights.shared import Transfer

log = logging.getLogger(__name__)

STOPPED_REASONS = ("preempted", "preempted_silent", "crashed")
TRAINER_ID = "trainer"
"""Instance id and pool of the trainer's machine in the ledger."""


@dataclass(frozen=True)
class WeightTraffic:
    """The weight pulls recorded with one step."""

    nbytes: int = 0
    """Bytes the instances received (deltas and whole versions, every source)."""
    full_fallbacks: int = 0
    """Pulls that fetched a whole version because a delta could not be applied."""
    source_fallbacks: int = 0
    """Payloads pulled from other sources after a copy failed its check (`PullReport.source_fallbacks`)."""
    pulls: int = 0
    """Pulls recorded: one per (instance, version), however many sources it received bytes from."""
    pull_s: float | None = None
    """Seconds of the slowest of them, each pull's wall time from its first request to verified
    weights (None: no pull)."""


class RunAccounting:
    """One run's writes to the ledger; `provider` is None for in-process rollout (no instances)."""

    def __init__(
        self,
        ledger: Ledger,
        run_id: str,
        name: str,
        pools: Sequence[PoolSpec],
        provider: Provider | None,
        transfers: Callable[[], Sequence[Transfer]] | None = None,
        clock: Callable[[], float] = time.time,
        trainer: TrainerMachine | None = None,
        instance_prefix: str = "",
        heartbeat_s: float = 5.0,
        workload: dict[str, Any] | None = None,
        ready: Callable[[], Mapping[str, float]] | None = None,
    ) -> None:
        """`transfers` returns the weight pulls reported since its last call (`RolloutFabric.drain_transfers`);
        `trainer` is the trainer's machine (`ledger.trainer` of the run configuration);
        `instance_prefix` starts this attempt's instance ids (the trainer's); the driver heartbeats
        every `heartbeat_s`; `workload` is what the run runs (`infra.run.workload.run_workload`);
        `ready` returns the registered instances' registration times (`RolloutFabric.registered`),
        recorded as their ready times at each step's end (not at `finish()`: the fabric is closed)."""
        self.ledger = ledger
        self.run_id = run_id
        self.provider = provider
        self.transfers = transfers
        self.ready = ready
        self.clock = clock
        self._providers = {pool.name: pool.provider for pool in pools}
        self._trainer_pools = {pool.name for pool in pools if pool.colocated}
        self._step_started: dict[int, float] = {}
        started = clock()
        ledger.start_run(run_id, name=name, started_at=started, workload=workload)
        ledger.heartbeat(run_id, at=started)
        self._trainer = (
            None
            if trainer is None
            else InstanceRecord(
                instance_prefix + TRAINER_ID,
                TRAINER_ID,
                trainer.capacity_class,
                trainer.machine_type,
                trainer.price_per_hour,
                started,
            )
        )
        self._trainer_provider = trainer.provider if trainer is not None else "local"
        self._record_trainer()
        if provider is not None:
            for pool in pools:
                ledger.record_quote(run_id, pool, provider.quote(pool), quoted_at=clock())
        self._stopped = threading.Event()
        self._heartbeats = threading.Thread(
            target=self._beat, args=(heartbeat_s,), name="ledger-heartbeat", daemon=True
        )
        self._heartbeats.start()

    def _beat(self, every_s: float) -> None:
        """Tell the ledger the driver is alive, every `every_s` until `finish()`."""
        while not self._stopped.wait(every_s):
            try:
                self.ledger.heartbeat(self.run_id, at=self.clock())
            except Exception as error:  # a ledger briefly away costs a late heartbeat, not the run
                log.warning("ledger heartbeat of %s failed: %s", self.run_id, error)

    def begin_step(self, step: int) -> None:
        """Step `step` starts now."""
        started = self.clock()
        self._step_started[step] = started
        self.ledger.record_step(self.run_id, step, started_at=started)

    def end_step(
        self,
        step: int,
        tokens_trained: int,
        instance_tokens: Mapping[str, int] | None = None,
        tokens_wasted: int = 0,
    ) -> WeightTraffic:
        """Step `step` ends now: record the instances, their usage in the step, and the step;
        returns the weight pulls recorded with it."""
        ended = self.clock()
        started = self._step_started.pop(step, ended)
        records = self.provider.instances() if self.provider is not None else []
        self._record_instances(records, self.ready() if self.ready is not None and records else None)
        if self._trainer is not None:
            records = [*records, self._trainer]
        tokens = dict(instance_tokens or {})
        wasted = _attribute_waste(records, tokens, tokens_wasted, started, ended)
        for record in records:
            seconds = _seconds_within(record, started, ended)
            generated = tokens.get(record.instance_id, 0)
            if seconds > 0 or generated or wasted.get(record.instance_id):
                self.ledger.record_usage(
                    self.run_id,
                    step,
                    record.instance_id,
                    seconds=seconds,
                    tokens_generated=generated + wasted.get(record.instance_id, 0),
                    tokens_wasted=wasted.get(record.instance_id, 0),
                )
        known = {record.instance_id for record in records}
        recorded: list[Transfer] = []
        for transfer in self.transfers() if self.transfers is not None else ():
            if transfer.instance_id not in known:  # reported by a dead attempt's instance, never recorded
                log.info(
                    "not recording the pull of v%d by %s (not an instance of this attempt)",
                    transfer.version,
                    transfer.instance_id,
                )
                continue
            self.ledger.record_transfer(
                self.run_id,
                transfer.instance_id,
                transfer.version,
                source=transfer.source,
                nbytes=transfer.nbytes,
                step=step,
                transferred_at=ended,
                seconds=transfer.seconds,
            )
            recorded.append(transfer)
        self.ledger.record_step(self.run_id, step, started_at=started, ended_at=ended, tokens_trained=tokens_trained)
        return weight_traffic(recorded)

    def step_cost_usd(self, step: int) -> float | None:
        """What the ledger attributes to `step` so far (None if it has no row)."""
        for row in self.ledger.report(self.run_id).steps:
            if row.step == step:
                return row.cost_usd
        return None

    def finish(self) -> None:
        """The run ends now: record the instances' final states and the end time."""
        self._stopped.set()
        self._heartbeats.join()
        ended = self.clock()
        if self.provider is not None:
            self._record_instances(self.provider.instances())
        if self._trainer is not None:
            self._trainer = replace(self._trainer, state="terminated", terminated_at=ended, reason="finished")
            self._record_trainer()
        self.ledger.finish_run(self.run_id, ended_at=ended)

    def _record_instances(self, records: Sequence[InstanceRecord], ready: Mapping[str, float] | None = None) -> None:
        """Record `records`, with the ready times `ready` gives (by instance id)."""
        ready = ready or {}
        for record in records:
            role = "trainer" if record.pool in self._trainer_pools else "rollout"
            self.ledger.record_instance(
                self.run_id,
                record,
                provider=self._providers.get(record.pool, "local"),
                ready_at=ready.get(record.instance_id),
                role=role,
            )

    def _record_trainer(self) -> None:
        if self._trainer is not None:
            self.ledger.record_instance(self.run_id, self._trainer, provider=self._trainer_provider, role="trainer")

    def report(self) -> CostReport:
        """The run's cost report so far: instances still up are billed to now (the clock)."""
        return self.ledger.report(self.run_id, as_of=self.clock())

    def baseline_summary(self, baseline_run_id: str) -> dict[str, object]:
        """The run against the measured reserved-only run `baseline_run_id`, as flat summary
        entries labelled by `vs_baseline` (instances still up are billed to now); a baseline that
        cannot be compared is named with why."""
        try:
            comparison = self.ledger.compare(self.run_id, baseline_run_id, as_of=self.clock())
        except (BaselineMismatch, UnknownRun) as error:
            return {"vs_baseline": f"not compared: {error}"}
        return {
            "vs_baseline": comparison.basis,
            "cost_efficiency_vs_baseline": comparison.cost_efficiency,
            "throughput_vs_baseline": comparison.throughput_ratio,
        }


def weight_traffic(transfers: Sequence[Transfer]) -> WeightTraffic:
    """What `transfers` (one entry per pull and source, `infra.weights.shared`) add up to."""
    seconds: dict[tuple[str, int], float] = {}
    for t in transfers:  # a pull's entries all carry its wall time
        seconds[(t.instance_id, t.version)] = max(t.seconds, seconds.get((t.instance_id, t.version), 0.0))
    return WeightTraffic(
        nbytes=sum(t.nbytes for t in transfers),
        full_fallbacks=sum(t.full_fallbacks for t in transfers),
        source_fallbacks=sum(t.source_fallbacks for t in transfers),
        pulls=len(seconds),
        pull_s=max(seconds.values(), default=None),
    )


def _seconds_within(record: InstanceRecord, start: float, end: float) -> float:
    """Seconds of [start, end] during which the instance was up."""
    stop = end if record.terminated_at is None else min(end, record.terminated_at)
    return max(0.0, stop - max(start, record.launched_at))


def _attribute_waste(
    records: Sequence[InstanceRecord],
    tokens: Mapping[str, int],
    wasted: int,
    start: float,
    end: float,
) -> dict[str, int]:
    """Split the step's wasted tokens over the instances that stopped in it (see module doc)."""
    if wasted <= 0:
        return {}
    stopped = sorted(
        r.instance_id
        for r in records
        if r.reason in STOPPED_REASONS and r.terminated_at is not None and start <= r.terminated_at <= end
    )
    if not stopped:
        if not tokens:
            return {}
        stopped = [max(sorted(tokens), key=lambda i: tokens[i])]
    share, extra = divmod(wasted, len(stopped))
    return {instance: share + (index < extra) for index, instance in enumerate(stopped)}
