"""The co-located reserved instance of a run (docs/internals.md §2, §5): rollout inside the
training process, on the trainer's device.

A pool with `colocated: true` (reserved, local, size 1) gets no process of its own: the fabric makes
a `ColocatedInstance`, the pool's engine (`rl.engine_factory.build_engine` with the pool's
`engine_spec`; device `auto` is the trainer's) driven by an ordinary `RolloutWorker` on a thread
with its own Redis client. It registers as a reserved instance of its pool, so reap, offload and
steal treat it as any other; `offer` hands it each version in memory (`infra.rollout.direct_weights`:
no pull, no transfer reported); at `T_local` it hands its samples back and its engine sleeps. An
eviction (its heartbeats lapsed) registers it again with the same engine; `check()` raises
`ColocatedInstanceError`, naming the pool, once its thread ended before `close()` (its engine
failed), so the step fails instead of waiting. `record()` is its `InstanceRecord` for the ledger,
and `WithColocated` lists those beside a provider's own, which never launches them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from infra.providers.interface import InstanceHandle, InstanceRecord, PreemptionEvent, Provider, StopReason
from infra.providers.pool import PoolSpec
from infra.rollout.direct_weights import DirectWeights
from infra.rollout.instance import InstanceSpec
from infra.rollout.settings import WorkerSettings
from infra.rollout.worker import TORCH_THREADS, RolloutWorker, WorkerConfig
from rl.engine_spec import EngineSpec

log = logging.getLogger("rlboost.colocated")

STOP_TIMEOUT_S = 30.0
"""How long `close()` waits for the worker to hand its samples back and deregister."""


class ColocatedInstanceError(RuntimeError):
    """The co-located instance of a pool stopped while the run needed it."""


class ColocatedInstance:
    """One co-located instance: its engine, its worker and the worker's thread."""

    def __init__(
        self,
        pool: PoolSpec,
        run_engine: EngineSpec,
        trainer_device: str,
        *,
        redis_url: str,
        redis_ca_file: Path | None = None,
        run_id: str,
        model_path: Path,
        worker: WorkerSettings,
        field: str,
        instance_prefix: str = "",
    ) -> None:
        """Build the engine now (in the caller's thread: a failure names `field`, the pool's place
        in the configuration); `start()` runs it."""
        from transformers import AutoTokenizer

        from rl.engine_factory import build_engine
        from rl.stops import StopStrings

        if not pool.colocated:
            raise ValueError(f"pool {pool.name!r} is not colocated")
        self.pool = pool
        spec = pool.engine_spec(run_engine)
        if spec.device == "auto":
            spec = spec.model_copy(update={"device": trainer_device})
        self.config = WorkerConfig(
            redis_url=redis_url,
            redis_ca_file=None if redis_ca_file is None else str(redis_ca_file),
            run_id=run_id,
            instance=InstanceSpec.of_pool(f"{instance_prefix}{pool.name}-colocated", pool),
            model_path=str(model_path),
            engine=spec,
            **worker.model_dump(),
        )
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        engine = build_engine(
            spec,
            Path(model_path),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad,
            max_batch_size=worker.slots,
            field=field,
            sleep_mode=True,
        )
        self.weights = DirectWeights()
        self.worker = RolloutWorker(self.config, engine=StopStrings(engine, tokenizer), weights=self.weights)
        self._thread = threading.Thread(target=self._run, name=f"colocated-{pool.name}", daemon=True)
        self._lock = threading.Lock()
        """Orders `close()` against the thread's replacing an evicted worker."""
        self._closing = False
        self._exit_code: int | None = None
        self.launched_at: float | None = None
        self.terminated_at: float | None = None

    @property
    def instance_id(self) -> str:
        return self.config.instance.instance_id

    def start(self) -> None:
        self.launched_at = time.time()
        self._thread.start()
        log.info("colocated instance %s of pool %s started (%s)", self.instance_id, self.pool.name, self.config.engine)

    def _run(self) -> None:
        import torch

        # As many intra-op threads as a worker process has; with torch's OpenMP backend (its CPU
        # build) the count is per thread, so the trainer's own count is untouched.
        torch.set_num_threads(TORCH_THREADS)
        try:
            while True:
                self._exit_code = self.worker.run()
                if self._exit_code != 0 or self.worker.stop_reason != "evicted" or not self._replace_worker():
                    return
        except BaseException as exc:  # run() catches its loop's errors; this is registration failing
            self.worker.failure = exc
            self._exit_code = 1
        finally:
            self.terminated_at = time.time()

    def _replace_worker(self) -> bool:
        """After an eviction: a new worker on the same engine (awake, idle: the old one handed
        everything back), keeping the counts; False once `close()` has begun."""
        with self._lock:
            if self._closing:
                return False
            log.warning("colocated instance %s was evicted (heartbeats lapsed): registering again", self.instance_id)
            old = self.worker
            engine = old.engine
            assert engine is not None
            engine.wake()
            self.worker = RolloutWorker(self.config, engine=engine, weights=self.weights)
            self.worker.stats = old.stats
            return True

    def offer(self, version: int, state_dict: Mapping[str, Any]) -> None:
        """Hand the trainer's `version` to the worker (loaded when it next needs it)."""
        self.weights.offer(version, state_dict)

    def check(self) -> None:
        """Raise `ColocatedInstanceError` if the worker stopped while the run goes on."""
        if self._closing or self.launched_at is None or self._thread.is_alive():
            return
        worker = self.worker
        why = repr(worker.failure) if worker.failure is not None else f"it was stopped ({worker.stop_reason})"
        raise ColocatedInstanceError(
            f"the colocated instance {self.instance_id} of pool {self.pool.name!r} stopped during the run "
            f"(exit {self._exit_code}): {why}; see the training process's log"
        )

    def close(self) -> None:
        """Stop the worker (it hands its samples back and deregisters), then free the engine."""
        with self._lock:
            self._closing = True
            worker = self.worker
        if self._thread.is_alive():
            worker.request_stop("training run ended")
            self._thread.join(STOP_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("colocated instance %s did not stop within %.0f s", self.instance_id, STOP_TIMEOUT_S)
                return  # its engine is still in use: leave it to the process's exit
        self.worker.engine.close()  # type: ignore[union-attr]

    def record(self) -> InstanceRecord:
        """The instance as the ledger records it: its `InstanceSpec` and its pool's machine type."""
        spec = self.config.instance
        ended = self.terminated_at
        return InstanceRecord(
            spec.instance_id,
            spec.pool,
            spec.capacity_class,
            self.pool.machine_type,
            spec.price_per_hour,
            launched_at=self.launched_at if self.launched_at is not None else time.time(),
            state="running" if ended is None else "terminated",
            terminated_at=ended,
            reason=None if ended is None else "finished" if self._exit_code == 0 else "crashed",
            exit_code=self._exit_code,
        )


class WithColocated(Provider):
    """`inner` with the co-located instances listed too (the ones the run pays for that no provider
    launched): `instances` and `describe` know them and `quote` prices their pools as configured;
    everything else is `inner`'s, and a co-located instance cannot be terminated through it."""

    def __init__(self, inner: Provider, colocated: Sequence[ColocatedInstance]) -> None:
        self.inner = inner
        self.colocated = {c.instance_id: c for c in colocated}
        self._pools = {c.pool.name for c in colocated}

    def launch(self, pool: PoolSpec, count: int) -> list[InstanceHandle]:
        return self.inner.launch(pool, count)

    def instances(self, live_only: bool = False) -> list[InstanceRecord]:
        own = [c.record() for c in self.colocated.values() if c.launched_at is not None]
        return self.inner.instances(live_only) + [r for r in own if not live_only or r.state != "terminated"]

    def describe(self, instance_id: str) -> InstanceRecord:
        if instance_id in self.colocated:
            return self.colocated[instance_id].record()
        return self.inner.describe(instance_id)

    def terminate(self, instance_id: str, reason: StopReason = "scaled_down") -> None:
        if instance_id in self.colocated:
            raise ValueError(f"{instance_id} runs in the training process: it stops when the fabric closes")
        self.inner.terminate(instance_id, reason)

    def preemptions(self) -> list[PreemptionEvent]:
        return self.inner.preemptions()

    def quote(self, pool: PoolSpec) -> float:
        return pool.price_per_hour if pool.name in self._pools else self.inner.quote(pool)

    def refresh(self, pools: Sequence[PoolSpec] = ()) -> None:
        self.inner.refresh([pool for pool in pools if pool.name not in self._pools])

    def start(self) -> None:
        self.inner.start()  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        self.inner.shutdown()  # type: ignore[attr-defined]
