"""`GatedRedis`: a Redis client whose traffic a test can stop and restart, to play an instance that
is paused (a stopped process, a network partition) while the rest of the cluster goes on.

`freeze()` returns once no command of this client is in flight; from then on every command,
pipeline or script call of the client waits, unsent, until `thaw()`. What the instance does
meanwhile (its engine may still step) never reaches Redis, and what it sends after the thaw is
judged by Redis as it stands then, e.g. fenced off because the controller reaped its leases.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import redis


class _Gate:
    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._frozen = False
        self._in_flight = 0

    def call(self, send: Callable[[], Any]) -> Any:
        with self._condition:
            self._condition.wait_for(lambda: not self._frozen)
            self._in_flight += 1
        try:
            return send()
        finally:
            with self._condition:
                self._in_flight -= 1
                self._condition.notify_all()

    def freeze(self) -> None:
        with self._condition:
            self._frozen = True
            self._condition.wait_for(lambda: self._in_flight == 0)

    def thaw(self) -> None:
        with self._condition:
            self._frozen = False
            self._condition.notify_all()


class GatedRedis(redis.Redis):
    """`redis.Redis` with `freeze()` / `thaw()` (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = _Gate()

    def execute_command(self, *args: Any, **options: Any) -> Any:
        return self.gate.call(lambda: super(GatedRedis, self).execute_command(*args, **options))

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> redis.client.Pipeline:
        pipe = super().pipeline(transaction, shard_hint)
        execute = pipe.execute
        pipe.execute = lambda raise_on_error=True: self.gate.call(lambda: execute(raise_on_error))
        return pipe

    def freeze(self) -> None:
        self.gate.freeze()

    def thaw(self) -> None:
        self.gate.thaw()
