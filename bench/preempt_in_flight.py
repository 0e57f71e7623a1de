"""Preemptions that land inside samples, for the benches: a thread that has the provider preempt a
spot instance of a fabric as soon as it holds a sample of one step with logged tokens (the
provider's own preemption: a replacement starts at once), so that on any machine, however fast
its rollout, the preempted samples continue elsewhere from their logged tokens."""

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

    def run(self) -> None:
        while not self.stop.is_set() and self.done < self.count:
            live = [r.instance_id for r in self.fabric.provider.instances(live_only=True) if r.pool == "spot"]
            running = self.fabric.log.step_leases(self.step, live).running if live else {}
            for instance in live:
                if any(lease.logged > 0 for lease in running.get(instance, [])):
                    self.fabric.provider.terminate(instance, self.kinds[self.done % len(self.kinds)])
                    self.done += 1
                    self.stop.wait(self.gap_s)  # what it held finishes elsewhere before the next
                    break
            self.stop.wait(self.poll_s)
