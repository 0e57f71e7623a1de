"""Local pools whose instances are Prefect flow runs: a Prefect worker process group per instance.

`PrefectLocalProvider` is the local provider (`infra.providers.local.LocalProvider`, which it
owns and drives: the same pool targets, availability schedules and real signals) with a different
instance: when the local provider starts an instance, this provider first creates a flow run of the
pool's `rollout-instance/<pool>` deployment in a work queue of its own, then the instance's process
group runs a Prefect process worker for the pool on that queue (`python -m infra.prefect_worker
--run-once --stop-with-parent`), which picks up exactly that run and exits when it ends. So every
instance shows in the Prefect UI as a `rollout-instance` run on its work pool, and:

- a preemption notice (SIGTERM to the group) reaches the worker and the flow run's process (the
  work pool's base job template keeps it in the worker's process group): the instance drains, its
  run ends **Crashed** with the reason, and the worker exits after it; after the notice period the
  group gets SIGKILL;
- a silent preemption (SIGKILL) leaves the run Running until the heartbeat automation
  (`deployments/automations/`) marks it Crashed;
- an instance that is gone before its worker picked up its run gets that run Cancelled;
- `shutdown()` first drains every instance through its control list (the runs end **Completed**),
  then stops what is left; an instance whose training process died stops by itself.

The Redis URL reaches the instances through their environment (`RLBOOST_REDIS_URL`), not through
run parameters, so the password never shows in the UI.
"""

from __future__ import annotations

import builtins
import logging
import os
import shutil
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import redis
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from prefect.client.schemas.objects import StateType
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled

from infra.fabric import REDIS_URL_ENV, WorkerSettings
from infra.prefect_api import check_api, current_api_url
from infra.providers.base import InstanceHandle, InstanceRecord, PoolSpec, PreemptionEvent, Provider, StopReason
from infra.providers.local import LocalProvider
from infra.registry import InstanceRegistry
from infra.traces import TraceSchedule

log = logging.getLogger(__name__)

DEPLOYMENT_FLOW = "rollout-instance"
"""Flow name of the instance deployments: `rollout-instance/<pool>`."""
WORKER_POLL_S = 1
"""How often an instance's Prefect worker polls its queue (`PREFECT_WORKER_QUERY_SECONDS`)."""


class UnknownPool(ValueError):
    """A pool with no `rollout-instance/<pool>` deployment (or work pool) on the Prefect server."""


@dataclass(frozen=True)
class InstanceRunSpec:
    """What every instance of one run needs: the parameters of its `rollout-instance` flow run
    (the model path made absolute here: the flow run's working directory is the deployment's)."""

    run_id: str
    redis_url: str
    model_path: Path
    worker: WorkerSettings

    def parameters(self, pool: PoolSpec, instance_id: str) -> dict[str, Any]:
        w = self.worker
        return {
            "pool": pool.name, "instance_id": instance_id, "run_id": self.run_id,
            "model_path": str(self.model_path.resolve()),
            "capacity_class": pool.capacity_class, "price_per_hour": pool.price_per_hour,
            "slots": w.slots, "flush_tokens": w.flush_tokens, "flush_ms": w.flush_ms,
            "heartbeat_s": w.heartbeat_s, "ttl_s": w.ttl_s,
        }


