"""Pure controller policies (docs/internals.md §5): each reads a `ClusterSnapshot` or a few measured
numbers plus a clock value, and returns frozen decisions. No I/O: the Redis runtime and the
simulator drive the same objects.

Modules: `snapshot` (state types), `claims` (who may claim, and the token log's claim order),
`steal` (token-level load balancing), `reaper` (heartbeat eviction), `offload` (adaptive
`T_local`), `capacity` (spot pool targets within a budget), `marginal` (spot counts worth
their price). The simulator's model of many workers claiming at
once (`dispatch`) is the simulator's: `infra.sim.claiming`.
"""

from infra.rollout.policies.capacity import (
    CapacityConfig,
    CapacityTarget,
    PoolOffer,
    effective_throughput,
    plan_capacity,
)
from infra.rollout.policies.claims import active, claim_key, claim_score, eligible
from infra.rollout.policies.marginal import MarginalConfig, plan_marginal
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
    "InstanceView",
    "MarginalConfig",
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
    "claim_key",
    "claim_score",
    "effective_throughput",
    "eligible",
    "plan_capacity",
    "plan_marginal",
    "reap",
    "steal",
]
