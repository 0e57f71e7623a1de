"""The `rollout-instance` flow: one rollout worker as a Prefect flow run on its pool.

The flow runs `infra.worker.RolloutWorker` until it is stopped — SIGTERM (a preemption notice,
delivered by the Prefect worker or the cloud), a `drain` control message, or eviction — and
returns how it stopped. A worker that stops with an error fails the flow run, so the UI shows it.
"""

from __future__ import annotations

import threading
from pathlib import Path

from prefect import flow, get_run_logger

from infra.worker import RolloutWorker, WorkerConfig


@flow(name="rollout-instance", flow_run_name="{pool}/{instance_id}", persist_result=False)
def rollout_instance(
    pool: str,
    instance_id: str,
    run_id: str,
    redis_url: str,
    model_path: str,
    weights_dir: str,
    capacity_class: str = "spot",
    price_per_hour: float = 0.0,
    slots: int = 8,
) -> int:
    """Serve rollout for `run_id` from `pool` until stopped; returns the worker's exit code (0)."""
    worker = RolloutWorker(WorkerConfig(
        redis_url=redis_url, run_id=run_id, instance_id=instance_id, pool=pool,
        capacity_class=capacity_class, price_per_hour=price_per_hour,
        model_path=Path(model_path), weights_dir=Path(weights_dir), slots=slots,
    ))
    if threading.current_thread() is threading.main_thread():
        worker.install_signal_handlers()
    get_run_logger().info("rollout instance %s serving run %s from pool %s", instance_id, run_id, pool)
    code = worker.run()
    if code != 0:
        raise RuntimeError(f"rollout instance {instance_id} stopped with exit code {code}; see its log")
    return code
