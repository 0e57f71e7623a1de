"""The current-step protocol between the controller and the rollout workers (docs/ARCHITECTURE.md §4).

``current_step_key(run_id)`` (``rlb:{<run_id>}:current_step``, `infra.keyspace`) is a hash with
fields ``step`` and ``version``: the step whose samples instances should generate and the policy
version they are enqueued for. The controller writes it with `set_current_step` (monotonic in the
step) after `TokenLog.enqueue_step`; workers read it with `current_step` every `poll_ms`.
"""

from __future__ import annotations

import redis

from infra.keyspace import current_step_key

_SET_STEP = """
local cur = redis.call('HGET', KEYS[1], 'step')
if cur and tonumber(cur) > tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'step', ARGV[1], 'version', ARGV[2])
return 1
"""


def set_current_step(client: redis.Redis, run_id: str, step: int, version: int) -> bool:
    """Publish the step instances should work on and its policy version (atomic). Monotonic:
    False (nothing changes) if a later step is already current, e.g. from a newer controller."""
    if step < 0 or version < 0:
        raise ValueError(f"step and version must be >= 0, got step={step} version={version}")
    script = client.register_script(_SET_STEP)
    return bool(script(keys=[current_step_key(run_id)], args=[step, version]))


def current_step(client: redis.Redis, run_id: str) -> tuple[int, int] | None:
    """(step, version) instances should work on, or None when there is none."""
    step, version = client.hmget(current_step_key(run_id), "step", "version")
    if step is None or version is None:
        return None
    return int(step), int(version)
