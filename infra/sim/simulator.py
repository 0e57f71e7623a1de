"""One variant's run: RL steps on the reserved cluster and spot instances, event by event
(docs/internals.md §11; what it models and what it does not: docs/simulator.md).

`Simulation` drives the runtime's policies as `RolloutController` calls them: every `poll_s` it
builds a `ClusterSnapshot` and applies `reap`, `OffloadController.should_release` and `steal`, and
each step ends with `OffloadController.update(StepTiming(...))` (the `paper` variant runs
`infra.sim.artifact_offload` instead). Workers claim what `infra.sim.claiming.dispatch` hands them,
in the token log's order (`ClaimQueue`); a steal's samples wait for their receiver until
`StealConfig.route_s`. Migration modes (the variants): `token` (logged tokens kept), `group_min`
(a preempted group's samples keep as many as its shortest one), `restart` (nothing kept). Spot
instances follow the trace (`budget`) or `plan_marginal` (`marginal`); every weight pull's bytes
are counted for egress (with LoRA a version is the adapters'). A multi-turn trajectory
(`scenario.agentic`) keeps its slot and cached prefix on its engine through each tool call; one
that leaves its instance without its environment (`restart`, `paper`) starts over or replays.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Literal

from infra.availability.traces import TraceSchedule
from infra.rollout.policies import (
    CapacityConfig,
    ClusterSnapshot,
    InstanceView,
    MarginalConfig,
    OffloadController,
    PoolOffer,
    QueueView,
    ReaperConfig,
    RunningSample,
    StepTiming,
    StepView,
    plan_marginal,
    reap,
    steal,
)
from infra.sim.agentic import Trajectory, trajectories
from infra.sim.artifact_offload import ArtifactOffload
from infra.sim.availability import capacity_changes
from infra.sim.claiming import ClaimQueue, dispatch
from infra.sim.events import EventLoop
from infra.sim.hardware import DecodeModel, MeasuredDecode, pull_seconds, train_seconds
from infra.sim.scenario import Scenario, egress_price

Migration = Literal["token", "group_min", "restart"]
EPS = 1e-6


@dataclass(frozen=True)
class VariantSpec:
    """How one variant differs: its spot pool, migration, steal, weight senders, cluster size."""

    name: str
    use_spot: bool
    migration: Migration = "token"
    steal: bool = True
    swarm: bool = True
    offload: Literal["runtime", "artifact"] = "runtime"
    """`runtime`: this project's `OffloadController`; `artifact`: the RLBoost artifact's rule
    (`infra.sim.artifact_offload`: a fixed local budget, the reserved cluster trains only after it)."""
    reserved_gpus: int | None = None
    """None: the scenario's; the equal-cost variant buys more."""
    reserved_price_per_hour: float | None = None
    max_staleness: int | None = None
    """K of bounded staleness (`training.max_staleness`); None: the scenario's. The baselines
    (veRL alone, the artifact) run 0: strictly on-policy."""
    recompute_logprobs: bool = False
    """The trainer runs a separate no-grad forward to recompute the old log-probs (veRL, the
    artifact: `training.old_logprob_flops_per_param` of its FLOPs); this project's does not (one
    update per RL step: the proximal log-probs are the training forward's)."""
    train_first: bool = False
    """While spot instances are alive, the reserved GPUs train the step's complete groups before
    they generate: at the step's start they stay training while the step's remaining samples run on
    spot, and wake to generate (a `network.local_sync_s` pause) only once no complete group is
    left to train (then until `T_local` or the step's rollout is done, as without it). A model of
    a schedule the runtime's controller does not run (it generates first, up to `T_local`)."""
    capacity: Literal["budget", "marginal"] = "budget"
    """`budget`: hold every spot instance the trace allows (up to `spot.max_instances`);
    `marginal`: only as many as `plan_marginal` finds worth their price (the trace's capacity the
    ceiling), re-planned at every step's end and capacity change (needs `offload: runtime`)."""

    def __post_init__(self) -> None:
        if self.capacity == "marginal" and self.offload != "runtime":
            raise ValueError(f"{self.name}: marginal capacity reads the runtime offload controller's curve")


@dataclass
class Sample:
    sample_id: str
    group: int
    seq: int
    """Its enqueue seq in the step's queue (the token log's: a new one at every requeue)."""
    target: int
    """Response length it has when done (drawn once per step and seed)."""
    logged: float = 0.0
    generated_total: float = 0.0
    """Every token generated for it, those lost included."""
    owner: Engine | None = None
    epoch: int = 0
    base: float = 0.0
    start_progress: float = 0.0
    step: int = 0
    done: bool = False
    first_version: int | None = None
    """Policy version of the engine that generated its first token (every later one is newer)."""
    plan: Trajectory | None = None
    """Its turns and tool calls (a multi-turn trajectory); None: one response."""
    turn: int = 0
    """The turn it generates (or generates next), 0-based."""
    observed: int = 0
    """Tokens of the tool results in its context."""
    home: str | None = None
    """The instance that holds it through its tool call: its prefix cached there and, when its
    environment cannot move (`Simulation.pinned`), its environment."""
    cached: tuple[str, int | None, float] | None = None
    """(instance, policy version, context tokens) of its prefix in that instance's cache."""
    tool_pending: bool = False
    """Its tool call (or the replay of its tool calls) has not returned yet."""

    @property
    def goal(self) -> int:
        """Model tokens it has when the turn it generates ends (the whole response: `target`)."""
        return self.target if self.plan is None else self.plan.ends[self.turn]


@dataclass
class StepState:
    """One admitted step: its samples and their progress. With bounded staleness (`K >= 1`) up
    to `K + 1` are open at once: the step being trained and the `K` admitted after it."""

    step: int
    samples: list[Sample]
    groups: dict[int, list[int]]
    """Group -> [group, samples not done]."""
    group_samples: list[list[Sample]]
    admitted_at: float
    done: int = 0
    groups_done: int = 0
    ready_groups: list[int] = field(default_factory=list)
    """Complete groups not yet trained, in completion order."""
    all_done_at: float | None = None


