"""Pure controller policies (docs/internals.md §5): each reads a `ClusterSnapshot` or a few measured
numbers plus a clock value, and returns frozen decisions. No I/O: the Redis runtime and the
simulator drive the same objects.

Modules: `snapshot` (state types), `dispatch` (late binding), `steal` (token-level load
balancing), `reaper` (heartbeat eviction), `offload` (adaptive `T_local`), `capacity` (spot pool
targets).
"""

from infra.rollout.policies.capacity import (
    CapacityConfig,
    CapacityTarget,
    PoolOffer,
    effective_throughput,
    plan_capacity,
)
from infra.rollout.policies.dispatch import DispatchDecision, active, dispatch, eligible, priority
from infra.rollout.policies.offload import OffloadController, StepTiming
from infra.rollout.policies.reaper import ReapDecision, ReaperConfig, reap
from infra.rollout.policies.snapshot import (
    CapacityClass,
    ClusterSnapshot,
    InstanceView,
    QueueView,
    RunningSample,
    StepView,
)
from infra.rollout.policies.steal import StealConfig, StealDecision, steal

__all__ = [
    "CapacityClass",
    "CapacityConfig",
    "CapacityTarget",
    "ClusterSnapshot",
    "DispatchDecision",
    "InstanceView",
    "OffloadController",
    "PoolOffer",
    "QueueView",
    "ReapDecision",
    "ReaperConfig",
    "RunningSample",
    "StealConfig",
    "StealDecision",
    "StepTiming",
    "StepView",
    "active",
    "dispatch",
    "effective_throughput",
    "eligible",
    "plan_capacity",
    "priority",
    "reap",
    "steal",
]
