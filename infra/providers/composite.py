"""One `Provider` over several: each pool goes to the provider of its kind (`PoolSpec.provider`).

`CompositeProvider` owns only the routing. `launch` and `quote` go to the provider of the pool's
kind, `refresh` gives each provider the pools of its kind, `list` and `preemptions` merge what
every provider reports, `describe` and `terminate` go to the provider that knows the instance, and
`start()`/`shutdown()` reach the providers that have them (the local ones; the cloud providers have
no threads or processes of their own). A pool of a kind it holds no provider for is refused.

`preemptions()` drains the events of every provider it holds: a cloud provider's events belong to
the capacity manager that drives it, so leave them to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import get_args

from infra.providers.interface import InstanceHandle, InstanceRecord, PreemptionEvent, Provider, StopReason
from infra.providers.pool import PoolSpec

KINDS: tuple[str, ...] = get_args(PoolSpec.model_fields["provider"].annotation)
"""The values of `PoolSpec.provider`: `local`, `gcp`, `azure`."""


class CompositeProvider(Provider):
    """Routes every pool to the provider of its kind."""

    def __init__(self, providers: Mapping[str, Provider]) -> None:
        """`providers`: kind (`local`, `gcp`, `azure`) -> the provider of that kind's pools."""
        unknown = sorted(set(providers) - set(KINDS))
        if unknown:
            raise ValueError(f"no such provider kind: {unknown} (kinds are {', '.join(KINDS)})")
        self.providers = dict(providers)

    def launch(self, pool: PoolSpec, count: int) -> list[InstanceHandle]:
        return self._of(pool).launch(pool, count)

    def quote(self, pool: PoolSpec) -> float:
        return self._of(pool).quote(pool)

    def instances(self, live_only: bool = False) -> list[InstanceRecord]:
        return [record for provider in self.providers.values() for record in provider.instances(live_only)]

    def preemptions(self) -> list[PreemptionEvent]:
        return [event for provider in self.providers.values() for event in provider.preemptions()]

    def describe(self, instance_id: str) -> InstanceRecord:
        return self._owner(instance_id).describe(instance_id)

    def terminate(self, instance_id: str, reason: StopReason = "scaled_down") -> None:
        self._owner(instance_id).terminate(instance_id, reason)

    def refresh(self, pools: Sequence[PoolSpec] = ()) -> None:
        for pool in pools:
            self._of(pool)
        for kind, provider in self.providers.items():
            provider.refresh([pool for pool in pools if pool.provider == kind])

    def start(self) -> None:
        """Start the providers that run helper threads (the local ones)."""
        for provider in self.providers.values():
            if hasattr(provider, "start"):
                provider.start()

    def shutdown(self) -> None:
        """Shut down every provider that can be (the local ones), all of them even if one fails."""
        with ExitStack() as stack:
            for provider in self.providers.values():
                if hasattr(provider, "shutdown"):
                    stack.callback(provider.shutdown)

    def _of(self, pool: PoolSpec) -> Provider:
        provider = self.providers.get(pool.provider)
        if provider is None:
            raise ValueError(
                f"pool {pool.name!r} has provider {pool.provider!r}, but this run has no {pool.provider} provider "
                f"(it has: {', '.join(self.providers) or 'none'})"
            )
        return provider

    def _owner(self, instance_id: str) -> Provider:
        for provider in self.providers.values():
            try:
                provider.describe(instance_id)
            except KeyError:
                continue
            return provider
        raise KeyError(f"unknown instance {instance_id!r}")
