"""The `rollout-instance` flow: one rollout worker as a Prefect flow run on its pool.

The flow runs `infra.rollout.worker.RolloutWorker` until it is stopped and ends in a state that says how:
- a `drain` control message (the end of training) or an eviction: **Completed** (returns 0);
- SIGTERM or SIGINT (a preemption notice, from the instance's provider or the cloud's watcher): the
  worker stops claiming, flushes and hands back its samples, and the run ends **Crashed** with a
  message naming the signal, so the UI shows the preemption;
- a worker error: **Failed** (`rollout instance <id> cannot start: ...` when its engine never
  loaded, e.g. a GPU VM without a working driver: the training run stops on that).
A preemption without notice (SIGKILL) leaves the run Running; the heartbeat automation in
`deployments/automations/` marks it Crashed. The Redis URL (it carries the password) may come from
`RLBOOST_REDIS_URL` instead of a parameter, so the UI never shows it; a cloud VM has no such
environment: its run names a Prefect Secret block (`environment_block`) mapping variable names to
values (the Redis URL, the weights secret), and the flow sets those the environment lacks before
the worker starts. Detail: docs/prefect.md, docs/cloud-pools.md.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Crashed, State

from infra.availability.capacity import CapacityClass
from infra.rollout.instance import InstanceSpec
from infra.rollout.settings import WorkerSettings
from infra.rollout.worker import RolloutWorker, WorkerConfig
from infra.services.redis_embedded import REDIS_CA_FILE_ENV, REDIS_URL_ENV
from rl.engine_spec import EngineSpec


class PreemptionNotice:
    """Records the first stop signal the instance receives and asks the worker to drain."""

    def __init__(self, worker: RolloutWorker) -> None:
        self.worker = worker
        self.signal_name: str | None = None

    def _handle(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name = name
        self.worker.request_stop(name)

    @contextmanager
    def installed(self) -> Iterator[PreemptionNotice]:
        """Handle SIGTERM and SIGINT for the block (main thread only), then restore the handlers."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def load_environment(block: str) -> list[str]:
    """Set the variables of the Secret block `block` that the environment lacks; their names."""
    from prefect.blocks.system import Secret

    values = Secret.load(block).get()
    if not isinstance(values, dict):
        raise ValueError(
            f"Secret block {block!r} must hold a mapping of environment variables, not {type(values).__name__}"
        )
    added = [name for name in values if name not in os.environ]
    for name in added:
        os.environ[name] = str(values[name])
    return added


@flow(name="rollout-instance", flow_run_name="{pool}/{instance_id}", persist_result=False)
def rollout_instance(
    pool: str,
    instance_id: str,
    capacity_class: CapacityClass,
    price_per_hour: float,
    run_id: str,
    model_path: str,
    redis_url: str | None = None,
    settings: WorkerSettings | None = None,
    engine: EngineSpec | None = None,
    environment_block: str | None = None,
) -> int | State:
    """Serve rollout for `run_id` from `pool` until stopped: 0 after a drain, a Crashed state
    after a preemption notice. The first four parameters are the instance's `InstanceSpec`;
    `settings` is the run's `fabric.worker` and `engine` the pool's engine (default: their
    defaults)."""
    if environment_block:
        load_environment(environment_block)
    url = redis_url or os.environ.get(REDIS_URL_ENV)
    if not url:
        raise ValueError(
            f"rollout instance {instance_id}: no Redis URL; pass the redis_url parameter or set "
            f"{REDIS_URL_ENV} in the environment of the instance's Prefect worker"
        )
    worker = RolloutWorker(
        WorkerConfig(
            redis_url=url,
            redis_ca_file=os.environ.get(REDIS_CA_FILE_ENV) if url.startswith("rediss://") else None,
            run_id=run_id,
            instance=InstanceSpec(
                instance_id=instance_id, pool=pool, capacity_class=capacity_class, price_per_hour=price_per_hour
            ),
            model_path=model_path,
            engine=engine or EngineSpec(),
            **(settings or WorkerSettings()).model_dump(),
        )
    )
    logger = get_run_logger()
    logger.info("rollout instance %s serving run %s from pool %s", instance_id, run_id, pool)
    with PreemptionNotice(worker).installed() as notice:
        code = worker.run()
    if code != 0:
        cause = (
            f": {type(worker.failure).__name__}: {worker.failure}" if worker.failure is not None else "; see its log"
        )
        if worker.engine is None:  # its engine never loaded: the run sees why (`InstanceRuns.worker_ends`)
            raise RuntimeError(
                f"rollout instance {instance_id} cannot start: its engine failed{cause}"
            ) from worker.failure
        raise RuntimeError(f"rollout instance {instance_id} stopped with exit code {code}{cause}") from worker.failure
    if notice.signal_name is not None:
        stats = worker.stats
        message = (
            f"preempted: {notice.signal_name} received; instance {instance_id} stopped claiming and handed "
            f"back its samples ({stats.finished} finished, {stats.released} released, {stats.tokens} tokens generated)"
        )
        logger.warning(message)
        return Crashed(message=message)
    logger.info("rollout instance %s drained: %d samples finished", instance_id, worker.stats.finished)
    return code
