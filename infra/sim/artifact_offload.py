"""The RLBoost artifact's own offload rule, for the simulator's `paper` variant: a model of the
paper's system, re-expressed from its published source (github.com/Terra-Flux/PolyRL, branch
`artifact`: rollout-manager/src/balance.rs and handlers.rs). It is not one of this project's
policies (those live in `infra.rollout.policies` and drive every other variant).

`ArtifactOffload` has `OffloadController`'s interface (`t_local`, `should_release`, `update`):
- a fixed local budget `gen_s`: the reserved engines generate beside the spot ones until it is
  spent, even when every sample was done earlier, and only then does the trainer train;
- after each step `gen_s` moves by a third of the bubble difference (trainer's against rollout's),
  never below `floor_s`, in whole seconds as the artifact's integers;
- on a change of the spot count it jumps to the budget remembered for the new count (at first the
  artifact's profiled Qwen3-8B budgets), folding the last count's peak in (`COUNT_CHANGE_WEIGHT`);
  while the count is steady the peak is folded in (`STALL_WEIGHT`) whenever throughput stops growing;
- a step without spot instances teaches it nothing (the artifact cannot run one).
The artifact's rule, sourced: docs/CALIBRATION.md; its place in the simulator: docs/internals.md §11.
"""

from __future__ import annotations

from infra.rollout.policies import StepTiming
from infra.sim.scenario import PaperOffloadSection

STALL_WEIGHT = 0.8
"""Weight of the peak budget folded into the memory when throughput stops growing (balance.rs ALPHA)."""
COUNT_CHANGE_WEIGHT = 0.2
"""Weight of the last count's peak folded into its memory when the count changes (balance.rs BETA)."""


class ArtifactOffload:
    """The artifact's local generation budget `gen_s`, with the interface the simulator calls on
    `OffloadController` (`t_local`, `should_release`, `update`); the simulator holds the reserved
    cluster's training to the budget (`VariantSpec.offload`)."""

    def __init__(self, section: PaperOffloadSection) -> None:
        """The rule of the scenario's `paper_offload` section."""
        self.gen_s = section.initial_s
        self.floor_s = section.floor_s
        self.best: dict[int, int] = dict(section.budgets_s)
        """Remembered budget per spot count."""
        self.peak_s = 0
        """Budget of the last step whose throughput grew (the peak for the current count)."""
        self.last_count = 0
        self.last_throughput = 0

    def t_local(self, num_spot: int) -> float:
        return float(self.gen_s)

    def should_release(self, now: float, step_started_at: float, num_spot_alive: int) -> bool:
        return num_spot_alive > 0 and now - step_started_at >= self.gen_s

    def update(self, timing: StepTiming) -> float:
        """Learn from a finished step as the artifact's `adjust_local_instances_gen_s` does; returns
        the budget of the next step."""
        count = timing.num_spot
        if count == 0:
            return float(self.gen_s)
        throughput = int(timing.throughput)
        if count != self.last_count:
            self.last_throughput = 0
            self._fold(self.last_count, COUNT_CHANGE_WEIGHT)
            if count in self.best:
                self.last_count = count
                self.gen_s = self.peak_s = self.best[count]
                return float(self.gen_s)
        else:
            if throughput <= self.last_throughput:
                self._fold(count, STALL_WEIGHT)
            else:
                self.peak_s = self.gen_s
            self.last_throughput = throughput
        rollout_bubble, trainer_bubble = int(timing.rollout_idle_s), int(timing.trainer_idle_s)
        if trainer_bubble < rollout_bubble:
            self.gen_s = max(self.floor_s, self.gen_s - (rollout_bubble - trainer_bubble) // 3)
        else:
            self.gen_s += (trainer_bubble - rollout_bubble) // 3
        self.last_count = count
        return float(self.gen_s)

    def _fold(self, count: int, weight: float) -> None:
        """Fold the peak budget into the memory for `count` (an EMA), or store it if there is none."""
        previous = self.best.get(count)
        self.best[count] = self.peak_s if previous is None else round((1 - weight) * previous + weight * self.peak_s)
