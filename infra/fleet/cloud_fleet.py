"""The cloud side of a run: a provider per cloud its pools use, kept at target while the run lasts.

`CloudFleet` owns, for the `gcp` and `azure` pools of a run, a `GcpProvider` / `AzureProvider`
(the SDKs' default credentials unless `options` inject others) and one `CapacityManager` over all
of them, which reconciles every `interval_s` on a background thread between `start()` and
`stop()`: it launches the pools' instances, replaces preempted ones and fails over between zones.
`stop()` also deletes the cloud instances still running. Local pools are not its business: for a
run without cloud pools it holds no provider and starts no thread.

It refuses, before building anything, what cannot work: a cloud whose extra is not installed, and
a Redis on loopback (the embedded one), which the VMs cannot reach.
"""

from __future__ import annotations

import importlib
import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from infra.fleet.capacity_manager import CapacityManager
from infra.providers.bootstrap import WorkerBootstrap
from infra.providers.composite import CompositeProvider
from infra.providers.errors import CloudError
from infra.providers.interface import BootHooks, OnChange, Provider
from infra.providers.pool import PoolSpec

log = logging.getLogger(__name__)

CLOUD_PROVIDERS = {"gcp": "infra.providers.gcp:GcpProvider", "azure": "infra.providers.azure:AzureProvider"}
"""Pool kind -> the provider class that runs it (imported only when a pool needs it)."""


class CloudFleet:
    """The run's cloud providers and the capacity manager that keeps their pools at target."""

    def __init__(
        self,
        pools: Sequence[PoolSpec],
        *,
        run_id: str,
        redis_url: str,
        bootstrap: WorkerBootstrap,
        on_change: OnChange | None = None,
        boot_hooks: BootHooks | None = None,
        current_step: Callable[[], int] | None = None,
        interval_s: float,
        clock: Callable[[], float] = time.time,
        options: Mapping[str, Mapping[str, Any]] | None = None,
        capacity: Mapping[str, Any] | None = None,
    ) -> None:
        """`pools`: the run's pools (local ones are skipped); `redis_url`: the run's Redis, which the
        VMs' workers join; `on_change` gets every cloud instance's record on each change;
        `boot_hooks` prepare each VM's work before it is created; `current_step` labels new VMs
        with the training step; `interval_s`: seconds between reconciles (`fabric.cloud.reconcile_s`); `clock` times the providers and the manager;
        `options`: kind -> extra keyword arguments of that kind's provider (credentials, endpoints);
        `capacity`: keyword arguments of the `CapacityManager` (policy, budget, curve, drain)."""
        self.pools = tuple(pool for pool in pools if pool.provider != "local")
        check_reachable_by_vms(redis_url, self.pools)
        self.providers: dict[str, Provider] = {}
        for pool in self.pools:
            if pool.provider not in self.providers:
                self.providers[pool.provider] = provider_class(pool)(
                    run_id=run_id,
                    bootstrap=bootstrap,
                    on_change=on_change,
                    boot_hooks=boot_hooks,
                    clock=clock,
                    **({"current_step": current_step} if current_step is not None else {}),
                    **(options or {}).get(pool.provider, {}),
                )
        self.manager = CapacityManager(CompositeProvider(self.providers), self.pools, clock=clock, **(capacity or {}))
        self.failure: CloudError | None = None
        """What stopped the reconcile loop early (a pool's configuration or credentials), if anything."""
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Reconcile every `interval_s` on a background thread (none without cloud pools)."""
        if self._thread is not None:
            raise RuntimeError("the cloud fleet is already running")
        if not self.pools:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="cloud-fleet", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Reconcile now (an instance was stopped as failed: launch its replacement)."""
        self.manager.wake()

    def running(self) -> list[str]:
        """Ids of the cloud instances running now (as of the last reconcile)."""
        return [r.instance_id for r in self.manager.provider.instances(live_only=True) if r.state == "running"]

    def stop(self, drain: Callable[[list[str]], object] | None = None) -> None:
        """Stop reconciling (after the reconcile in progress); give `drain` the running instances
        (to let them finish their work); then delete every cloud instance still running. One that
        cannot be deleted is logged with its id."""
        if self._thread is not None:
            self._stop.set()
            self.manager.wake()
            self._thread.join()
            self._thread = None
        if drain is not None and self.running():
            try:
                drain(self.running())
            except Exception:
                log.exception("draining the cloud instances failed; deleting them anyway")
        provider = self.manager.provider
        for record in provider.instances(live_only=True):
            if record.state == "running":
                try:
                    provider.terminate(record.instance_id)
                except Exception:
                    log.exception(
                        "pool %s: could not delete %s (zone %s): delete it by hand",
                        record.pool,
                        record.instance_id,
                        record.zone,
                    )

    def _run(self) -> None:
        try:
            self.manager.run(self._stop, self._interval_s)
        except CloudError as error:
            self.failure = error
            log.error("cloud pools are no longer kept at target: %s", error)


def check_reachable_by_vms(redis_url: str, pools: Sequence[PoolSpec]) -> None:
    """Refuse a Redis on loopback when there are cloud pools: a cloud VM's 127.0.0.1 is the VM itself."""
    cloud = [pool for pool in pools if pool.provider != "local"]
    if not cloud:
        return
    pool = cloud[0]
    parts = urlsplit(redis_url)
    host = parts.hostname or "localhost"
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if parts.scheme == "unix" or loopback:
        where = parts.path if parts.scheme == "unix" else f"{host}:{parts.port or 6379}"
        raise CloudError(
            pool.name,
            f"its {pool.provider} VMs cannot reach the run's Redis at {where} (this machine only; the "
            "embedded Redis listens there): set fabric.redis_url to a Redis the VMs can reach",
        )


def provider_class(pool: PoolSpec) -> type[Provider]:
    """The provider class of the pool's cloud; a clear error if its extra is not installed."""
    module, name = CLOUD_PROVIDERS[pool.provider].split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as error:
        raise CloudError(
            pool.name,
            f"provider {pool.provider} needs the `{pool.provider}` extra, which is not installed "
            f"(no module {error.name}): pip install 'rlboost[{pool.provider}]'",
        ) from None
