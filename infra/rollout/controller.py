"""The rollout controller runtime (docs/internals.md §4-5): drives one RL step's rollout on Redis.

`RolloutController.run_step` enqueues a step's groups in the token log (idempotently), makes the
step current for the workers (`infra.rollout.protocol`), then polls until every group is complete
or dropped. Each poll builds a `ClusterSnapshot` from the registry and the token log and applies
the pure policies (`infra.rollout.policies`): **reap** silent instances and unregistered owners,
**offload** (past `T_local`, while a spot instance is alive, reserved instances ``release_all``;
``resume`` if the last spot one dies), **steal** (a loaded instance releases samples, routed to
the receiver the policy chose) and **stream** each complete group to `on_group` on one delivery
thread. It owns the controller's keys (``rlb:{<run_id>}:ctl:``; their table, and the clocks it
persists: docs/internals.md §5) and keeps all a step needs there, so a controller started again on
the same Redis resumes the step. `take_over` makes a dead driver's run this driver's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace

import redis

from infra.keyspace import controller_prefix, current_step_key, glob_escape
from infra.rollout.control import Release, ReleaseAll, Resume
from infra.rollout.controller_config import ControllerConfig
from infra.rollout.policies import (
    ClusterSnapshot,
    InstanceView,
    OffloadController,
    QueueView,
    ReaperConfig,
    RunningSample,
    StepTiming,
    StepView,
    reap,
    steal,
)
from infra.rollout.protocol import set_current_step
from infra.rollout.registry import InstanceRegistry
from infra.rollout.served import served_weights
from infra.rollout.tokenlog import INFRA_FAILED, GroupSpec, SampleRecord, StepStatus, TokenLog, TokenLogStats
from rl.rollout import Sample

logger = logging.getLogger(__name__)

OnGroup = Callable[[int, list[SampleRecord]], None]
"""Receives each complete group; should return once the group is consumed (trained on)."""


@dataclass(frozen=True)
class StepReport:
    """What one step's rollout did, as counted by the token log and the controller."""

    step: int
    policy_version: int
    step_time_s: float
    """From the step's first start to the return of the last `on_group`."""
    tokens_generated: int
    """Tokens logged for the step's samples plus those discarded by releases."""
    tokens_wasted: int
    """Discarded tokens plus the tokens of dropped groups (never trained)."""
    migrations: int
    """Claims that resumed a sample after another lease."""
    reaped_instances: int
    reaped_samples: int
    steals: int
    """Samples loaded instances were asked to release."""
    rejected_appends: int
    """Flushes fenced off (zombies, stale leases)."""
    t_local_s: float | None
    """`T_local` at which reserved instances released; None if they never did."""
    num_spot: int
    """Spot (rollout-only) instances alive at the release; 0 without one."""
    trainer_idle_s: float
    rollout_idle_s: float
    groups_done: int
    groups_dropped: tuple[int, ...]
    instance_tokens: dict[str, int]
    """Logged tokens per instance, credited to the owner seen at each poll (a sample migrating
    between two polls credits its last flushes to the next owner)."""
    infra_failed: dict[str, int] = field(default_factory=dict)
    """Trajectories failed by the infrastructure (their environment), by kind: never scored."""
    served_versions: dict[str, int] = field(default_factory=dict)
    """Alive instances per policy version they served at the step's end (`served_weights`)."""
    wrong_weight_instances: int = 0
    """Alive instances at the step's end whose weights sha differs from the publisher's."""
    wrong_weights: int = 0
    """Claims and flushes the token log refused for a wrong weights sha during the step."""

    @classmethod
    def from_json(cls, text: bytes | str) -> StepReport:
        data = json.loads(text)
        return cls(**{**data, "groups_dropped": tuple(data["groups_dropped"])})


@dataclass(frozen=True)
class TakeOver:
    """What a new driver found of the step it resumes (`RolloutController.take_over`)."""

    step: int
    samples_done: int
    """Samples finished by the dead driver's instances: not generated again."""
    samples_partial: int
    """Samples queued with logged tokens: continued from them."""
    reaped_samples: int
    """Samples the dead driver's instances held, back in the queue with their tokens."""
    later_steps_deleted: tuple[int, ...]


