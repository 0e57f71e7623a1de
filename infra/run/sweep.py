"""The VM sweep (docs/internals.md §9, "No VM outlives its run"): find this project's VMs by their
`rlboost-run` label in the scopes of a run's cloud pools, judge whether their run is alive
(`infra.run.liveness`, from the ledger), delete those whose run is not, and record each deleted VM
in the ledger (`swept_instances`).

- `CloudSweep.plan()` lists and judges (nothing changes: `rlboost cloud sweep --dry-run`);
  `sweep()` also deletes and records.
- `SweepSchedule` is a training run's: at its start it records the run alive (`Ledger.heartbeat`
  with `reopen`: a resumed run is alive again) and sweeps once, adopting its own VMs; then, every
  `fabric.cloud.sweep.interval_s` on a background thread, it beats and sweeps again, until `stop()`.
  A failing sweep (a cloud API error) is logged and retried at the next beat; it never stops training.

A scope is a GCP pool's project and zones, or an Azure pool's resource group; VMs outside every
configured scope are not seen. Two pools with the same scope list each VM once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from infra.fleet.cloud_fleet import provider_class
from infra.ledger.reader import list_runs
from infra.ledger.recorder import Ledger
from infra.providers.bootstrap import WorkerBootstrap
from infra.providers.pool import PoolSpec
from infra.providers.zonal import LabelledVm, ZonalCloudProvider, label_value
from infra.run.fabric import cloud_options
from infra.run.fabric_config import FabricConfig, SweepSettings
from infra.run.liveness import RunLife, Verdict, judge

log = logging.getLogger(__name__)

CLI_SWEEPER = "cli"
"""`swept_by` of the VMs `rlboost cloud sweep` deleted."""


@dataclass(frozen=True)
class SweepItem:
    vm: LabelledVm
    verdict: Verdict


class CloudSweep:
    """The sweep of the VMs in the scopes of `pools` (their local ones are ignored)."""

    def __init__(
        self,
        pools: Sequence[PoolSpec],
        ledger: Ledger,
        settings: SweepSettings,
        *,
        run_id: str | None = None,
        options: Mapping[str, Mapping[str, Any]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`run_id`: the sweeping run, whose own VMs are adopted (None: `rlboost cloud sweep`, which
        adopts nothing); `options`: cloud kind -> provider keyword arguments (endpoints, credentials,
        as `infra.run.fabric.cloud_options` makes them)."""
        self.pools = [pool for pool in pools if pool.provider != "local"]
        self.ledger = ledger
        self.settings = settings
        self.run_id = run_id
        self.clock = clock
        self._providers: dict[str, ZonalCloudProvider] = {}
        for pool in self.pools:
            if pool.provider not in self._providers:
                self._providers[pool.provider] = provider_class(pool)(
                    run_id=run_id or "rlboost-sweep",
                    bootstrap=WorkerBootstrap(),
                    clock=clock,
                    **(options or {}).get(pool.provider, {}),
                )

    def _runs_by_label(self) -> dict[str, list[RunLife]]:
        by_label: dict[str, list[RunLife]] = defaultdict(list)
        for run in list_runs(self.ledger.engine):
            by_label[label_value(run.run_id)].append(
                RunLife(
                    run.run_id,
                    run.started_at.timestamp(),
                    run.ended_at.timestamp() if run.ended_at else None,
                    run.heartbeat_at.timestamp() if run.heartbeat_at else None,
                )
            )
        return by_label

    def plan(self) -> list[SweepItem]:
        """Every labelled VM of the scopes with its verdict; changes nothing."""
        seen: dict[tuple[str, str, str], LabelledVm] = {}
        for pool in self.pools:
            for vm in self._providers[pool.provider].labelled(pool):
                seen.setdefault((vm.provider, vm.zone, vm.name), vm)
        runs = self._runs_by_label()
        own = None if self.run_id is None else label_value(self.run_id)
        now = self.clock()
        return [
            SweepItem(
                vm,
                judge(
                    runs.get(vm.run_label, []),
                    own=vm.run_label == own,
                    created_at=vm.created_at,
                    now=now,
                    stale_after_s=self.settings.stale_after_s,
                    delete_unknown=self.settings.delete_unknown,
                ),
            )
            for vm in sorted(seen.values(), key=lambda v: (v.provider, v.zone, v.name))
        ]

    def sweep(self) -> list[SweepItem]:
        """`plan()`, then delete each VM judged `delete` and record it in the ledger. A VM that
        cannot be deleted is logged and left for the next sweep."""
        items = self.plan()
        for item in items:
            if item.verdict.action != "delete":
                continue
            vm = item.vm
            try:
                self._providers[vm.provider].delete_labelled(vm)
            except Exception:
                log.exception(
                    "sweep: could not delete %s %s in %s; the next sweep tries again", vm.provider, vm.name, vm.zone
                )
                continue
            log.warning("sweep: deleted %s VM %s in %s: %s", vm.provider, vm.name, vm.zone, item.verdict.why)
            self.ledger.record_swept(
                provider=vm.provider,
                instance_id=vm.name,
                zone=vm.zone,
                run_label=vm.run_label,
                pool_label=vm.pool_label,
                why=item.verdict.why,
                swept_by=self.run_id or CLI_SWEEPER,
                swept_at=self.clock(),
            )
        return items


class SweepSchedule:
    """A training run's heartbeat and sweeps: once in `start()`, then every `interval_s`."""

    def __init__(self, sweep: CloudSweep, run_id: str, run_name: str | None = None) -> None:
        self.sweep = sweep
        self.run_id = run_id
        self.run_name = run_name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> list[SweepItem]:
        """Record the run alive, sweep once (in this thread), then keep beating and sweeping in
        the background; returns the first sweep's items (empty if it failed)."""
        self.sweep.ledger.heartbeat(self.run_id, at=self.sweep.clock(), name=self.run_name, reopen=True)
        items = self._sweep_once()
        self._thread = threading.Thread(target=self._run, name=f"vm-sweep-{self.run_id}", daemon=True)
        self._thread.start()
        return items

    def _sweep_once(self) -> list[SweepItem]:
        try:
            return self.sweep.sweep() if self.sweep.settings.enabled else []
        except Exception:
            log.exception("the VM sweep failed; it runs again in %.0f s", self.sweep.settings.interval_s)
            return []

    def _run(self) -> None:
        while not self._stop.wait(self.sweep.settings.interval_s):
            try:
                self.sweep.ledger.heartbeat(self.run_id, at=self.sweep.clock())
            except Exception:
                log.exception("could not record the run's heartbeat in the ledger")
            self._sweep_once()

    def stop(self) -> None:
        """Stop beating and sweeping (after the sweep in progress)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def start_sweeps(fabric: FabricConfig, run_id: str, run_name: str, ledger: Ledger) -> SweepSchedule:
    """The running `SweepSchedule` of a training run with cloud pools (its first sweep done)."""
    sweep = CloudSweep(fabric.pools, ledger, fabric.cloud.sweep, run_id=run_id, options=cloud_options(fabric.cloud))
    schedule = SweepSchedule(sweep, run_id, run_name)
    schedule.start()
    return schedule