@dataclass
class Engine:
    instance_id: str
    capacity_class: Literal["reserved", "spot"]
    decode: DecodeModel
    slots: int
    price_per_hour: float
    launched_at: float
    policy_version: int | None = None
    registered: bool = False
    killed_at: float | None = None
    """Silent kill time: no progress, no heartbeat after it."""
    ended_at: float | None = None
    """When billing stopped."""
    running: dict[str, Sample] = field(default_factory=dict)
    progress: float = 0.0
    context0: float = 0.0
    stall_until: float = 0.0
    clock_at: float = 0.0
    busy_s: float = 0.0
    finish_heap: list[tuple[float, int, str]] = field(default_factory=list)
    token: int = 0
    steal_requested_at: float | None = None
    claim_after: float = 0.0
    """End of its claim hold-off after a steal release."""
    view_cache: tuple[RunningSample, ...] | None = None
    holding: dict[str, Sample] = field(default_factory=dict)
    """Trajectories in a tool call: not decoding, their slots and cached prefixes held."""

    @property
    def generating_alive(self) -> bool:
        return self.registered and self.killed_at is None

    @property
    def free_slots(self) -> int:
        return self.slots - len(self.running) - len(self.holding)


@dataclass(frozen=True)
class StepRecord:
    step: int
    started_at: float
    ended_at: float
    trained_tokens: float
    t_local_s: float | None
    num_spot: int
    trainer_idle_s: float
    rollout_idle_s: float
    rollout_s: float
    """From the step's start to its last sample done."""
    train_s: float
    """Seconds the reserved cluster spent training the step's groups."""
    admitted_at: float | None = None
    """When its prompts were admitted (the step's start when strictly on-policy; up to `K`
    steps earlier with bounded staleness)."""
    oldest_version: int | None = None
    """Oldest policy version any of its tokens came from (`>= step - K`)."""


@dataclass
class RunResult:
    """What one variant's run measured."""

    variant: str
    steps: list[StepRecord]
    spot_intervals: list[tuple[float, float]]
    """Billed (launch, end) of every spot instance."""
    spot_busy_s: float
    instance_counts: list[tuple[float, int]]
    """(time, spot instances registered and alive) at every change."""
    reserved_gpus: int
    reserved_price_per_hour: float
    spot_price_per_hour: float
    generated_tokens: float
    wasted_tokens: float
    trained_response_tokens: float
    samples_done: int
    samples_total: int
    preemptions: int
    silent_kills: int
    open_samples: int = 0
    """Samples of steps admitted but not trained when the run ended (bounded staleness), left
    out of `samples_done` and `samples_total`."""
    open_tokens: float = 0.0
    """Logged tokens of those samples: generated, neither trained nor wasted."""
    max_staleness: int = 0
    pulls: list[tuple[float, float]] = field(default_factory=list)
    """(time, bytes) of every spot instance's weight pull."""
    egress_usd_per_gb: float = 0.0
    """What a GB of those pulls costs (the trainer's region to the spot pool's)."""
    tool_calls: int = 0
    """Tool calls a trajectory's turn ended with (a restarted trajectory's again), replays apart."""
    replayed_tool_calls: int = 0
    """Tool calls run again to rebuild an environment that could not move with its trajectory."""
    prefill_tokens: float = 0.0
    """Tokens prefilled on claims (prompts, resumed samples, tool results; not version re-prefills)."""
    reserved_busy_s: float = 0.0
    """Seconds the reserved engines held running samples (their generating time)."""


def decode_model(scenario: Scenario, section: Literal["reserved", "spot"], gpus: int, max_running: int) -> DecodeModel:
    """One engine of `section`'s kind: the GPU roofline, or the scenario's measured profile."""
    d, measured = scenario.decode, scenario.measured
    model = scenario.model.shape()
    args = (scenario.gpu(section), model, gpus, d.eta, d.memory_utilization, max_running, d.prefill_mfu)
    if measured is None:
        return DecodeModel(*args, d.allreduce_latency_us * 1e-6, d.allreduce_efficiency)
    return MeasuredDecode(
        *args,
        step_s=measured.decode_step_s,
        per_context_token_s=measured.decode_s_per_context_token,
        prefill_per_token_s=measured.prefill_s_per_token,
        slowdown=measured.slowdown,
    )


def response_lengths(scenario: Scenario, step: int) -> list[int]:
    """The response lengths of `step`'s samples, group by group (drawn once per step and seed:
    the same in every variant)."""
    w = scenario.workload
    rng = random.Random(f"{scenario.seed}/lengths/{step}")
    sigma2 = math.log(1 + w.response_cv**2)
    mu = math.log(w.mean_response_tokens) - sigma2 / 2
    return [
        max(1, min(w.max_response_tokens, round(rng.lognormvariate(mu, math.sqrt(sigma2)))))
        for _ in range(w.prompts_per_step * w.samples_per_prompt)
    ]


def cluster_train_seconds(scenario: Scenario, tokens: float, gpus: int, recompute_logprobs: bool) -> float:
    """Time for the reserved cluster of `gpus` GPUs to train on `tokens` tokens: the measured
    profile's time per token (it times the runtime's own trainer, which does not recompute, LoRA
    or not as it was configured), or the FLOPs model (`Scenario.train_flops_per_param`: less the
    old-log-prob forward where the trainer does not run it, less the base weights' gradients
    with LoRA)."""
    measured = scenario.measured
    if measured is not None:
        return tokens * measured.train_s_per_token * measured.slowdown
    flops = scenario.train_flops_per_param(recompute_logprobs)
    return train_seconds(tokens, scenario.model.shape(), scenario.gpu("reserved"), gpus, flops, scenario.training.mfu)