_STEP_SCRATCH = ("told", "delivered", "busy", "itok", "seen")
"""The per-step controller keys deleted when the step finishes (``C step:<s>`` stays)."""


@dataclass(frozen=True)
class AdmittedStep:
    """A later step admitted while an earlier one rolls out (bounded staleness): its groups are
    generated by any version in [`min_version`, `policy_version`]."""

    step: int
    policy_version: int
    min_version: int
    groups: Sequence[GroupSpec]


def samples_of_group(records: Sequence[SampleRecord]) -> list[Sample]:
    """A complete group's records as the `Sample`s of the in-process rollout path; a sample failed
    by the infrastructure (``infra:<kind>``, in a group completed without it: `renormalize`) is
    left out, never scored."""
    for record in records:
        if record.state != "done" and not (record.state == "failed" and _infra_failed(record)):
            raise ValueError(f"sample {record.sample_id} is {record.state}, not done")
    return [_sample(r) for r in records if r.state == "done"]


def _infra_failed(record: SampleRecord) -> bool:
    return (record.finish_reason or "").startswith(INFRA_FAILED)


def _sample(record: SampleRecord) -> Sample:
    mask = record.loss_mask()
    outcome = record.outcome
    return Sample(
        sample_id=record.sample_id,
        group=record.group_id,
        prompt_ids=list(record.prompt_ids),
        response_ids=list(record.token_ids),
        logprobs=list(record.logprobs),
        finish_reason=record.finish_reason or "",
        policy_version=record.policy_version,
        token_versions=_off_policy_versions(record, mask),
        loss_mask=mask if not all(mask) else [],
        turns=[(turn.end, turn.observation) for turn in record.turns],
        env_reward=None if outcome is None else outcome.reward,
        truncated=outcome is not None and outcome.truncated,
        migrated_mid_turn=record.migrated_mid_turn,
        env_s=record.env_s,
        wait_s=record.wait_s,
        life_s=record.life_s,
    )


def _off_policy_versions(record: SampleRecord, mask: Sequence[int]) -> list[int]:
    """The record's per-token versions, or [] when every model token is of the step's own version
    (an environment segment's tokens are of none: `ENV_VERSION`)."""
    versions = record.token_versions()
    return versions if any(v != record.policy_version for v, m in zip(versions, mask) if m) else []


def _str(reply: bytes | str) -> str:
    """A reply of the controller's binary client as text."""
    return reply.decode() if isinstance(reply, bytes) else reply


