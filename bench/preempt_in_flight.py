"""Preemptions that land inside samples, for the benches: a thread that has the provider preempt a
spot instance of a fabric as soon as it holds a sample of one step with tokens it logged itself
(the provider's own preemption: a replacement starts at once), so that on any machine, however
fast its rollout, the preempted samples continue elsewhere from their logged tokens. A replacement
that resumes its predecessor's samples is preempted only once it has advanced them, so the
preemptions spread over the step's samples instead of hitting the same ones again."""

from __future__ import annotations

import threading
from typing import Any


class InFlightPreempter(threading.Thread):
    """Preempts `count` times, the kinds taken in turn from `kinds` (`preempted`: SIGTERM with the
    pool's notice; `preempted_silent`: SIGKILL), waiting `gap_s` after each preemption."""

    def __init__(
        self, fabric: Any, step: int, count: int, kinds: tuple[str, ...], gap_s: float = 0.0, poll_s: float = 0.01
    ) -> None:
        super().__init__(daemon=True)
        self.fabric, self.step, self.count, self.kinds = fabric, step, count, kinds
        self.gap_s, self.poll_s = gap_s, poll_s
        self.done = 0
        self.stop = threading.Event()
        self._claimed_at: dict[tuple[str, str], int] = {}
        """(instance, sample) -> the sample's logged tokens when the instance was first seen holding it."""

    def run(self) -> None:
        while not self.stop.is_set() and self.done < self.count:
            live = [r.instance_id for r in self.fabric.provider.instances(live_only=True) if r.pool == "spot"]
            running = self.fabric.log.step_leases(self.step, live).running if live else {}
            for instance in live:
                leases = running.get(instance, [])
                seen = [self._claimed_at.setdefault((instance, lease.sample_id), lease.logged) for lease in leases]
                if any(lease.logged > at for lease, at in zip(leases, seen)):
                    self.fabric.provider.terminate(instance, self.kinds[self.done % len(self.kinds)])
                    self.done += 1
                    self.stop.wait(self.gap_s)  # what it held finishes elsewhere before the next
                    break
            self.stop.wait(self.poll_s)