class Simulation:
    """Simulates `scenario` for one variant over the spot `schedule`."""

    def __init__(
        self, scenario: Scenario, variant: VariantSpec, schedule: TraceSchedule, prices: tuple[float, float]
    ) -> None:
        self.s = scenario
        self.v = variant
        self.schedule = schedule
        self.reserved_price = variant.reserved_price_per_hour or prices[0]
        self.spot_price = prices[1]
        self.egress_usd_per_gb = egress_price(scenario)
        self.available = 0
        """Spot instances the trace allows now."""
        self.pulls: list[tuple[float, float]] = []
        self.step_counts: set[int] = set()
        """Spot instance counts registered at some time during the current step."""
        self.loop = EventLoop()
        self.config = scenario.controller
        self.offload: OffloadController | ArtifactOffload = (
            self.config.offload.new_controller()
            if variant.offload == "runtime"
            else ArtifactOffload(scenario.paper_offload)
        )
        self.reaper = ReaperConfig(self.config.reap_timeout_s)
        self.rng = random.Random(f"{scenario.seed}/preemptions")
        self.version_bytes = scenario.model.version_bytes()
        """Bytes of one published version: the whole weights, or the adapters with LoRA."""
        self.first_pull_bytes = scenario.model.first_pull_bytes()
        """Bytes a booted spot instance pulls first (with LoRA the base, then the adapters)."""
        self.mean_context = scenario.mean_context()
        agentic = scenario.agentic
        self.budget = scenario.workload.max_response_tokens if agentic is None else agentic.max_context_tokens
        """What a running sample's `RunningSample.budget` shows the controller."""
        self.reserved_gpus = variant.reserved_gpus or scenario.reserved.gpus
        self.pinned = agentic is not None and (variant.migration != "token" or agentic.environment == "replay")
        """A trajectory's environment lives on its instance: if it leaves that instance it starts
        over (`restart`) or replays its tool calls elsewhere (`paper`, `agentic.environment: replay`)."""
        self.in_tool: dict[str, Sample] = {}
        """Trajectories in a tool call (or replaying them), not on any engine or queue."""
        self.tool_calls = 0
        self.replayed_tool_calls = 0
        self.prefill_tokens = 0.0
        self.engines: list[Engine] = []
        for i in range(self.reserved_gpus // scenario.reserved.engine_gpus):
            model = self._decode("reserved", scenario.reserved.engine_gpus, scenario.reserved.max_running)
            self.engines.append(
                Engine(f"reserved-{i}", "reserved", model, model.slots(self.mean_context), 0.0, 0.0, policy_version=0)
            )
            self.engines[-1].registered = True
        self.engine_of = {e.instance_id: e for e in self.engines}
        self.spot_seq = 0
        self.steps: list[StepRecord] = []
        self.instance_counts: list[tuple[float, int]] = [(0.0, 0)]
        self.generated = 0.0
        self.wasted = 0.0
        self.trained_response = 0.0
        self.samples_done = 0
        self.samples_total = 0
        self.preemptions = 0
        self.silent_kills = 0
        self.step = -1
        """The step being trained (the trainer's cycle): version `step` is the newest published."""
        self.finished = False
        self.claim_pending = False
        self.k = variant.max_staleness if variant.max_staleness is not None else scenario.training.max_staleness
        self.open: dict[int, StepState] = {}
        """Admitted steps not yet trained, by step."""
        self.admitted = -1
        self.by_id: dict[str, Sample] = {}
        self.queue = ClaimQueue()
        """The token log's queues over every open step, in its claim order."""
        self.routed: list[tuple[str, float, str]] = []
        """Stolen samples waiting for their receiver: (receiver, until, sample id)."""
        self.unfinished = 0
        """Samples of open steps not done: with none, the rollout fleet has no work."""
        self.idle_since: float | None = None
        self.cycle_idle = 0.0
        self.training = False
        """The reserved GPUs train the current step before `T_local` because its rollout is
        done (bounded staleness: they may hold samples of later steps, which they release)."""
        self.leading = False
        """`train_first`: the reserved GPUs train the step's complete groups before they generate."""
        self.generating_since = 0.0
        """When the reserved engines started generating this step (`T_local` counts from it)."""

    # --- setup -----------------------------------------------------------------------------------

    def _decode(self, section: Literal["reserved", "spot"], gpus: int, max_running: int) -> DecodeModel:
        return decode_model(self.s, section, gpus, max_running)

    def _train_seconds(self, tokens: float) -> float:
        return cluster_train_seconds(self.s, tokens, self.reserved_gpus, self.v.recompute_logprobs)

    def run(self) -> RunResult:
        if self.v.use_spot and self.s.spot.max_instances > 0:
            self._set_capacity(self.schedule.capacity_at(0.0))
            for change in capacity_changes(self.schedule, self.s.run.duration_s):
                self.loop.at(change.t, lambda c=change.capacity: self._set_capacity(c))
        self._start_step()
        self.loop.at(self.config.poll_s, self._poll)
        self.loop.run(until=lambda: self.finished)
        end = self.loop.now
        for engine in self.engines:
            if engine.capacity_class == "spot" and engine.ended_at is None:
                self._advance(engine, end)
                engine.ended_at = end
        spot = [e for e in self.engines if e.capacity_class == "spot"]
        open_samples = [sample for state in self.open.values() for sample in state.samples]
        done = [sample for sample in open_samples if sample.done]
        return RunResult(
            variant=self.v.name,
            steps=self.steps,
            spot_intervals=[(e.launched_at, e.ended_at or end) for e in spot],
            spot_busy_s=sum(e.busy_s for e in spot),
            instance_counts=self.instance_counts,
            reserved_gpus=self.reserved_gpus,
            reserved_price_per_hour=self.reserved_price,
            spot_price_per_hour=self.spot_price,
            generated_tokens=self.generated,
            wasted_tokens=self.wasted,
            trained_response_tokens=self.trained_response - sum(sample.target for sample in done),
            samples_done=self.samples_done - len(done),
            samples_total=self.samples_total - len(open_samples),
            preemptions=self.preemptions,
            silent_kills=self.silent_kills,
            open_samples=len(open_samples),
            open_tokens=sum(sample.logged for sample in open_samples),
            max_staleness=self.k,
            pulls=self.pulls,
            egress_usd_per_gb=self.egress_usd_per_gb,
            tool_calls=self.tool_calls,
            replayed_tool_calls=self.replayed_tool_calls,
            prefill_tokens=self.prefill_tokens,
            reserved_busy_s=sum(e.busy_s for e in self.engines if e.capacity_class == "reserved"),
        )

    # --- engines: decode by the roofline ---------------------------------------------------------

    def _advance(self, engine: Engine, now: float) -> None:
        """Bring `engine`'s progress to `now` (to its kill time once silently killed)."""
        until = now if engine.killed_at is None else min(now, engine.killed_at)
        if until <= engine.clock_at:
            return
        n = len(engine.running)
        if n:
            engine.busy_s += until - engine.clock_at
            decoding = until - max(engine.clock_at, engine.stall_until)
            if decoding > 0:
                context = engine.context0 + n * engine.progress
                engine.progress += engine.decode.tokens_in(n, context, decoding)
        engine.clock_at = until

    def _generated(self, engine: Engine, sample: Sample) -> float:
        return min(sample.goal, sample.base + engine.progress - sample.start_progress)

    def _context(self, sample: Sample) -> int:
        """Tokens of its context before its generated ones: the prompt and the tool results."""
        return self.s.workload.prompt_tokens + sample.observed

    def _reschedule(self, engine: Engine) -> None:
        """Schedule `engine`'s next sample completion (an older schedule goes stale)."""
        engine.token += 1
        heap = engine.finish_heap
        while heap and not self._current(engine, heap[0]):
            heapq.heappop(heap)
        if not heap or engine.killed_at is not None:
            return
        n = len(engine.running)
        start = max(self.loop.now, engine.stall_until)
        tokens = max(0.0, heap[0][0] - engine.progress)
        delay = engine.decode.seconds_to_advance(n, engine.context0 + n * engine.progress, tokens)
        token = engine.token
        self.loop.at(start + delay, lambda: self._complete(engine, token))

    def _current(self, engine: Engine, entry: tuple[float, int, str]) -> bool:
        sample = engine.running.get(entry[2])
        return sample is not None and sample.epoch == entry[1]

    def _claim(self, engine: Engine, sample: Sample) -> None:
        now = self.loop.now
        self._advance(engine, now)
        sample.owner, sample.epoch = engine, sample.epoch + 1
        if sample.first_version is None:
            sample.first_version = engine.policy_version
        sample.base, sample.start_progress = sample.logged, engine.progress
        engine.running[sample.sample_id] = sample
        engine.context0 += self._context(sample) + sample.base - engine.progress
        finish = engine.progress + sample.goal - sample.base
        heapq.heappush(engine.finish_heap, (finish, sample.epoch, sample.sample_id))
        tokens = self._context(sample) + sample.base
        cached = sample.cached
        if cached is not None and cached[0] == engine.instance_id and cached[1] == engine.policy_version:
            tokens -= cached[2]  # the prefix cache holds its history: only the new tool result
        self.prefill_tokens += tokens
        prefill = engine.decode.prefill_seconds(tokens)
        engine.stall_until = max(engine.stall_until, now) + prefill
        engine.view_cache = None

    def _remove(self, engine: Engine, sample: Sample) -> float:
        """Take `sample` off `engine`; returns its generated tokens (all counted as generated)."""
        self._advance(engine, self.loop.now)
        generated = self._generated(engine, sample)
        del engine.running[sample.sample_id]
        engine.context0 -= self._context(sample) + sample.base - sample.start_progress
        if not engine.running:
            engine.context0, engine.progress = 0.0, 0.0
            engine.finish_heap.clear()
        new = generated - sample.base
        sample.generated_total += new
        self.generated += new
        sample.owner = None
        engine.view_cache = None
        return generated

    def _complete(self, engine: Engine, token: int) -> None:
        if token != engine.token:
            return
        self._advance(engine, self.loop.now)
        heap = engine.finish_heap
        finished = []
        while heap and (not self._current(engine, heap[0]) or heap[0][0] <= engine.progress + EPS):
            entry = heapq.heappop(heap)
            if self._current(engine, entry):
                finished.append(engine.running[entry[2]])
        ended = [sample for sample in finished if sample.goal < sample.target]
        for sample in ended:
            self._end_turn(engine, sample)
        finished = [sample for sample in finished if sample.goal == sample.target]
        for sample in finished:
            self._remove(engine, sample)
            sample.logged = sample.target
            sample.done = True
            self.trained_response += sample.target
            self.samples_done += 1
            state = self.open[sample.step]
            state.done += 1
            self.unfinished -= 1
            group = state.groups[sample.group]
            group[1] -= 1
            if group[1] == 0:
                state.ready_groups.append(sample.group)
                state.groups_done += 1
            if state.done == len(state.samples):
                state.all_done_at = self.loop.now
        self._reschedule(engine)
        if finished and self.unfinished == 0:
            self.idle_since = self.loop.now
        self._soon_claim()
        self._train_next()

    def _release(
        self,
        engine: Engine,
        sample: Sample,
        how: Literal["flushed", "silent"],
        to: str | None = None,
        defer: bool = False,
    ) -> None:
        """Hand `sample` back to the queue with what the migration mode keeps (routed to
        instance `to`, as the token log routes a steal, if given; with `defer` the caller queues it)."""
        generated = self._remove(engine, sample)
        if self.v.migration == "restart":
            kept = 0.0
        elif how == "silent":
            running = len(engine.running) + 1
            context = engine.context0 + len(engine.running) * engine.progress + generated
            rate = 1.0 / engine.decode.step_seconds(running, context)
            unflushed = min(generated % self.s.token_log.flush_tokens, rate * self.s.token_log.flush_ms / 1000)
            kept = max(sample.base, generated - unflushed)
        else:
            kept = generated
        self.wasted += generated - kept
        sample.logged = kept
        sample.seq = self.queue.next_seq(sample.step)
        if defer:
            return
        if to is None:
            self._enqueue(sample)
        else:
            until = self.loop.now + self.config.steal.route_s
            self.routed.append((to, until, sample.sample_id))
            self.loop.at(until, self._soon_claim)

    def _enqueue(self, sample: Sample, routed: bool = False) -> None:
        self.queue.push(sample.sample_id, sample.step, sample.seq, int(sample.logged), routed=routed)

    def _evict_all(self, engine: Engine, how: Literal["flushed", "silent"], preempted: bool) -> None:
        """Release every sample of `engine`; on a preemption in `group_min` mode, truncate each
        group's released samples to the shortest of them."""
        samples = list(engine.running.values())
        for sample in samples:
            self._release(engine, sample, how, defer=self.pinned)
        samples += self._let_go(engine)  # trajectories in a tool call; pinned ones lose their environment
        if preempted and self.v.migration == "group_min":
            shortest: dict[int, float] = {}
            for sample in samples:
                shortest[sample.group] = min(shortest.get(sample.group, math.inf), sample.logged)
            for sample in samples:
                cut = shortest[sample.group]
                self.wasted += sample.logged - cut
                sample.logged = cut
            self.queue.rescore(lambda sid: int(self.by_id[sid].logged))
        if self.pinned:
            for sample in samples:
                self._rewind(sample)
        self._reschedule(engine)

    # --- trajectories: turns and tool calls ------------------------------------------------------

    def _end_turn(self, engine: Engine, sample: Sample) -> None:
        """A turn of a trajectory ends: it stops decoding but stays on the engine, its slot and
        its prefix in the cache held (`agentic.kv_reuse`), while its tool call runs."""
        assert sample.plan is not None and self.s.agentic is not None
        self._remove(engine, sample)
        sample.logged = sample.goal
        sample.home = engine.instance_id
        if self.s.agentic.kv_reuse:
            sample.cached = (engine.instance_id, engine.policy_version, self._context(sample) + sample.logged)
        engine.holding[sample.sample_id] = sample
        engine.view_cache = None
        self.tool_calls += 1
        self._start_tools(sample, sample.plan.tool_s[sample.turn])

    def _start_tools(self, sample: Sample, seconds: float) -> None:
        """`sample` waits `seconds` for its tool call (or the replay of its tool calls)."""
        sample.tool_pending = True
        epoch = sample.epoch
        self.loop.after(seconds, lambda: self._tools_done(sample, epoch))

    def _tools_done(self, sample: Sample, epoch: int) -> None:
        """The tool call returned (or the replay ended): the result joins the context and the
        next turn decodes on the engine that holds the trajectory (once the reaper has released
        it, if that engine died silently) or, released meanwhile, on whichever claims it."""
        if epoch != sample.epoch or self.finished:
            return  # it started over meanwhile
        assert sample.plan is not None
        sample.tool_pending = False
        if sample.logged == sample.goal:  # a turn ended (not a replay, which resumes within a turn)
            sample.observed += sample.plan.observation_tokens[sample.turn]
            sample.turn += 1
        engine = self.engine_of.get(sample.home) if sample.home is not None else None
        if engine is not None and sample.sample_id in engine.holding:
            if engine.killed_at is None:
                del engine.holding[sample.sample_id]
                self._claim(engine, sample)
                self._reschedule(engine)
            return
        del self.in_tool[sample.sample_id]
        sample.seq = self.queue.next_seq(sample.step)
        self._enqueue(sample)
        self._soon_claim()

    def _let_go(self, engine: Engine) -> list[Sample]:
        """Release the trajectories `engine` holds in a tool call: this project's wait for their
        tool (an environment server keeps running it) then join the queue; pinned ones (their
        environment lived on `engine`) are returned to lose it, their pending events gone stale."""
        held = list(engine.holding.values())
        engine.holding.clear()
        engine.view_cache = None
        for sample in held:
            sample.home = sample.cached = None
            if self.pinned:
                sample.epoch += 1
            elif sample.tool_pending:
                self.in_tool[sample.sample_id] = sample
            else:
                sample.seq = self.queue.next_seq(sample.step)
                self._enqueue(sample)
        return held if self.pinned else []

    def _rewind(self, sample: Sample) -> None:
        """A pinned trajectory lost its environment: `restart` starts it over from turn 0;
        otherwise it keeps its logged tokens and a new instance replays the tool calls of its
        completed turns before it continues."""
        assert sample.plan is not None
        if self.v.migration == "restart" and sample.logged:
            self.wasted += sample.logged
            sample.logged = 0.0
        ends = sample.plan.ends
        turn = 0
        while turn < len(ends) - 1 and ends[turn] <= sample.logged:
            turn += 1
        sample.turn, sample.observed = turn, sample.plan.observed_before(turn)
        sample.home = sample.cached = None
        sample.seq = self.queue.next_seq(sample.step)
        replay = sample.plan.tools_before(turn)
        if replay > 0:
            self.replayed_tool_calls += turn
            sample.epoch += 1
            self.in_tool[sample.sample_id] = sample
            self._start_tools(sample, replay)
        else:
            self._enqueue(sample)

    # --- steps -----------------------------------------------------------------------------------

    def _start_step(self) -> None:
        """Start the trainer's next step: version `step` is published (every engine loads it) and
        the prompts of step `step + K` are admitted (strictly on-policy, `K = 0`: the step's own)."""
        self.step += 1
        version = self.step
        self.started_at = self.loop.now
        self.step_counts = {self.instance_counts[-1][1]}
        self.cycle_idle = 0.0
        last = self.step + self.k
        if self.s.run.max_steps is not None:
            last = min(last, self.s.run.max_steps - 1)
        while self.admitted < last:
            self._admit(self.admitted + 1)
        self.cur = self.open[self.step]
        self.released_at: float | None = None
        self.released = False
        self.training = False
        self.told: set[str] = set()
        self.release_t_local: float | None = None
        self.release_num_spot = 0
        self.trainer_busy: list[tuple[float, float]] = []
        self.trainer_until: float | None = None
        self.trained_at: float | None = None
        """When every group was trained: the step ends `training.step_overhead_s` later."""
        self.version = version
        self.leading = (
            self.v.train_first
            and bool(self.cur.ready_groups)
            and self._spot_registered()
            and not any(self.by_id[sid].step == self.step for sid in self.queue)
        )
        self.generating_since = self.started_at
        if not self.leading:
            self._wake_reserved()
        pullers = [e for e in self.engines if e.capacity_class == "spot" and e.generating_alive]
        self._pull(pullers, peers=0, fresh=False)
        self._soon_claim()
        if self.leading:
            self._train_next()

    def _wake_reserved(self) -> None:
        """The reserved engines load the current version (`network.local_sync_s`) to generate."""
        version = self.version
        for engine in self.engines:
            if engine.capacity_class == "reserved":
                self._hold(engine, self.s.network.local_sync_s)
                engine.policy_version = None
                self.loop.after(self.s.network.local_sync_s, lambda e=engine: self._loaded(e, version))

    def _admit(self, step: int) -> None:
        """Admit `step`'s prompts: its samples join the token log's queue behind the older steps'."""
        self.admitted = step
        w = self.s.workload
        samples: list[Sample] = []
        if self.s.agentic is None:
            drawn: list[tuple[int, Trajectory | None]] = [(n, None) for n in response_lengths(self.s, step)]
        else:
            drawn = [(plan.model_tokens, plan) for plan in trajectories(self.s, step)]
        for target, plan in drawn:
            g, i = divmod(len(samples), w.samples_per_prompt)
            samples.append(Sample(f"{step}/{g}/{i}", g, self.queue.next_seq(step), target, step=step, plan=plan))
        state = StepState(
            step=step,
            samples=samples,
            groups={g: [g, w.samples_per_prompt] for g in range(w.prompts_per_step)},
            group_samples=[
                samples[g * w.samples_per_prompt : (g + 1) * w.samples_per_prompt] for g in range(w.prompts_per_step)
            ],
            admitted_at=self.loop.now,
        )
        self.open[step] = state
        self.by_id.update((sample.sample_id, sample) for sample in samples)
        self.samples_total += len(samples)
        self.unfinished += len(samples)
        if self.idle_since is not None:
            self.cycle_idle += self.loop.now - max(self.idle_since, self.started_at)
            self.idle_since = None
        for sample in samples:
            self._enqueue(sample)

    def _hold(self, engine: Engine, seconds: float) -> None:
        """A new version reaches an engine that is generating (bounded staleness): its samples
        pause for the pull or load (`seconds`), then continue on the new weights once their
        tokens are prefilled again (`_loaded`)."""
        if not engine.running:
            return
        self._advance(engine, self.loop.now)
        engine.stall_until = max(engine.stall_until, self.loop.now) + seconds
        self._reschedule(engine)

    def _pull(self, pullers: list[Engine], peers: int, fresh: bool) -> None:
        """`pullers` load the current version: if `fresh` (just booted) the full weights (with
        LoRA the base once and the current adapters), else `network.weight_bytes_fraction` of a
        version's bytes (the whole weights, or the adapters with LoRA: an update of the version
        they hold)."""
        if not pullers:
            return
        n = self.s.network
        nbytes = self.first_pull_bytes if fresh else self.version_bytes * n.weight_bytes_fraction
        seconds = pull_seconds(nbytes, len(pullers), n.trainer_gbps, n.instance_gbps, self.v.swarm, peers)
        version = self.version
        for engine in pullers:
            self.pulls.append((self.loop.now, nbytes))
            self._hold(engine, seconds)
            engine.policy_version = None
            self.loop.after(seconds, lambda e=engine: self._loaded(e, version))

    def _loaded(self, engine: Engine, version: int) -> None:
        if version == self.version and engine.generating_alive:
            engine.policy_version = version
            if engine.running:  # partial rollout: the running samples' tokens are prefilled again
                now = self.loop.now
                self._advance(engine, now)
                tokens = sum(
                    self._context(sample) + self._generated(engine, sample) for sample in engine.running.values()
                )
                engine.stall_until = max(engine.stall_until, now) + engine.decode.prefill_seconds(tokens)
                self._reschedule(engine)
            self._soon_claim()

    def _train_next(self) -> None:
        """Train the next complete group when the reserved GPUs are free to train; end the step
        when every group is trained."""
        now = self.loop.now
        if self.trainer_until is not None:
            if now < self.trainer_until - EPS:
                return
            self.trainer_until = None
        cur = self.cur
        rollout_done = cur.done == len(cur.samples)
        if self.leading and not cur.ready_groups and not rollout_done and self.queue:
            self.leading = False  # nothing to train, and work the spot instances have no slot for
            self.generating_since = now
            self._wake_reserved()
            self._soon_claim()
        if not (self.released or rollout_done or self.leading or self.s.training.while_generating):
            return
        if self.v.offload == "artifact" and not self.released and self._spot_registered():
            return  # the artifact's fixed budget: its trainer starts once the budget is over
        if rollout_done and self.k and not (self.released or self.training or self.s.training.while_generating):
            # the step's rollout is done before `T_local`: the reserved GPUs train it now, and
            # release the samples of later steps they hold (as at `T_local`)
            self.training = True
            for engine in self.engines:
                if engine.capacity_class == "reserved" and engine.running:
                    self._evict_all(engine, "flushed", preempted=False)
        if not cur.ready_groups:
            if rollout_done and self.trained_at is None:
                self.trained_at = now
                self.loop.after(self.s.training.step_overhead_s, self._end_step)
            return
        groups = self._next_micro_batch()
        if not groups:
            return
        seconds = self._train_seconds(sum(self._trained_tokens(s) for g in groups for s in cur.group_samples[g]))
        self.trainer_until = now + seconds
        self.trainer_busy.append((now, now + seconds))
        self.loop.at(now + seconds, self._train_next)

    def _next_micro_batch(self) -> list[int]:
        """The complete groups to train next: the oldest one, or with `training.micro_batch_samples`
        the oldest ones once they fill a micro-batch (whatever is left once the rollout is done)."""
        size, cur = self.s.training.micro_batch_samples, self.cur
        if size is None:
            return [cur.ready_groups.pop(0)]
        ready = sum(len(cur.group_samples[g]) for g in cur.ready_groups)
        if ready < size and cur.done < len(cur.samples):
            return []
        groups, samples = [], 0
        while cur.ready_groups and samples < size:
            groups.append(cur.ready_groups.pop(0))
            samples += len(cur.group_samples[groups[-1]])
        return groups

    def _trained_tokens(self, sample: Sample) -> float:
        """Its tokens in the trained batch: the response (a trajectory's turns and tool results,
        the latter masked out of the loss but in the forward) and, if counted, the prompt."""
        observed = 0 if sample.plan is None else sum(sample.plan.observation_tokens)
        return sample.target + observed + (self.s.workload.prompt_tokens if self.s.training.count_prompt_tokens else 0)

    def _end_step(self) -> None:
        """Measure the step as `RolloutController._finish` does (up to its last group trained; the
        orchestrator's overhead after it is not the controller's), update `T_local`, start the next."""
        end = self.trained_at
        assert end is not None
        cur = self.cur
        all_done_at = cur.all_done_at if cur.all_done_at is not None else end
        # the rollout fleet's idle time: no sample of any open step left to generate (strictly
        # on-policy, from the step's last sample done to its end)
        idle = self.cycle_idle
        if self.idle_since is not None:
            idle += end - max(self.idle_since, self.started_at)
        rollout_idle = max(0.0, idle)
        trainer_idle = 0.0
        trained = sum(self._trained_tokens(s) for s in cur.samples)
        if self.released_at is not None:
            busy = sum(max(0.0, min(b, end) - max(a, self.released_at)) for a, b in self.trainer_busy)
            trainer_idle = max(0.0, end - self.released_at - busy)
            self.offload.update(
                StepTiming(
                    t_local_s=self.release_t_local or 0.0,
                    trainer_idle_s=trainer_idle,
                    rollout_idle_s=rollout_idle,
                    throughput=trained / max(end - self.started_at, 1e-9),
                    num_spot=self.release_num_spot,
                )
            )
        if len(self.step_counts) == 1 and isinstance(self.offload, OffloadController):
            self.offload.observe(next(iter(self.step_counts)), trained / max(end - self.started_at, 1e-9))
        self.steps.append(
            StepRecord(
                step=self.step,
                started_at=self.started_at,
                ended_at=self.loop.now,
                trained_tokens=trained,
                t_local_s=self.release_t_local,
                num_spot=self.release_num_spot,
                trainer_idle_s=trainer_idle,
                rollout_idle_s=rollout_idle,
                rollout_s=all_done_at - cur.admitted_at,
                train_s=sum(b - a for a, b in self.trainer_busy),
                admitted_at=cur.admitted_at,
                oldest_version=min((s.first_version for s in cur.samples if s.first_version is not None), default=None),
            )
        )
        del self.open[self.step]
        self.queue.forget_step(self.step)
        for sample in cur.samples:
            del self.by_id[sample.sample_id]
        max_steps = self.s.run.max_steps
        if self.loop.now >= self.s.run.duration_s or (max_steps is not None and len(self.steps) >= max_steps):
            self.finished = True
            return
        if self.v.capacity == "marginal" and self.v.use_spot and self.s.spot.max_instances > 0:
            self._fit_spot()
        self._start_step()

    # --- the controller and the workers ----------------------------------------------------------

    def _views(self, claiming: bool = False) -> tuple[InstanceView, ...]:
        """The registered engines as the registry shows them. Running samples' token counts are
        refreshed only where a policy reads them (`steal`, with the queue empty and a free slot);
        with `claiming` (the snapshot `dispatch` reads), an engine in its steal hold-off shows no
        free slot (its heartbeat reports 0 while it does not claim)."""
        now = self.loop.now
        budget = self.budget
        counts_read = (
            self.v.steal
            and not claiming
            and not self.queue
            and not self.routed
            and any(e.registered and e.free_slots > 0 for e in self.engines)
        )
        views = []
        for engine in self.engines:
            if not engine.registered:
                continue
            if engine.view_cache is None or counts_read:
                self._advance(engine, now)
                progress = engine.progress
                engine.view_cache = tuple(
                    RunningSample(sid, int(min(x.target, x.base + progress - x.start_progress)), budget)
                    for sid, x in sorted(engine.running.items())
                )
            holding_off = claiming and now < engine.claim_after
            views.append(
                InstanceView(
                    instance_id=engine.instance_id,
                    pool=engine.capacity_class,
                    capacity_class=engine.capacity_class,
                    policy_version=engine.policy_version,
                    slots=len(engine.running) if holding_off else engine.slots - len(engine.holding),
                    running=engine.view_cache,
                    last_heartbeat=now if engine.killed_at is None else engine.killed_at,
                    price_per_hour=engine.price_per_hour,
                    steal_requested_at=engine.steal_requested_at,
                )
            )
        return tuple(views)

    def _snapshot(self, claiming: bool = False) -> ClusterSnapshot:
        step = StepView(
            step=self.step,
            policy_version=self.version,
            started_at=self.started_at,
            total_samples=sum(len(state.samples) for state in self.open.values()),
            done=sum(state.done for state in self.open.values()),
            groups_total=sum(len(state.groups) for state in self.open.values()),
            groups_done=sum(state.groups_done for state in self.open.values()),
        )
        partial = self.queue.partial
        queued = len(self.queue) if claiming else len(self.queue) + len(self.routed)
        partial += 0 if claiming else len(self.routed)
        return ClusterSnapshot(self.loop.now, step, self._views(claiming), QueueView(queued, partial))

    def _poll(self) -> None:
        """One controller poll: reap, offload, steal."""
        if self.finished:
            return
        now = self.loop.now
        snapshot = self._snapshot()
        by_id = {e.instance_id: e for e in self.engines}
        dead = set()
        for decision in reap(snapshot, self.reaper):
            engine = by_id[decision.instance_id]
            engine.registered = False
            self._evict_all(engine, "silent", preempted=True)
            dead.add(engine.instance_id)
            self._count_instances()
        if dead:
            snapshot = self._snapshot()
        num_spot = snapshot.rollout_only_alive
        # `train_first`: `T_local` counts from the reserved engines' wake-up, not before it
        released = not self.leading and self.offload.should_release(now, self.generating_since, num_spot)
        if released and self.released_at is None:
            self.released_at = now
            self.release_t_local = self.offload.t_local(num_spot)
            self.release_num_spot = num_spot
        if released and not self.released:
            for engine in self.engines:
                if engine.capacity_class == "reserved" and engine.instance_id not in self.told:
                    self._evict_all(engine, "flushed", preempted=False)
                    self.told.add(engine.instance_id)
        elif not released and self.told:
            self.told.clear()
        self.released = released
        if self.v.steal and not self.pinned:  # a trajectory whose environment cannot move is not stolen
            snapshot = self._snapshot() if dead or released else snapshot
            for decision in steal(snapshot, self.config.steal, reserved_released=released or self._reserved_busy()):
                engine = by_id[decision.from_instance]
                for sid in decision.sample_ids:
                    self._release(engine, engine.running[sid], "flushed", to=decision.to_instance)
                self._reschedule(engine)
                engine.steal_requested_at = now
                engine.claim_after = now + self.s.run.steal_holdoff_s
                self.loop.at(engine.claim_after, self._soon_claim)
        self._soon_claim()
        self._train_next()
        self.loop.after(self.config.poll_s, self._poll)

    def _reserved_busy(self) -> bool:
        """The reserved engines do not generate now: released at `T_local`, or training."""
        return self.released or self.training or self.leading

    def _soon_claim(self) -> None:
        if not self.claim_pending and (self.queue or self.routed):
            self.claim_pending = True
            self.loop.after(self.s.run.claim_delay_s, self._claims)

    def _claims(self) -> None:
        """Receivers claim the samples stolen for them (anyone, once their wait is over: the
        samples join the queue), then workers claim what `dispatch` gives each, in the token
        log's order."""
        self.claim_pending = False
        if self.finished:
            return
        by_id = {e.instance_id: e for e in self.engines}
        self._claim_routed(by_id)
        if not self.queue:
            return
        snapshot = self._snapshot(claiming=True)
        for decision in dispatch(snapshot, reserved_released=self._reserved_busy()):
            engine = by_id[decision.instance_id]
            for _ in range(decision.count):
                self._claim(engine, self.by_id[self.queue.pop()])
            self._reschedule(engine)

    def _claim_routed(self, by_id: dict[str, Engine]) -> None:
        """A receiver able to claim takes its routed samples up to its free slots; routed samples
        whose wait is over go to the queue for anyone."""
        now = self.loop.now
        waiting = []
        for to, until, sid in self.routed:
            engine = by_id[to]
            can = (
                engine.generating_alive
                and engine.policy_version == self.version
                and now >= engine.claim_after
                and not (self._reserved_busy() and engine.capacity_class == "reserved")
                and engine.free_slots > 0
            )
            if can:
                self._claim(engine, self.by_id[sid])
                self._reschedule(engine)
            elif now >= until - EPS:
                self._enqueue(self.by_id[sid], routed=True)
            else:
                waiting.append((to, until, sid))
        self.routed = waiting

    # --- spot capacity -----------------------------------------------------------------------------

    def _spot_registered(self) -> bool:
        return any(e.capacity_class == "spot" and e.generating_alive for e in self.engines)

    def _spot_alive(self) -> list[Engine]:
        return [e for e in self.engines if e.capacity_class == "spot" and e.ended_at is None and e.killed_at is None]

    def _count_instances(self) -> None:
        count = sum(1 for e in self.engines if e.capacity_class == "spot" and e.generating_alive)
        self.step_counts.add(count)
        if count != self.instance_counts[-1][1]:
            self.instance_counts.append((self.loop.now, count))

    def _set_capacity(self, capacity: int) -> None:
        """The trace allows `capacity` instances now."""
        self.available = capacity
        self._fit_spot()

    def _fit_spot(self) -> None:
        """Preempt the oldest instances beyond what the trace allows; then, with `marginal`
        capacity, drain the newest beyond what `plan_marginal` finds worth holding; launch up to
        the target."""
        held = self._spot_alive()
        allowed = min(self.available, self.s.spot.max_instances)
        cut = max(0, len(held) - allowed)
        for engine in held[:cut]:
            self._preempt(engine)
        held = held[cut:]
        target = allowed if self.v.capacity == "budget" else self._marginal_target(allowed, len(held))
        for engine in reversed(held[target:]):
            self._drain(engine)
        for _ in range(max(0, target - len(held))):
            self._launch()

    def _marginal_target(self, allowed: int, held: int) -> int:
        """`plan_marginal`'s count for the spot pool: the trace's `allowed` the ceiling, the curve
        the offload controller learned so far, prices, the preemption rate seen so far, boot plus
        a first pull as the warm-up, each instance's weight egress per hour."""
        assert isinstance(self.offload, OffloadController)
        spot, n = self.s.spot, self.s.network
        offer = PoolOffer(
            "spot", self.spot_price, 1.0, max_instances=allowed, preemptions_per_hour=self._preemptions_per_hour()
        )
        first_pull = pull_seconds(self.first_pull_bytes, 1, n.trainer_gbps, n.instance_gbps, self.v.swarm)
        config = CapacityConfig(budget_per_hour=self.spot_price * allowed + 1.0, warmup_s=spot.boot_s + first_pull)
        marginal = MarginalConfig(self.reserved_price, {"spot": self._egress_per_hour()})
        (planned,) = plan_marginal((offer,), config, marginal, self.offload.throughput_curve(), held)
        return planned.target

    def _preemptions_per_hour(self) -> float:
        now = self.loop.now
        hours = sum(min(e.ended_at or now, now) - e.launched_at for e in self.engines if e.capacity_class == "spot")
        return self.preemptions / (hours / 3600) if hours > 0 else 0.0

    def _egress_per_hour(self) -> float:
        """One spot instance's weight updates per hour in USD, at the recent steps' pace."""
        recent = self.steps[-8:]
        if not recent or self.egress_usd_per_gb == 0:
            return 0.0
        step_s = sum(s.ended_at - s.started_at for s in recent) / len(recent)
        nbytes = self.version_bytes * self.s.network.weight_bytes_fraction
        return nbytes / 1e9 * self.egress_usd_per_gb * 3600 / max(step_s, 1e-9)

    def _drain(self, engine: Engine) -> None:
        """The capacity manager drains an instance it no longer wants: it hands its samples back
        (all their tokens kept) and is deleted; not a preemption."""
        now = self.loop.now
        if engine.registered:
            self._evict_all(engine, "flushed", preempted=False)
        engine.registered = False
        engine.ended_at = now
        engine.token += 1
        self._count_instances()
        self._soon_claim()

    def _launch(self) -> None:
        now = self.loop.now
        spot = self.s.spot
        model = self._decode("spot", spot.gpus, spot.max_running)
        engine = Engine(
            f"spot-{self.spot_seq}", "spot", model, model.slots(self.mean_context), self.spot_price, now, clock_at=now
        )
        self.spot_seq += 1
        self.engines.append(engine)
        self.engine_of[engine.instance_id] = engine
        self.loop.after(spot.boot_s, lambda: self._booted(engine))

    def _booted(self, engine: Engine) -> None:
        if engine.ended_at is not None or engine.killed_at is not None:
            return
        engine.registered = True
        engine.clock_at = self.loop.now
        self._count_instances()
        peers = sum(1 for e in self.engines if e.capacity_class == "spot" and e.policy_version == self.version)
        self._pull([engine], peers, fresh=True)

    def _preempt(self, engine: Engine) -> None:
        now = self.loop.now
        self.preemptions += 1
        if self.rng.random() < self.s.spot.silent_fraction:
            self.silent_kills += 1
            self._advance(engine, now)
            engine.killed_at = engine.ended_at = now
            engine.token += 1  # no completion after the kill
        else:
            if engine.registered:
                self._evict_all(engine, "flushed", preempted=True)
            engine.registered = False
            engine.ended_at = now + self.s.spot.notice
        self._count_instances()
        self._soon_claim()
