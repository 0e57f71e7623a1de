"""Local pools whose instances are Prefect flow runs: a Prefect worker process group per instance.

`PrefectLocalProvider` owns and drives an `infra.providers.local.LocalProvider` (the same pool
targets, availability schedules and real signals) with a different instance: before the local
provider starts one, it creates a flow run of the pool's `rollout-instance/<pool>` deployment in a
work queue of its own (`infra.fleet.instance_runs`), and the instance's process group runs a Prefect
process worker on that queue (`python -m infra.services.prefect_worker --run-once --stop-with-parent`)
that picks up exactly that run and exits when it ends. So every instance shows in the Prefect UI as
a `rollout-instance` run on its work pool: a preemption notice (SIGTERM to the group, which holds
the flow run's process too) drains it and ends its run **Crashed**; a silent SIGKILL leaves it
Running until the heartbeat automation (`deployments/automations/`) marks it Crashed; a run whose
instance was gone before it started is Cancelled; `shutdown()` drains every instance (runs end
**Completed**), then stops what is left. The Redis URL reaches instances in their environment
(`RLBOOST_REDIS_URL`), never in run parameters or command lines. Detail: docs/prefect.md.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from uuid import UUID

from infra.availability.traces import TraceSchedule
from infra.fleet.instance_runs import InstanceRuns, InstanceRunSpec, UnknownPool
from infra.providers.interface import InstanceHandle, InstanceRecord, PreemptionEvent, Provider, StopReason
from infra.providers.local import LocalProvider, TickThread
from infra.providers.placement import GpuSlot
from infra.providers.pool import PoolSpec
from infra.services import prefect_worker
from infra.services.prefect_api import check_api, current_api_url
from infra.services.redis_embedded import REDIS_CA_FILE_ENV, REDIS_URL_ENV

log = logging.getLogger(__name__)

__all__ = ["InstanceRunSpec", "PrefectLocalProvider", "UnknownPool"]

WORKER_POLL_S = 1
"""How often an instance's Prefect worker polls its queue (`PREFECT_WORKER_QUERY_SECONDS`)."""


class PrefectLocalProvider(Provider):
    """Local pools of Prefect workers, one `rollout-instance` flow run per instance."""

    def __init__(
        self,
        spec: InstanceRunSpec,
        *,
        api_url: str | None = None,
        schedules: dict[str, TraceSchedule] | None = None,
        clock: Callable[[], float] = time.time,
        seed: int = 0,
        log_dir: Path | None = None,
        instance_prefix: str = "",
        placement: Mapping[str, Sequence[GpuSlot]] | None = None,
        environment: Mapping[str, str] | None = None,
    ) -> None:
        """`api_url` defaults to the current `PREFECT_API_URL` and must answer; `environment` is
        added to the instances' (the run's weights secret); the other arguments go to the
        `LocalProvider` that schedules the instances (and places them)."""
        self.spec = spec
        self.api_url = check_api(api_url or current_api_url(), purpose="fabric.instances: prefect")
        self.runs = InstanceRuns(spec, self.api_url)
        bin_dir = str(Path(sys.executable).parent)
        environment = {
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PREFECT_API_URL": self.api_url,
            "PREFECT_WORKER_QUERY_SECONDS": str(WORKER_POLL_S),
            REDIS_URL_ENV: spec.redis_url,
            **({REDIS_CA_FILE_ENV: spec.redis_ca_file} if spec.redis_ca_file else {}),
            **(environment or {}),
        }
        self._local = LocalProvider(
            self._instance_command,
            schedules=schedules,
            clock=clock,
            seed=seed,
            log_dir=log_dir,
            environment=environment,
            instance_prefix=instance_prefix,
            placement=placement,
        )
        self._ticker = TickThread("prefect-local-provider")

    def last_log_line(self, instance_id: str) -> str:
        """The last line of the instance's log (`LocalProvider.last_log_line`)."""
        return self._local.last_log_line(instance_id)

    # -- Provider -------------------------------------------------------------------------------

    def launch(self, pool: PoolSpec, count: int) -> list[InstanceHandle]:
        """Check that the pool is deployed, then raise its target as `LocalProvider.launch` does."""
        self.runs.deployment(pool)
        return self._local.launch(pool, count)

    def instances(self, live_only: bool = False) -> list[InstanceRecord]:
        return self._local.instances(live_only)

    def describe(self, instance_id: str) -> InstanceRecord:
        return self._local.describe(instance_id)

    def terminate(self, instance_id: str, reason: StopReason = "scaled_down") -> None:
        self._local.terminate(instance_id, reason)

    def preemptions(self) -> list[PreemptionEvent]:
        return self._local.preemptions()

    def quote(self, pool: PoolSpec) -> float:
        return self._local.quote(pool)

    def flow_run_id(self, instance_id: str) -> UUID:
        """The `rollout-instance` flow run of an instance; `KeyError` if unknown."""
        return self.runs.flow_run_id(instance_id)

    # -- driving --------------------------------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        """The local provider's tick (schedules, preemptions, replacements), then settle the runs
        of instances that ended."""
        self._local.tick(now)
        self._settle_ended_runs()

    def start(self, interval_s: float = 0.1) -> None:
        """Call `tick()` every `interval_s` seconds on a helper thread until `shutdown()`."""
        self._ticker.start(self, interval_s)

    def stop(self) -> None:
        """Stop the helper thread (instances keep running)."""
        self._ticker.stop()

    def shutdown(self, drain_timeout_s: float = 30.0, grace_s: float = 5.0) -> None:
        """Drain every instance (its run ends Completed) for up to `drain_timeout_s`, then stop
        what is left like `LocalProvider.shutdown(grace_s)` and settle every run."""
        self.stop()
        live = [r.instance_id for r in self._local.instances(live_only=True) if r.state == "running"]
        self.runs.drain(live, drain_timeout_s)
        self._local.shutdown(grace_s)
        self._settle_ended_runs()

    def __enter__(self) -> PrefectLocalProvider:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- internals ------------------------------------------------------------------------------

    def _instance_command(self, pool: PoolSpec, instance_id: str) -> list[str]:
        """Create the instance's flow run in a queue of its own; the command of its worker."""
        queue = self.runs.create(pool, instance_id)
        return [
            sys.executable,
            "-m",
            prefect_worker.__name__,
            "--pool",
            pool.name,
            "--work-queue",
            queue,
            "--name",
            queue,
            "--limit",
            "1",
            "--run-once",
            "--stop-with-parent",
        ]

    def _settle_ended_runs(self) -> None:
        """Cancel the runs of ended instances that never started, and remove their queues."""
        self.runs.settle(r.instance_id for r in self._local.instances() if r.state == "terminated")
