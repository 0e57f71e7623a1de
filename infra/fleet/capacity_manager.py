"""The capacity manager: keeps each pool of a `Provider` at its planned size (docs/internals.md §3).

Each `reconcile()`: (1) refreshes the provider, so preemptions and losses in the cloud become
records and events; (2) plans a target per pool with the pure policy `plan_capacity`, from the
quotes, the pools' `min_size` / `size` and `max_price_per_hour`, the budget, and each pool's recent
history (`PoolHistory`: requests fulfilled, preemptions per instance-hour), which ranks pools but
never empties one; with `policy="marginal"` those targets are the ceiling of `plan_marginal` (only
the instances worth their price and weight egress on the run's throughput curve); (3) launches each pool's shortfall (the provider fails over between zones) and scales its
excess down, newest first: drained (`drain`), terminated once gone or after `drain_s` (at once
without `drain`); returns a `ReconcileReport`.

The clock is injected; `run()` repeats `reconcile()` until stopped, at once after `wake()` (a
failed instance was stopped: its replacement starts now). It drives the cloud providers; local
pools are kept at size by `LocalProvider.tick()`. Lifecycles: the provider's records.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from infra.providers.errors import CloudError
from infra.providers.interface import InstanceHandle, InstanceRecord, PreemptionEvent, Provider
from infra.providers.pool import PoolSpec
from infra.rollout.policies.capacity import CapacityConfig, PoolOffer, plan_capacity
from infra.rollout.policies.marginal import MarginalConfig, plan_marginal
from infra.weights.updates import WeightUpdates

log = logging.getLogger(__name__)


@dataclass
class PoolHistory:
    """What happened to one pool's requests and instances over a sliding window."""

    window_s: float
    requests: deque[tuple[float, int, int]] = field(default_factory=deque)
    """(time, instances asked for, instances started)."""
    preemptions: deque[float] = field(default_factory=deque)

    def forget_before(self, cutoff: float) -> None:
        while self.requests and self.requests[0][0] < cutoff:
            self.requests.popleft()
        while self.preemptions and self.preemptions[0] < cutoff:
            self.preemptions.popleft()

    def availability(self) -> float:
        """Fraction of the instances asked for in the window that started (1.0 with no requests)."""
        asked = sum(a for _, a, _ in self.requests)
        return 1.0 if asked == 0 else sum(s for _, _, s in self.requests) / asked

    def preemptions_per_hour(self, live: int) -> float:
        """Preemptions per instance-hour, counting the pool's current size over the window."""
        return len(self.preemptions) / (max(live, 1) * self.window_s / 3600)


@dataclass(frozen=True)
class ReconcileReport:
    """What one `reconcile()` saw and did."""

    at: float
    quotes: dict[str, float]
    targets: dict[str, int]
    launched: tuple[InstanceHandle, ...]
    terminated: tuple[str, ...]
    preemptions: tuple[PreemptionEvent, ...]
    drained: tuple[str, ...] = ()
    """Instances asked to drain in this reconcile (terminated at a later one)."""
    egress_per_hour: dict[str, float] = field(default_factory=dict)
    """Per pool, what one instance's weight pulls cost per hour (the `marginal` policy's input)."""


