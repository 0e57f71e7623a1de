"""The current-step protocol between the controller and the rollout workers (docs/internals.md §4).

``current_step_key(run_id)`` (``rlb:{<run_id>}:current_step``, `infra.keyspace`) is a hash with
fields ``step``, ``version``, ``first`` and ``staleness``: the newest step whose samples instances
may generate, the policy version the step being rolled out trains from, the oldest step still
open (instances claim from ``first`` .. ``step``, oldest first) and the run's staleness bound K.
Strictly on-policy (K = 0) ``first == step`` and every token comes from ``version``; with K >= 1
instances generate with the newest version announced, pulling each one as it is published. The
controller writes it with `set_current_step` (monotonic in the step) after
`TokenLog.enqueue_step`; workers read it with `current_window` every `poll_ms`.
"""

from __future__ import annotations

from typing import NamedTuple

import redis

from infra.keyspace import current_step_key

_SET_STEP = """
local cur = redis.call('HGET', KEYS[1], 'step')
if cur and tonumber(cur) > tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'step', ARGV[1], 'version', ARGV[2], 'first', ARGV[3], 'staleness', ARGV[4])
return 1
"""


class StepWindow(NamedTuple):
    """What instances work on: steps `first` .. `step`, trained from `version` on, bound `staleness`."""

    step: int
    version: int
    first: int
    staleness: int

    @property
    def strict(self) -> bool:
        """Strictly on-policy (K = 0): every token comes from `version`."""
        return self.staleness == 0

    @property
    def steps(self) -> list[int]:
        """The open steps, oldest first (the order instances claim in)."""
        return list(range(self.first, self.step + 1))


def set_current_step(
    client: redis.Redis, run_id: str, step: int, version: int, first: int | None = None, staleness: int = 0
) -> bool:
    """Publish the newest step instances should work on, the policy version of the step in
    progress, the oldest open step (default `step`) and the staleness bound (atomic). Monotonic:
    False (nothing changes) if a later step is already current, e.g. from a newer controller."""
    first = step if first is None else first
    if step < 0 or version < 0 or not 0 <= first <= step or staleness < 0:
        raise ValueError(
            f"need 0 <= first <= step, version >= 0, staleness >= 0; got step={step} first={first} "
            f"version={version} staleness={staleness}"
        )
    script = client.register_script(_SET_STEP)
    return bool(script(keys=[current_step_key(run_id)], args=[step, version, first, staleness]))


def current_window(client: redis.Redis, run_id: str) -> StepWindow | None:
    """The steps instances should work on, or None when there is none."""
    step, version, first, staleness = client.hmget(current_step_key(run_id), "step", "version", "first", "staleness")
    if step is None or version is None:
        return None
    return StepWindow(int(step), int(version), int(first or step), int(staleness or 0))


def current_step(client: redis.Redis, run_id: str) -> tuple[int, int] | None:
    """(newest step, version) instances should work on, or None when there is none."""
    window = current_window(client, run_id)
    return None if window is None else (window.step, window.version)
