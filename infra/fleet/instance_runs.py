"""The `rollout-instance/<pool>` flow runs of one training run's instances, on a Prefect server.

Every instance that runs as a Prefect flow run (a local `fabric.instances: prefect` instance, a
cloud VM) gets one run of its pool's deployment, created *before* the instance starts, in a work
queue of its own (`<run id>-<instance id>`) that only its worker polls
(`python -m infra.services.prefect_worker --run-once`). `InstanceRuns` owns that bookkeeping:
`create` (a VM's `before_boot`) checks the pool's deployment and work pool (`UnknownPool` names the
fix) and creates the run, whose parameters carry no secret: the Redis URL and the weights secret
travel in the environment, or in the Prefect Secret block its `environment_block` parameter names
(`publish_environment` / `remove_environment`); `settle` cancels the run of an instance that ended
before a worker picked it up and deletes its queue; `worker_ends` says how the runs of live
instances ended (a failed boot or engine start sets its run Failed with the cause), for
`infra.fleet.instance_watch` to replace them; `drain` asks live instances to finish (their runs
end Completed) and cancels runs nobody picked up, until every run is final or the time is up.
Detail: docs/internals.md §3, docs/prefect.md, docs/cloud-pools.md.
"""

from __future__ import annotations

import builtins
import logging
import threading
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled

from infra.fleet.instance_watch import WorkerEnd
from infra.providers.interface import instance_work_queue
from infra.providers.pool import PoolSpec
from infra.rollout.control import Drain
from infra.rollout.instance import InstanceSpec
from infra.rollout.registry import InstanceRegistry
from infra.rollout.settings import WorkerSettings
from infra.services.prefect_api import current_api_key, current_auth_string
from infra.services.redis_embedded import RedisSettings
from rl.engine_spec import EngineSpec

log = logging.getLogger(__name__)

FINAL_STATES = (StateType.FAILED, StateType.CRASHED, StateType.COMPLETED, StateType.CANCELLED)
"""The states an instance's run ends in (its worker is gone)."""
DEPLOYMENT_FLOW = "rollout-instance"
"""Flow name of the instance deployments: `rollout-instance/<pool>`."""


class UnknownPool(ValueError):
    """A pool with no `rollout-instance/<pool>` deployment (or work pool) on the Prefect server."""


@dataclass(frozen=True)
class InstanceRunSpec:
    """What every instance of one run needs: the parameters of its `rollout-instance` flow run.

    `model` is the base model as the instance sees it: a directory (made absolute here, since the
    flow run's working directory is the deployment's) or an fsspec URI that a cloud VM downloads."""

    run_id: str
    redis_url: str
    model: str
    worker: WorkerSettings
    engine: EngineSpec
    """The run's engine; each pool's overrides apply (`PoolSpec.engine_spec`)."""
    environment_block: str | None = None
    """Prefect Secret block with the instances' environment (cloud VMs); None: they inherit it."""
    redis_ca_file: str | None = None
    """The CA file of a rediss:// Redis on this machine (local instances get its path in their
    environment; a VM gets its content in its boot script)."""

    def parameters(self, pool: PoolSpec, instance_id: str) -> dict[str, Any]:
        """The parameters of the flow run of `instance_id` of `pool`: its `InstanceSpec`, then the run's."""
        return {
            **InstanceSpec.of_pool(instance_id, pool).model_dump(),
            "run_id": self.run_id,
            "model_path": self.model,
            "settings": self.worker.model_dump(),
            "engine": pool.engine_spec(self.engine).model_dump(),
            **({"environment_block": self.environment_block} if self.environment_block else {}),
        }


@dataclass
class InstanceRun:
    """The flow run (and the work queue it waits in) of one instance."""

    flow_run_id: UUID
    work_queue: str
    pool: str
    settled: bool = False
    """The instance ended and its run was checked (and Cancelled if it never started)."""