def _busy_within(intervals: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Total length of `intervals` (disjoint: one delivery thread) inside [start, end]."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)


class RolloutController:
    """Runs steps' rollouts for one run; any number of restarts may resume a step."""

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        config: ControllerConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = client
        self.run_id = run_id
        self.config = config
        self.clock = clock
        self.registry = InstanceRegistry(client, run_id)
        self._prefix = controller_prefix(run_id)
        self._steal_at: dict[str, float] = {}
        self._max_turns: dict[str, int] = {}
        """``<step>/<group>/`` -> the environment's `max_turns`, for the admitted trajectory groups."""
        self._orphan_scan_at = float("-inf")
        self._orphan_seen: dict[str, float] = {}
        """Unregistered owners of running samples, and when each was first seen so."""

    def _key(self, name: str, step: int | None = None) -> str:
        return self._prefix + name + ("" if step is None else f":{step}")

    @property
    def offload(self) -> OffloadController:
        """The persisted offload controller (or a fresh one from the config)."""
        state = self.redis.get(self._key("offload"))
        if state is None:
            return self.config.offload.new_controller()
        return OffloadController.from_dict(json.loads(state))

    # --- the step loop -------------------------------------------------------------------------

    def run_step(
        self,
        step: int,
        policy_version: int,
        groups: Sequence[GroupSpec],
        on_group: OnGroup,
        check: Callable[[], None] | None = None,
        *,
        min_version: int | None = None,
        ahead: Sequence[AdmittedStep] = (),
        staleness: int = 0,
    ) -> StepReport:
        """Roll out `step` (or resume it) until every group is complete or dropped, streaming
        complete groups to `on_group`; returns the step's report (the stored one if the step
        already finished). `check` is called at every poll: what it raises (a part of the run
        that failed) ends the step with that error. With bounded staleness (`staleness` K >= 1)
        the step accepts tokens of versions >= `min_version`, and the `ahead` steps are admitted
        too, so instances generate them (oldest first) while this one finishes and trains."""
        step_key = self._key("step", step)
        finished = self.redis.hget(step_key, "report")
        if finished is not None:
            return StepReport.from_json(finished)
        log = TokenLog(self.redis, self.run_id)
        self._max_turns = {k: v for k, v in self._max_turns.items() if int(k.split("/")[0]) >= step}
        for admitted in (
            AdmittedStep(step, policy_version, policy_version if min_version is None else min_version, groups),
            *ahead,
        ):
            for group in admitted.groups:
                if group.environment is not None:
                    self._max_turns[f"{admitted.step}/{group.group_id}/"] = group.environment.max_turns
            if not log.enqueue_step(admitted.step, admitted.policy_version, admitted.groups, admitted.min_version):
                stored = log.step_status(admitted.step).policy_version
                if stored != admitted.policy_version:
                    raise ValueError(
                        f"step {admitted.step} was enqueued for policy version {stored}, not {admitted.policy_version}"
                    )
        self.redis.hsetnx(step_key, "started_at", repr(self.clock()))
        self.redis.hsetnx(step_key, "offload_before", json.dumps(self.offload.to_dict()))
        for name, value in asdict(log.stats()).items():
            self.redis.hsetnx(step_key, f"base_{name}", value)
        newest = max([step, *(a.step for a in ahead)])
        if not set_current_step(self.redis, self.run_id, newest, policy_version, first=step, staleness=staleness):
            raise RuntimeError(f"a step after {newest} is already current: {step} cannot be resumed")
        started = self.redis.hget(step_key, "started_at")
        assert started is not None  # set above, if not by an earlier run of the step
        started_at = float(started)
        offload = self.offload
        delivered = {int(g) for g in self.redis.smembers(self._key("delivered", step))}
        pending: list[Future[None]] = []
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"on-group-{step}")
        spot_counts: set[int] = set()
        """Spot counts seen by this driver's polls of the step (its throughput curve's key)."""
        try:
            while True:
                if check is not None:
                    check()
                status = log.step_status(step)
                snapshot = self._snapshot(log, status, started_at)
                snapshot = self._reap(log, snapshot)
                spot_counts.add(snapshot.rollout_only_alive)
                released = self._offload(offload, snapshot)
                self._steal(snapshot, released)
                if status.complete:
                    self.redis.hsetnx(step_key, "all_done_at", repr(snapshot.now))
                wait = 0.0 if status.complete else self.config.poll_s
                for group_id in log.next_completed_groups(step, timeout_s=wait):
                    if group_id not in delivered:
                        delivered.add(group_id)
                        records = log.read_group(step, group_id)
                        self._credit_final(log, step, records)
                        pending.append(pool.submit(self._deliver, step, records, on_group))
                for future in pending:
                    if future.done():
                        future.result()  # re-raise the consumer's exception
                if status.complete:
                    break
            for future in pending:
                future.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return self._finish(log, offload, step, spot_counts)

    def retire(self, step: int) -> None:
        """Delete a trained step from the token log and the controller's keys (its report too)."""
        TokenLog(self.redis, self.run_id).delete_step(step)
        self.redis.delete(*(self._key(name, step) for name in ("step", *_STEP_SCRATCH)))

    def take_over(self, next_step: int) -> TakeOver:
        """Make the run's state in Redis this driver's (docs/internals.md §5): reap the dead
        driver's instances, reopen `next_step`, delete the steps after it. Idempotent."""
        log = TokenLog(self.redis, self.run_id)
        reaped_samples = 0
        for instance in sorted({i.spec.instance_id for i in self.registry.all()} | log.owners()):
            reaped_samples += log.reap(instance, self.config.max_reaps)
            self.registry.deregister(instance)
        later = sorted(s for s in self._recorded_steps() if s > next_step)
        for step in later:
            log.delete_step(step)
            self.redis.delete(*(self._key(name, step) for name in ("step", *_STEP_SCRATCH)))
        current = self.redis.hget(current_step_key(self.run_id), "step")
        if current is not None and int(current) > next_step:
            self.redis.delete(current_step_key(self.run_id))
        step_key = self._key("step", next_step)
        before = self.redis.hget(step_key, "offload_before")
        if before is not None:
            self.redis.set(self._key("offload"), before)
        self.redis.hdel(step_key, "report", "all_done_at")
        self.redis.delete(self._key("told", next_step), self._key("delivered", next_step))
        try:
            done = log.step_status(next_step).done
        except KeyError:  # the dead driver never started it
            done = 0
        resumed = TakeOver(
            step=next_step,
            samples_done=done,
            samples_partial=log.queued_partial(next_step),
            reaped_samples=reaped_samples,
            later_steps_deleted=tuple(later),
        )
        logger.info("took over run %s: %s", self.run_id, resumed)
        return resumed

    def seed_offload(self, state: Mapping) -> bool:
        """Start from a learned offload state (`OffloadController.to_dict`, e.g. a checkpoint's)
        unless Redis holds one already; returns whether it was used."""
        return bool(self.redis.set(self._key("offload"), json.dumps(state), nx=True))

    def _recorded_steps(self) -> set[int]:
        """The steps this run's controllers have started (their ``C step:<s>`` hashes)."""
        start = len(self._key("step:"))
        return {
            int(key[start:])
            for key in self.redis.scan_iter(match=glob_escape(self._prefix) + "step:*", count=1000)
            if key[start:].isdigit()
        }

    def _snapshot(self, log: TokenLog, status: StepStatus, started_at: float) -> ClusterSnapshot:
        """The registry and the step's leases (a trajectory's turns and whether it waits for its
        environment), on the controller's clock; credits the logged tokens of running samples to
        their owners."""
        now = self.clock()
        seconds, micros = self.redis.time()
        server_now = seconds + micros / 1e6
        instances = self.registry.all()
        leases = log.step_leases(status.step, [i.spec.instance_id for i in instances])
        views, observed = [], {}
        for instance in instances:
            samples = []
            for lease in leases.running[instance.spec.instance_id]:
                group = lease.sample_id[: lease.sample_id.rfind("/") + 1]
                samples.append(
                    RunningSample(
                        lease.sample_id,
                        lease.logged,
                        lease.budget,
                        turns=lease.turns,
                        max_turns=self._max_turns.get(group, 1),
                        awaiting_env=lease.sample_id in instance.awaiting,
                    )
                )
                observed[lease.sample_id] = (instance.spec.instance_id, lease.logged)
            heard = instance.last_heartbeat or instance.registered_at
            views.append(
                InstanceView(
                    instance_id=instance.spec.instance_id,
                    pool=instance.spec.pool,
                    capacity_class=instance.spec.capacity_class,
                    policy_version=instance.policy_version,
                    slots=instance.slots,
                    running=tuple(samples),
                    last_heartbeat=now - (server_now - heard),
                    price_per_hour=instance.spec.price_per_hour,
                    steal_requested_at=self._steal_at.get(instance.spec.instance_id),
                )
            )
        self._credit(status.step, observed)
        step = StepView(
            step=status.step,
            policy_version=status.policy_version,
            started_at=started_at,
            total_samples=status.queued + status.running + status.done + status.failed,
            done=status.done,
            groups_total=status.groups_total,
            groups_done=status.groups_done,
        )
        return ClusterSnapshot(now, step, tuple(views), QueueView(status.queued, leases.queued_partial))

    def _reap(self, log: TokenLog, snapshot: ClusterSnapshot) -> ClusterSnapshot:
        """Reap and deregister silent instances; the snapshot with them marked dead."""
        dead = set()
        for decision in reap(snapshot, ReaperConfig(self.config.reap_timeout_s)):
            samples = log.reap(decision.instance_id, self.config.max_reaps)  # before deregistering: never orphan one
            self.registry.deregister(decision.instance_id)
            self.redis.hincrby(self._key("step", snapshot.step.step), "reaped_instances", 1)
            self._steal_at.pop(decision.instance_id, None)
            logger.info(  # a preempted spot instance is routine: the run log has it, the console a count
                "reaped %s (%s): %d samples requeued",
                decision.instance_id,
                decision.reason,
                samples,
            )
            dead.add(decision.instance_id)
        self._reap_orphans(log, snapshot)
        return replace(
            snapshot,
            instances=tuple(replace(i, alive=False) if i.instance_id in dead else i for i in snapshot.instances),
        )

    def _reap_orphans(self, log: TokenLog, snapshot: ClusterSnapshot) -> None:
        """Reap owners of running samples that are not registered (one that deregistered
        without handing its samples back), once seen so for a whole reap timeout."""
        if snapshot.now - self._orphan_scan_at < self.config.reap_timeout_s / 2:
            return
        self._orphan_scan_at = snapshot.now
        registered = {i.instance_id for i in snapshot.instances}
        orphans = log.owners() - registered
        self._orphan_seen = {o: self._orphan_seen.get(o, snapshot.now) for o in orphans}
        for owner, since in list(self._orphan_seen.items()):
            if snapshot.now - since < self.config.reap_timeout_s:
                continue
            samples = log.reap(owner, self.config.max_reaps)
            del self._orphan_seen[owner]
            self.redis.hincrby(self._key("step", snapshot.step.step), "reaped_instances", 1)
            logger.warning("reaped %s (unregistered owner): %d samples requeued", owner, samples)

    def _offload(self, offload: OffloadController, snapshot: ClusterSnapshot) -> bool:
        """Tell reserved instances to release at `T_local` (or to resume when no spot instance
        is left); returns whether the reserved cluster is released now."""
        step = snapshot.step.step
        step_key, told_key = self._key("step", step), self._key("told", step)
        num_spot = snapshot.rollout_only_alive
        released = offload.should_release(snapshot.now, snapshot.step.started_at, num_spot)
        told = {_str(m) for m in self.redis.smembers(told_key)}
        if released:
            if not self.redis.hexists(step_key, "released_at"):
                self.redis.hset(
                    step_key,
                    mapping={
                        "released_at": repr(snapshot.now),
                        "t_local": repr(offload.t_local(num_spot)),
                        "num_spot": num_spot,
                    },
                )
            for instance in snapshot.instances:
                target = instance.instance_id
                if instance.rollout_only or not instance.alive or target in told:
                    continue
                if self.registry.request(target, ReleaseAll(step)):
                    self.redis.sadd(told_key, target)
        elif told:
            for target in sorted(told):
                self.registry.request(target, Resume(step))
            self.redis.delete(told_key)
        return released

    def _steal(self, snapshot: ClusterSnapshot, released: bool) -> None:
        for decision in steal(snapshot, self.config.steal, reserved_released=released):
            message = Release(tuple(decision.sample_ids), to=decision.to_instance, route_s=self.config.steal.route_s)
            if self.registry.request(decision.from_instance, message):
                self._steal_at[decision.from_instance] = snapshot.now
                self.redis.hincrby(self._key("step", snapshot.step.step), "steals", decision.count)

    def _deliver(self, step: int, records: list[SampleRecord], on_group: OnGroup) -> None:
        """On the delivery thread: hand a group over and record the consumer's busy time."""
        group_id = records[0].group_id
        start = self.clock()
        on_group(group_id, records)
        pipe = self.redis.pipeline(transaction=True)
        pipe.rpush(self._key("busy", step), f"{start!r} {self.clock()!r}")
        pipe.sadd(self._key("delivered", step), group_id)
        pipe.execute()

    # --- token accounting ----------------------------------------------------------------------

    def _credit(self, step: int, observed: Mapping[str, tuple[str, int]]) -> None:
        """Credit each sample's newly logged tokens to the owner observed now."""
        if not observed:
            return
        seen_key, itok_key = self._key("seen", step), self._key("itok", step)
        sids = sorted(observed)
        pipe = self.redis.pipeline(transaction=True)
        for sid, before in zip(sids, self.redis.hmget(seen_key, sids)):
            owner, tokens = observed[sid]
            delta = tokens - int(before or 0)
            if delta > 0 and owner:
                pipe.hincrby(itok_key, owner, delta)
            if delta:
                pipe.hset(seen_key, sid, tokens)
        pipe.execute()

    def _credit_final(self, log: TokenLog, step: int, records: Sequence[SampleRecord]) -> None:
        """Credit a settled group's last flushes to the samples' final owners."""
        owners = log.sample_owners([r.sample_id for r in records])
        self._credit(step, {r.sample_id: (owner, len(r.token_ids)) for r, owner in zip(records, owners)})

    # --- the end of a step ---------------------------------------------------------------------

    def _finish(self, log: TokenLog, offload: OffloadController, step: int, spot_counts: set[int]) -> StepReport:
        """Measure the step, update and persist `T_local` and the throughput curve (a step whose
        polls all saw one spot count, `spot_counts`), store and return the report."""
        end = self.clock()
        step_key = self._key("step", step)
        status = log.step_status(step)
        dropped_tokens = 0
        for group_id in status.dropped_group_ids:
            records = log.read_group(step, group_id)
            self._credit_final(log, step, records)
            dropped_tokens += sum(len(r.token_ids) for r in records)
        state = {_str(k): _str(v) for k, v in self.redis.hgetall(step_key).items()}
        stats = asdict(log.stats())
        delta = {f.name: stats[f.name] - int(state.get(f"base_{f.name}", 0)) for f in fields(TokenLogStats)}
        started_at, all_done_at = float(state["started_at"]), float(state["all_done_at"])
        intervals = self.redis.lrange(self._key("busy", step), 0, -1)
        busy = [(float(a), float(b)) for a, b in (_str(i).split() for i in intervals)]
        rollout_idle = max(0.0, end - all_done_at)
        trainer_idle, t_local, num_spot = 0.0, None, 0
        throughput = (status.tokens_logged - dropped_tokens) / max(end - started_at, 1e-9)
        if "released_at" in state:  # a step that never released teaches T_local nothing
            released_at = float(state["released_at"])
            trainer_idle = max(0.0, end - released_at - _busy_within(busy, released_at, end))
            t_local, num_spot = float(state["t_local"]), int(state["num_spot"])
            offload.update(
                StepTiming(
                    t_local_s=t_local,
                    trainer_idle_s=trainer_idle,
                    rollout_idle_s=rollout_idle,
                    throughput=throughput,
                    num_spot=num_spot,
                )
            )
        if len(spot_counts) == 1:
            offload.observe(next(iter(spot_counts)), throughput)
        served = served_weights(self.registry.alive(), log.expected_weights())
        report = StepReport(
            step=step,
            policy_version=status.policy_version,
            step_time_s=end - started_at,
            tokens_generated=status.tokens_logged + delta["wasted_tokens"],
            tokens_wasted=delta["wasted_tokens"] + dropped_tokens,
            migrations=delta["migrations"],
            reaped_instances=int(state.get("reaped_instances", 0)),
            reaped_samples=delta["reaped_samples"],
            steals=int(state.get("steals", 0)),
            rejected_appends=delta["rejected_appends"],
            t_local_s=t_local,
            num_spot=num_spot,
            trainer_idle_s=trainer_idle,
            rollout_idle_s=rollout_idle,
            groups_done=status.groups_done,
            groups_dropped=status.dropped_group_ids,
            infra_failed=status.infra_failed,
            instance_tokens={_str(k): int(v) for k, v in sorted(self.redis.hgetall(self._key("itok", step)).items())},
            served_versions=served.versions,
            wrong_weight_instances=len(served.wrong),
            wrong_weights=delta["wrong_weights"],
        )
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self._key("offload"), json.dumps(offload.to_dict()))
        pipe.hset(step_key, "report", json.dumps(asdict(report)))
        pipe.delete(*(self._key(name, step) for name in _STEP_SCRATCH))
        pipe.execute()
        return report