class CapacityManager:
    """Keeps `pools` of one `provider` at the targets `plan_capacity` sets."""

    def __init__(
        self,
        provider: Provider,
        pools: Sequence[PoolSpec],
        *,
        budget_per_hour: float | None = None,
        throughput: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.time,
        history_s: float = 3600.0,
        warmup_s: float = 120.0,
        policy: Literal["budget", "marginal"] = "budget",
        throughput_curve: Callable[[], Mapping[int, float]] | None = None,
        base_price_per_hour: float = 0.0,
        drain: Callable[[str], object] | None = None,
        drain_s: float = 60.0,
        egress_usd_per_gb: Mapping[str, float] | None = None,
        weight_updates: Callable[[], WeightUpdates | None] | None = None,
    ) -> None:
        """`budget_per_hour`: ceiling on the summed hourly price of all targets (None: no ceiling);
        `throughput`: relative generation speed of one instance per pool (default 1.0), which ranks
        pools by price per throughput; `history_s`: the window of the availability and preemption
        history; `warmup_s`: boot-to-useful time of an instance, which preemptions waste.
        `policy="marginal"` reads `throughput_curve` (step throughput per count of these pools'
        instances: `OffloadController.throughput_curve`) and weighs each instance against
        `base_price_per_hour` (what the run pays whatever its spot count), each instance's price
        plus its weight pulls' egress per hour: `egress_usd_per_gb` of its pool (absent: 0) times
        the bytes an instance pulls per hour (`weight_updates`: `WeightPublisher.updates`, the
        recent versions' encoded bytes and pace). `drain` asks one instance to finish its work
        (e.g. a registry `drain` message); a drained instance is terminated once it stops running
        or `drain_s` after the request."""
        if policy == "marginal" and throughput_curve is None:
            raise ValueError("the marginal policy needs a throughput_curve")
        names = [pool.name for pool in pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {names}")
        self.provider = provider
        self.pools = tuple(pools)
        self._budget = budget_per_hour
        self._throughput = dict(throughput or {})
        self._clock = clock
        self._warmup_s = warmup_s
        self._history = {pool.name: PoolHistory(history_s) for pool in self.pools}
        self._policy = policy
        self._curve = throughput_curve
        self._base_price = base_price_per_hour
        self._drain = drain
        self._drain_s = drain_s
        self._egress_usd_per_gb = dict(egress_usd_per_gb or {})
        self._weight_updates = weight_updates
        self._draining: dict[str, float] = {}
        """Instance -> when it was asked to drain."""
        self._woken = threading.Event()

    def reconcile(self) -> ReconcileReport:
        """Refresh, plan, and launch or terminate to bring every pool to its target."""
        self.provider.refresh(self.pools)
        now = self._clock()
        events = tuple(self.provider.preemptions())
        for event in events:
            if event.pool in self._history:
                self._history[event.pool].preemptions.append(event.at)
        for history in self._history.values():
            history.forget_before(now - history.window_s)
        terminated: list[str] = self._drained_out(now)
        running = {
            pool.name: [r for r in self._running(pool) if r.instance_id not in self._draining] for pool in self.pools
        }
        quotes = {pool.name: self.provider.quote(pool) for pool in self.pools}
        offers = tuple(
            PoolOffer(
                pool=pool.name,
                price_per_hour=quotes[pool.name],
                throughput=self._throughput.get(pool.name, 1.0),
                max_instances=pool.size,
                min_instances=pool.min_size,
                price_cap=pool.max_price_per_hour,
                availability=self._history[pool.name].availability(),
                preemptions_per_hour=self._history[pool.name].preemptions_per_hour(len(running[pool.name])),
            )
            for pool in self.pools
        )
        budget = (
            self._budget if self._budget is not None else sum(o.price_per_hour * o.max_instances for o in offers) + 1.0
        )
        config = CapacityConfig(budget_per_hour=budget, min_availability=0.0, warmup_s=self._warmup_s)
        egress = self._egress_per_hour()
        if self._policy == "marginal":
            assert self._curve is not None
            held = sum(len(records) for records in running.values())
            marginal = MarginalConfig(base_price_per_hour=self._base_price, egress_usd_per_hour=egress)
            planned = plan_marginal(offers, config, marginal, self._curve(), held)
        else:
            planned = plan_capacity(offers, config)
        targets = {t.pool: t.target for t in planned}
        launched: list[InstanceHandle] = []
        drained: list[str] = []
        for pool in self.pools:
            shortfall = targets[pool.name] - len(running[pool.name])
            if shortfall > 0:
                started = self.provider.launch(pool, shortfall)
                self._history[pool.name].requests.append((self._clock(), shortfall, len(started)))
                launched.extend(started)
            for record in sorted(running[pool.name], key=lambda r: r.launched_at, reverse=True)[: max(-shortfall, 0)]:
                if self._drain is None:
                    self.provider.terminate(record.instance_id, "scaled_down")
                    terminated.append(record.instance_id)
                else:
                    self._draining[record.instance_id] = now
                    self._drain(record.instance_id)
                    drained.append(record.instance_id)
        if launched or terminated or drained or events:
            log.info(
                "capacity: targets %s; launched %d, draining %d, terminated %d, preempted %d",
                targets,
                len(launched),
                len(drained),
                len(terminated),
                len(events),
            )
        return ReconcileReport(now, quotes, targets, tuple(launched), tuple(terminated), events, tuple(drained), egress)

    def _egress_per_hour(self) -> dict[str, float]:
        """Per pool, USD per hour of one instance's weight pulls (0 before a version is measured)."""
        updates = self._weight_updates() if self._weight_updates is not None else None
        gigabytes = 0.0 if updates is None else updates.bytes_per_hour / 1e9
        return {pool.name: self._egress_usd_per_gb.get(pool.name, 0.0) * gigabytes for pool in self.pools}

    def _drained_out(self, now: float) -> list[str]:
        """Forget drained instances that stopped; terminate those still running after `drain_s`."""
        live = {r.instance_id for r in self.provider.instances(live_only=True) if r.state == "running"}
        terminated = []
        for instance_id, asked in list(self._draining.items()):
            if instance_id not in live:
                del self._draining[instance_id]
            elif now - asked >= self._drain_s:
                self.provider.terminate(instance_id, "scaled_down")
                del self._draining[instance_id]
                terminated.append(instance_id)
        return terminated

    def wake(self) -> None:
        """Make `run()` reconcile now instead of at the end of its interval."""
        self._woken.set()

    def run(self, stop: threading.Event, interval_s: float = 30.0) -> None:
        """`reconcile()` every `interval_s` (or sooner, after `wake()`) until `stop` is set (then
        `wake()` ends the wait at once). A `CloudError` (the pool's configuration or credentials)
        ends the loop by propagating; other failures (the cloud's API hiccups) are logged and
        retried at the next interval."""
        while not stop.is_set():
            try:
                self.reconcile()
            except CloudError:
                raise
            except Exception:
                log.exception("capacity reconcile failed; retrying in %.0f s", interval_s)
            self._woken.wait(interval_s)
            self._woken.clear()

    def _running(self, pool: PoolSpec) -> list[InstanceRecord]:
        return [r for r in self.provider.instances(live_only=True) if r.pool == pool.name and r.state == "running"]