class InstanceRuns:
    """The flow runs of one training run's instances; safe to use from several threads."""

    def __init__(self, spec: InstanceRunSpec, api_url: str) -> None:
        """`api_url`: the Prefect API (its key is the current `PREFECT_API_KEY`, if any)."""
        self.spec = spec
        self.api_url = api_url
        self._api_key = current_api_key()
        self._auth_string = current_auth_string()
        self._deployments: dict[str, UUID] = {}
        self._runs: dict[str, InstanceRun] = {}
        self._lock = threading.Lock()

    def client(self) -> SyncPrefectClient:
        return SyncPrefectClient(self.api_url, api_key=self._api_key, auth_string=self._auth_string)

    def flow_run_id(self, instance_id: str) -> UUID:
        """The `rollout-instance` flow run of an instance; `KeyError` if unknown."""
        with self._lock:
            return self._runs[instance_id].flow_run_id

    def known(self) -> builtins.list[str]:
        """Instances that have a run."""
        with self._lock:
            return builtins.list(self._runs)

    def deployment(self, pool: PoolSpec) -> UUID:
        """Id of `rollout-instance/<pool>`; `UnknownPool` if it or its work pool is missing."""
        with self._lock:
            if pool.name in self._deployments:
                return self._deployments[pool.name]
        name = f"{DEPLOYMENT_FLOW}/{pool.name}"
        fix = (
            f"add a `{pool.name}` deployment of flows/rollout_instance.py:rollout_instance on work pool "
            f"`{pool.name}` to prefect.yaml, then run `rlboost up` (or `prefect --no-prompt deploy --all`)"
        )
        with self.client() as client:
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
                "it with `rlboost up`",
                pool.name,
            )
        with self._lock:
            self._deployments[pool.name] = deployment.id
        return deployment.id

    def create(self, pool: PoolSpec, instance_id: str) -> str:
        """Create the instance's flow run in a queue of its own; returns the queue's name."""
        queue = instance_work_queue(self.spec.run_id, instance_id)
        deployment = self.deployment(pool)
        with self.client() as client:
            run = client.create_flow_run_from_deployment(
                deployment,
                parameters=self.spec.parameters(pool, instance_id),
                name=f"{pool.name}/{instance_id}",
                tags=[DEPLOYMENT_FLOW, self.spec.run_id],
                work_queue_name=queue,
            )
        with self._lock:
            self._runs[instance_id] = InstanceRun(run.id, queue, pool.name)
        return queue

    # -- `infra.providers.interface.BootHooks`: a cloud VM's run exists before the VM does ----------

    def before_boot(self, pool: PoolSpec, instance_id: str) -> None:
        self.create(pool, instance_id)

    def never_booted(self, instance_id: str, why: str) -> None:
        self.settle([instance_id], why)

    # -- the instances' secrets ----------------------------------------------------------------

    def publish_environment(self, values: dict[str, str]) -> None:
        """Save `values` (environment variables with secrets) as the Secret block the runs name."""
        from prefect.blocks.system import Secret

        if self.spec.environment_block is None:
            raise ValueError("this run's instances name no environment block")
        Secret(value=values).save(self.spec.environment_block, overwrite=True)

    def remove_environment(self) -> None:
        """Delete the Secret block (once no instance will start any more); no error if it is gone."""
        if self.spec.environment_block is None:
            return
        with self.client() as client:
            try:
                block = client.read_block_document_by_name(self.spec.environment_block, block_type_slug="secret")
            except ObjectNotFound:
                return
            client.delete_block_document(block.id)

    def worker_ends(self, instance_ids: Collection[str]) -> dict[str, WorkerEnd]:
        """How the runs of those of `instance_ids` whose run is final ended (state, message, time)."""
        with self._lock:
            ours = {self._runs[i].flow_run_id: i for i in instance_ids if i in self._runs}
        if not ours:
            return {}
        ended = FlowRunFilter(
            id=FlowRunFilterId(any_=builtins.list(ours)),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=builtins.list(FINAL_STATES))),
        )
        with self.client() as client:
            runs = client.read_flow_runs(flow_run_filter=ended, limit=len(ours))
        return {
            ours[run.id]: WorkerEnd(run.state.type.name, run.state.message or "", run.state.timestamp.timestamp())
            for run in runs
            if run.state is not None
        }

    def run_message(self, instance_id: str) -> str:
        """The message of an instance's run if the run is final (why it failed), else ''."""
        with self._lock:
            run = self._runs.get(instance_id)
        if run is None:
            return ""
        with self.client() as client:
            state = client.read_flow_run(run.flow_run_id).state
        return (state.message or "") if state is not None and state.type in FINAL_STATES else ""

    # -- ending ----------------------------------------------------------------------------------

    def settle(self, ended: Iterable[str], why: str = "ended before it started this run") -> None:
        """For instances that ended: cancel each run no worker picked up, delete each queue."""
        ended = set(ended)
        with self._lock:
            due = [(i, run) for i, run in self._runs.items() if i in ended and not run.settled]
        if not due:
            return
        with self.client() as client:
            for instance_id, run in due:
                flow_run = client.read_flow_run(run.flow_run_id)
                if flow_run.state is not None and flow_run.state.type in (StateType.SCHEDULED, StateType.PENDING):
                    client.set_flow_run_state(
                        run.flow_run_id,
                        Cancelled(message=f"instance {instance_id} {why}"),
                        force=True,
                    )
                try:
                    queue = client.read_work_queue_by_name(run.work_queue, work_pool_name=run.pool)
                    client.delete_work_queue_by_id(queue.id)
                except ObjectNotFound:
                    pass
                run.settled = True

    def drain(self, live: Iterable[str], timeout_s: float) -> set[str]:
        """Cancel the runs of `live` instances no worker has picked up yet; ask every other one to
        drain (again and again while it is still starting) until its run is final or `timeout_s`
        passes. Returns the instances whose runs are still not final."""
        live = set(live)
        with self._lock:
            pending = {i: run.flow_run_id for i, run in self._runs.items() if i in live}
        if not pending:
            return set()
        client = RedisSettings(url=self.spec.redis_url, ca_file=self.spec.redis_ca_file).client()
        registry = InstanceRegistry(client, self.spec.run_id)
        asked: set[str] = set()
        deadline = time.monotonic() + timeout_s
        try:
            with self.client() as api:
                while pending and time.monotonic() < deadline:
                    for instance_id, flow_run_id in builtins.list(pending.items()):
                        state = api.read_flow_run(flow_run_id).state
                        if state is not None and state.type == StateType.SCHEDULED:
                            api.set_flow_run_state(
                                flow_run_id, Cancelled(message="training ended before an instance started this run")
                            )
                        elif state is not None and state.is_final():
                            del pending[instance_id]
                        elif instance_id not in asked and registry.request(instance_id, Drain()):
                            asked.add(instance_id)
                    time.sleep(0.2)
        finally:
            client.close()
        if pending:
            log.warning("instances %s did not drain within %.0f s; stopping them", sorted(pending), timeout_s)
        return set(pending)