@dataclass
class InstanceRun:
    """The flow run (and the work queue it waits in) of one instance."""

    flow_run_id: UUID
    work_queue: str
    pool: str
    settled: bool = False
    """The instance ended and its run was checked (and Cancelled if it never started)."""


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
    ) -> None:
        """`api_url` defaults to the current `PREFECT_API_URL` and must answer; the other
        arguments go to the `LocalProvider` that schedules the instances."""
        self.spec = spec
        self.api_url = check_api(api_url or current_api_url(), purpose="fabric.instances: prefect")
        from prefect.settings import get_current_settings

        key = get_current_settings().api.key
        self._api_key = key.get_secret_value() if key else None
        self._deployments: dict[str, UUID] = {}
        self._runs: dict[str, InstanceRun] = {}
        self._lock = threading.Lock()
        self._local = LocalProvider(self._instance_command, schedules=schedules, clock=clock, seed=seed, log_dir=log_dir)
        self._thread: threading.Thread | None = None
        self._stop_thread = threading.Event()

    # -- Provider -------------------------------------------------------------------------------

    def launch(self, pool: PoolSpec, count: int) -> builtins.list[InstanceHandle]:
        """Check that the pool is deployed, then raise its target as `LocalProvider.launch` does."""
        self._deployment(pool)
        return self._local.launch(pool, count)

    def list(self, live_only: bool = False) -> builtins.list[InstanceRecord]:
        return self._local.list(live_only)

    def describe(self, instance_id: str) -> InstanceRecord:
        return self._local.describe(instance_id)

    def terminate(self, instance_id: str, reason: StopReason = "scaled_down") -> None:
        self._local.terminate(instance_id, reason)

    def preemptions(self) -> builtins.list[PreemptionEvent]:
        return self._local.preemptions()

    def quote(self, pool: PoolSpec) -> float:
        return self._local.quote(pool)

    def flow_run_id(self, instance_id: str) -> UUID:
        """The `rollout-instance` flow run of an instance; `KeyError` if unknown."""
        with self._lock:
            return self._runs[instance_id].flow_run_id

    # -- driving --------------------------------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        """The local provider's tick (schedules, preemptions, replacements), then settle the runs
        of instances that ended."""
        self._local.tick(now)
        self._settle_ended_runs()

    def start(self, interval_s: float = 0.1) -> None:
        """Call `tick()` every `interval_s` seconds on a helper thread until `shutdown()`."""
        if self._thread is not None:
            raise RuntimeError("the tick thread is already running")
        self._stop_thread.clear()
        self._thread = threading.Thread(
            target=_tick_loop, args=(weakref.ref(self), self._stop_thread, interval_s),
            name="prefect-local-provider", daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop the helper thread (instances keep running)."""
        if self._thread is not None:
            self._stop_thread.set()
            self._thread.join()
            self._thread = None

    def shutdown(self, drain_timeout_s: float = 30.0, grace_s: float = 5.0) -> None:
        """Drain every instance (its run ends Completed) for up to `drain_timeout_s`, then stop
        what is left like `LocalProvider.shutdown(grace_s)` and settle every run."""
        self.stop()
        self._drain(drain_timeout_s)
        self._local.shutdown(grace_s)
        self._settle_ended_runs()

    def __enter__(self) -> PrefectLocalProvider:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- internals ------------------------------------------------------------------------------

    def _client(self) -> SyncPrefectClient:
        return SyncPrefectClient(self.api_url, api_key=self._api_key)

    def _deployment(self, pool: PoolSpec) -> UUID:
        """Id of `rollout-instance/<pool>`; `UnknownPool` if it or its work pool is missing."""
        if pool.name in self._deployments:
            return self._deployments[pool.name]
        name = f"{DEPLOYMENT_FLOW}/{pool.name}"
        fix = (f"add a `{pool.name}` deployment of flows/rollout_instance.py:rollout_instance on work pool "
               f"`{pool.name}` to prefect.yaml, then run `rlboost up` (or `prefect --no-prompt deploy --all`)")
        with self._client() as client:
            try:
                deployment = client.read_deployment_by_name(name)
            except ObjectNotFound:
                ours = FlowFilter(name=FlowFilterName(any_=[DEPLOYMENT_FLOW]))
                deployed = sorted(d.name for d in client.read_deployments(flow_filter=ours))
                raise UnknownPool(
                    f"unknown pool {pool.name!r}: the Prefect server at {self.api_url} has no deployment {name} "
                    f"(deployed rollout pools: {', '.join(deployed) or 'none'}); {fix}"
                ) from None
            if deployment.work_pool_name != pool.name:
                raise UnknownPool(
                    f"deployment {name} runs on work pool {deployment.work_pool_name!r}, not {pool.name!r}; {fix}"
                )
            try:
                work_pool = client.read_work_pool(pool.name)
            except ObjectNotFound:
                raise UnknownPool(
                    f"unknown pool {pool.name!r}: the Prefect server at {self.api_url} has no work pool "
                    f"{pool.name!r}; create it with `rlboost up` (process pools with the base job template "
                    "in deployments/work-pools/)"
                ) from None
        command = work_pool.base_job_template.get("variables", {}).get("properties", {}).get("command", {})
        if not command.get("default"):
            log.warning(
                "work pool %s does not set the flow-run command (deployments/work-pools/local-process.json): its "
                "flow runs get their own process group, so a preemption notice will not reach them; recreate "
                "it with `rlboost up`", pool.name,
            )
        self._deployments[pool.name] = deployment.id
        return deployment.id

    def _instance_command(self, pool: PoolSpec, instance_id: str) -> list[str]:
        """Create the instance's flow run in a queue of its own; the command of its worker."""
        queue = f"{self.spec.run_id}-{instance_id}"
        with self._client() as client:
            run = client.create_flow_run_from_deployment(
                self._deployment(pool),
                parameters=self.spec.parameters(pool, instance_id),
                name=f"{pool.name}/{instance_id}",
                tags=[DEPLOYMENT_FLOW, self.spec.run_id],
                work_queue_name=queue,
            )
        with self._lock:
            self._runs[instance_id] = InstanceRun(run.id, queue, pool.name)
        bin_dir = str(Path(sys.executable).parent)
        return [
            shutil.which("env") or "/usr/bin/env",
            f"PATH={bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            f"PREFECT_API_URL={self.api_url}",
            f"PREFECT_WORKER_QUERY_SECONDS={WORKER_POLL_S}",
            f"{REDIS_URL_ENV}={self.spec.redis_url}",
            sys.executable, "-m", "infra.prefect_worker", "--pool", pool.name, "--work-queue", queue, "--name", queue,
            "--limit", "1", "--run-once", "--stop-with-parent",
        ]

    def _settle_ended_runs(self) -> None:
        """Cancel the runs of ended instances that never started, and remove their queues."""
        ended = {r.instance_id for r in self._local.list() if r.state == "terminated"}
        with self._lock:
            due = [(i, run) for i, run in self._runs.items() if i in ended and not run.settled]
        if not due:
            return
        with self._client() as client:
            for instance_id, run in due:
                flow_run = client.read_flow_run(run.flow_run_id)
                if flow_run.state is not None and flow_run.state.type in (StateType.SCHEDULED, StateType.PENDING):
                    client.set_flow_run_state(
                        run.flow_run_id, Cancelled(message=f"instance {instance_id} ended before it started this run"),
                        force=True,
                    )
                try:
                    queue = client.read_work_queue_by_name(run.work_queue, work_pool_name=run.pool)
                    client.delete_work_queue_by_id(queue.id)
                except ObjectNotFound:
                    pass
                run.settled = True

    def _drain(self, timeout_s: float) -> None:
        """Cancel the runs no worker has picked up yet; ask every other live instance to drain
        (again and again while it is still starting) until its run is final or `timeout_s` passes."""
        live = {r.instance_id for r in self._local.list(live_only=True) if r.state == "running"}
        with self._lock:
            pending = {i: self._runs[i].flow_run_id for i in live if i in self._runs}
        if not pending:
            return
        client = redis.Redis.from_url(self.spec.redis_url)
        registry = InstanceRegistry(client, self.spec.run_id, ttl_s=self.spec.worker.ttl_s)
        asked: set[str] = set()
        deadline = time.monotonic() + timeout_s
        try:
            with self._client() as api:
                while pending and time.monotonic() < deadline:
                    for instance_id, flow_run_id in builtins.list(pending.items()):
                        state = api.read_flow_run(flow_run_id).state
                        if state is not None and state.type == StateType.SCHEDULED:
                            api.set_flow_run_state(flow_run_id, Cancelled(message="training ended before an instance started this run"))
                        elif state is not None and state.is_final():
                            del pending[instance_id]
                        elif instance_id not in asked and registry.request(instance_id, {"op": "drain"}):
                            asked.add(instance_id)
                    time.sleep(0.2)
        finally:
            client.close()
        if pending:
            log.warning("instances %s did not drain within %.0f s; stopping them", sorted(pending), timeout_s)


def _tick_loop(provider: weakref.ref[PrefectLocalProvider], stop: threading.Event, interval_s: float) -> None:
    while not stop.wait(interval_s):
        live = provider()
        if live is None:
            return
        try:
            live.tick()
        except Exception:
            log.exception("prefect local provider tick failed")
        del live
