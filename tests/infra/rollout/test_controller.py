"""The rollout controller against a real redis-server, with fake rollout instances: plain threads
that register, heartbeat, claim, flush and release through the real registry and token log (the
controller only ever sees Redis). A sample's tokens are a pure function of its id and position,
so any migration must reproduce them exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from infra.rollout.controller import (
    ControllerConfig,
    OffloadSettings,
    RolloutController,
    StepReport,
    samples_of_group,
)
from infra.rollout.policies import StealConfig
from infra.rollout.registry import InstanceInfo, InstanceRegistry
from infra.rollout.tokenlog import Claim, Flush, GroupSpec, SampleRecord, TokenLog
from infra.rollout.protocol import current_step
from tests.helpers import REPO_ROOT, wait_for

pytestmark = pytest.mark.integration

ROOT = REPO_ROOT


def token(sample_id: str, position: int) -> int:
    return zlib.crc32(f"{sample_id}@{position}".encode()) % 50_000 + 1


def expected(sample_id: str, length: int) -> list[int]:
    return [token(sample_id, p) for p in range(length)]


def group_length(lengths: dict[int, int]) -> Callable[[str], int]:
    """Response length of a sample by its group."""
    return lambda sample_id: lengths[int(sample_id.split("/")[1])]


def make_groups(count: int, n: int, max_new: int) -> list[GroupSpec]:
    return [GroupSpec(g, [1, 2, 3 + g], n, max_new, meta={"answer": g}) for g in range(count)]


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeInstance:
    """A rollout instance reduced to its Redis side; generates `rate` tokens per sample per tick.

    `freeze` stops it entirely (a paused process); `silent` stops heartbeats, control messages and
    claims while it keeps flushing the samples it holds (a zombie)."""

    def __init__(
        self, client, run_id: str, instance_id: str, length: Callable[[str], int], *,
        capacity_class: str = "spot", slots: int = 4, tick_s: float = 0.02,
    ) -> None:
        self.client, self.run_id, self.id = client, run_id, instance_id
        self.length, self.capacity_class = length, capacity_class
        self.slots, self.tick_s = slots, tick_s
        self.log = TokenLog(client, run_id)
        self.registry = InstanceRegistry(client, run_id, ttl_s=10)
        self.held: dict[str, Claim] = {}
        self.tokens: dict[str, list[int]] = {}
        self.claims: list[Claim] = []
        self.messages: list[dict] = []
        self.frozen = self.silent = False
        self._lock = threading.Lock()
        self.rejected = 0
        self._released_step: int | None = None
        self._no_claim_until = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> FakeInstance:
        info = InstanceInfo(self.id, "local", self.capacity_class, 0.0, self.slots)
        self.registry.register(info)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def freeze(self, frozen: bool = True) -> None:
        """Takes effect between two ticks."""
        with self._lock:
            self.frozen = frozen

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            with self._lock:
                if not self.frozen:
                    self._tick()

    def _tick(self) -> None:
        current = current_step(self.client, self.run_id)
        if current is None:
            return
        step, version = current
        if not self.silent:
            for message in self.registry.poll_requests(self.id):
                self._handle(message)
            free = self.slots - len(self.held)
            if not self.registry.heartbeat(self.id, version, free, len(self.held)):
                self._stop.set()
                return
            may_claim = self._released_step != step and time.monotonic() >= self._no_claim_until
            if free > 0 and may_claim:
                for claim in self.log.claim(step, self.id, version, free):
                    self.claims.append(claim)
                    self.held[claim.sample_id] = claim
                    self.tokens[claim.sample_id] = list(claim.generated_ids)
        self._generate()

    def _handle(self, message: dict) -> None:
        self.messages.append(message)
        if message["op"] == "release":
            self._release(message["sample_ids"])
            self._no_claim_until = time.monotonic() + 0.5  # let the thief take them
        elif message["op"] == "release_all":
            self._released_step = message["step"]
            self._release(list(self.held))
        elif message["op"] == "resume":
            self._released_step = None

    def _release(self, sample_ids: list[str]) -> None:
        for sid in sample_ids:
            if sid in self.held:
                self.log.release(sid, self.id, self.held.pop(sid).epoch)

    def _generate(self) -> None:
        flushes = []
        for sid, claim in self.held.items():
            have = len(self.tokens[sid])
            new = expected(sid, min(have + 1, self.length(sid)))[have:]
            finish = "stop" if have + len(new) >= self.length(sid) else None
            flushes.append(Flush(sid, self.id, claim.epoch, new, [-1.0] * len(new), have, finish))
        for flush, ok in zip(flushes, self.log.log(flushes)):
            if ok:
                self.tokens[flush.sample_id] += flush.token_ids
            else:
                self.rejected += 1
            if not ok or flush.finish_reason:
                del self.held[flush.sample_id]


@pytest.fixture
def run_id() -> str:
    return f"ctl-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def fleet(redis_client, run_id):
    """Starts fake instances; stops them all after the test."""
    started: list[FakeInstance] = []

    def start(instance_id: str, length: Callable[[str], int], **kwargs) -> FakeInstance:
        started.append(FakeInstance(redis_client, run_id, instance_id, length, **kwargs).start())
        return started[-1]

    yield start
    for instance in started:
        instance.stop()


@pytest.fixture
def background():
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool


def ignore(group_id: int, records: list[SampleRecord]) -> None:
    pass


def assert_complete(log: TokenLog, step: int, groups: list[GroupSpec], length) -> None:
    """Every sample done exactly once, with exactly its deterministic tokens."""
    for group in groups:
        for record in log.read_group(step, group.group_id):
            assert record.state == "done"
            assert record.token_ids == expected(record.sample_id, length(record.sample_id))


def test_step_completes_and_streams_groups_as_they_finish(redis_client, run_id, fleet):
    groups = make_groups(4, 2, max_new=64)
    length = group_length({0: 3, 1: 15, 2: 27, 3: 40})
    fleet("a", length)
    fleet("b", length)
    controller = RolloutController(redis_client, run_id, ControllerConfig(poll_s=0.05))
    log = TokenLog(redis_client, run_id)
    calls = []

    def on_group(group_id: int, records: list[SampleRecord]) -> None:
        calls.append((group_id, log.step_status(0).complete, samples_of_group(records)))

    report = controller.run_step(0, 7, groups, on_group)

    assert [c[0] for c in calls] == [0, 1, 2, 3]
    assert calls[0][1] is False, "the first group streamed before the step's tail finished"
    for group_id, _, samples in calls:
        assert [s.sample_id for s in samples] == [f"0/{group_id}/0", f"0/{group_id}/1"]
        for s in samples:
            assert (s.group, s.prompt_ids, s.policy_version) == (group_id, [1, 2, 3 + group_id], 7)
            assert s.response_ids == expected(s.sample_id, length(s.sample_id))
            assert s.finish_reason == "stop"
    total = 2 * (3 + 15 + 27 + 40)
    assert (report.groups_done, report.groups_dropped, report.tokens_generated) == (4, (), total)
    assert (report.tokens_wasted, report.migrations, report.reaped_instances) == (0, 0, 0)
    assert sum(report.instance_tokens.values()) == total
    assert report.step_time_s > 0
    assert controller.run_step(0, 7, groups, on_group) == report  # finished: stored report
    assert len(calls) == 4
    log.enqueue_step(1, 7, groups)
    with pytest.raises(ValueError, match="policy version 7, not 8"):
        controller.run_step(1, 8, groups, on_group)


def test_silent_instance_is_reaped_and_its_zombie_fenced(redis_client, run_id, fleet, background):
    groups = make_groups(1, 4, max_new=32)
    length = group_length({0: 30})
    log = TokenLog(redis_client, run_id)
    config = ControllerConfig(reap_timeout_s=0.4, poll_s=0.05)
    a = fleet("a", length)
    controller = RolloutController(redis_client, run_id, config)
    done = background.submit(controller.run_step, 0, 0, groups, ignore)
    wait_for(lambda: len(a.held) == 4 and all(len(t) >= 3 for t in a.tokens.values()))
    a.freeze()
    prefixes = {r.sample_id: r.token_ids for r in log.read_group(0, 0)}
    b = fleet("b", length, tick_s=0.03)
    wait_for(lambda: "a" not in {i.info.instance_id for i in a.registry.all()})
    a.silent = True
    a.freeze(False)  # the zombie wakes up and flushes its stale leases
    report = done.result(timeout=20)

    assert_complete(log, 0, groups, length)
    assert {c.sample_id: c.generated_ids for c in b.claims} == prefixes
    assert a.rejected == 4 and report.rejected_appends == 4
    assert (report.reaped_instances, report.reaped_samples, report.migrations) == (1, 4, 4)
    by_a = sum(map(len, prefixes.values()))
    assert report.instance_tokens == {"a": by_a, "b": 4 * 30 - by_a}
    assert not a.registry.heartbeat("a", 0, 4, 0), "a reaped instance is told to stop"


def test_samples_of_an_unregistered_owner_are_reaped(redis_client, run_id, fleet, background):
    """An instance that deregistered without handing its samples back does not stall the step."""
    groups = make_groups(1, 4, max_new=32)
    length = group_length({0: 30})
    log = TokenLog(redis_client, run_id)
    a = fleet("a", length)
    controller = RolloutController(redis_client, run_id, ControllerConfig(reap_timeout_s=0.4, poll_s=0.05))
    done = background.submit(controller.run_step, 0, 0, groups, ignore)
    wait_for(lambda: len(a.held) == 4 and all(len(t) >= 3 for t in a.tokens.values()))
    a.stop()
    a.registry.deregister("a")
    assert log.owners() == {"a"}
    prefixes = {r.sample_id: r.token_ids for r in log.read_group(0, 0)}
    b = fleet("b", length, tick_s=0.03)
    report = done.result(timeout=20)

    assert_complete(log, 0, groups, length)
    assert {c.sample_id: c.generated_ids for c in b.claims} == prefixes
    assert (report.reaped_instances, report.reaped_samples, report.migrations) == (1, 4, 4)
    assert log.owners() == set()


def test_idle_instance_steals_from_an_overloaded_one(redis_client, run_id, fleet, background):
    groups = make_groups(1, 4, max_new=64)
    length = group_length({0: 60})
    steal = StealConfig(min_remaining_tokens=1, cooldown_s=0.5)
    config = ControllerConfig(poll_s=0.05, steal=steal)
    a = fleet("a", length, tick_s=0.03)
    controller = RolloutController(redis_client, run_id, config)
    done = background.submit(controller.run_step, 0, 0, groups, ignore)
    wait_for(lambda: len(a.held) == 4)
    b = fleet("b", length)
    report = done.result(timeout=20)

    releases = [m for m in a.messages if m["op"] == "release"]
    assert len(releases[0]["sample_ids"]) == 2, "4 vs 0 running evens out at 2 vs 2"
    assert report.steals == sum(len(m["sample_ids"]) for m in releases)
    released = [sid for m in releases for sid in m["sample_ids"]]
    assert sorted(c.sample_id for c in b.claims) == sorted(released)
    assert all(c.generated_ids for c in b.claims), "stolen samples continue from their prefix"
    assert report.migrations == report.steals and report.instance_tokens["b"] > 0
    assert_complete(TokenLog(redis_client, run_id), 0, groups, length)


def test_reserved_instance_releases_at_t_local_while_spot_is_alive(
    redis_client, run_id, fleet, background
):
    groups = make_groups(2, 2, max_new=64)
    length = group_length({0: 40, 1: 40})
    clock = ManualClock()
    config = ControllerConfig(poll_s=0.05, offload=OffloadSettings(initial_t_local_s=10))
    reserved = fleet("r", length, capacity_class="reserved")
    fleet("s", length, slots=2)
    controller = RolloutController(redis_client, run_id, config, clock=clock)
    done = background.submit(controller.run_step, 0, 0, groups, ignore)
    wait_for(lambda: bool(reserved.claims))
    time.sleep(0.2)
    assert reserved.messages == [], "no release before T_local"
    clock.now = 10.0
    wait_for(lambda: bool(reserved.messages))
    report = done.result(timeout=20)

    assert reserved.messages == [{"op": "release_all", "step": 0}]
    assert (report.t_local_s, report.num_spot) == (10.0, 1)
    assert report.migrations == len(reserved.claims) and report.instance_tokens["s"] > 0
    assert_complete(TokenLog(redis_client, run_id), 0, groups, length)


def test_reserved_instance_never_releases_without_spot(redis_client, run_id, fleet):
    groups = make_groups(1, 2, max_new=16)
    length = group_length({0: 10})
    config = ControllerConfig(poll_s=0.05, offload=OffloadSettings(initial_t_local_s=0))
    reserved = fleet("r", length, capacity_class="reserved")
    report = RolloutController(redis_client, run_id, config).run_step(0, 0, groups, ignore)

    assert reserved.messages == []
    assert (report.t_local_s, report.num_spot, report.instance_tokens) == (None, 0, {"r": 20})
    assert_complete(TokenLog(redis_client, run_id), 0, groups, length)


def test_t_local_adapts_per_step_and_survives_a_controller_restart(redis_client, run_id, fleet):
    groups = make_groups(2, 2, max_new=32)
    length = group_length({0: 20, 1: 20})
    settings = OffloadSettings(initial_t_local_s=0.2, floor_s=0.05)
    config = ControllerConfig(poll_s=0.05, offload=settings)
    fleet("r", length, capacity_class="reserved", slots=2)
    fleet("s", length, slots=2)

    def train(group_id: int, records: list[SampleRecord]) -> None:
        time.sleep(0.15)

    first = RolloutController(redis_client, run_id, config).run_step(0, 0, groups, train)
    assert (first.t_local_s, first.num_spot) == (0.2, 1)
    assert first.trainer_idle_s > 0 or first.rollout_idle_s > 0
    learned = RolloutController(redis_client, run_id, config).offload  # a fresh process's view
    assert learned.to_dict() != settings.new_controller().to_dict()
    t_local = learned.t_local(1)
    assert t_local != 0.2

    second = RolloutController(redis_client, run_id, config).run_step(1, 1, groups, train)
    assert second.t_local_s == t_local
    assert_complete(TokenLog(redis_client, run_id), 1, groups, length)


_CONTROLLER_PROCESS = """
import json, os, sys, time
import redis
from infra.rollout.controller import ControllerConfig, RolloutController
from infra.rollout.tokenlog import GroupSpec

run_id, spec = sys.argv[1], json.loads(sys.argv[2])
client = redis.Redis.from_url(os.environ["TEST_REDIS_URL"])

def on_group(group_id, records):
    client.rpush(f"test:{run_id}:delivered", group_id)
    if client.llen(f"test:{run_id}:delivered") == 2:
        time.sleep(3600)  # killed while the second group is being consumed

groups = [GroupSpec(**g) for g in spec["groups"]]
config = ControllerConfig(**spec["config"])
RolloutController(client, run_id, config).run_step(0, 1, groups, on_group)
"""


def test_killed_controller_is_resumed_by_a_new_one(redis_client, redis_url, run_id, fleet):
    groups = make_groups(4, 2, max_new=128)
    length = group_length({0: 4, 1: 10, 2: 90, 3: 110})
    config = {"poll_s": 0.05}
    spec = {
        "config": config,
        "groups": [
            {"group_id": g.group_id, "prompt_ids": list(g.prompt_ids), "n": g.n,
             "max_new_tokens": g.max_new_tokens, "meta": g.meta}
            for g in groups
        ],
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TEST_REDIS_URL": redis_url}
    process = subprocess.Popen(
        [sys.executable, "-c", _CONTROLLER_PROCESS, run_id, json.dumps(spec)],
        cwd=ROOT, env=env,
    )
    try:
        fleet("a", length)
        fleet("b", length)
        first_key = f"test:{run_id}:delivered"
        wait_for(lambda: redis_client.llen(first_key) == 2 or process.poll() is not None, timeout_s=30)
        log = TokenLog(redis_client, run_id)
        prefixes = {r.sample_id: r.token_ids for g in groups for r in log.read_group(0, g.group_id)}
    finally:
        process.kill()
        process.wait()
    assert not log.step_status(0).complete, "killed mid-step"

    delivered = []
    controller = RolloutController(redis_client, run_id, ControllerConfig(**config))
    report = controller.run_step(0, 1, groups, lambda group_id, records: delivered.append(group_id))

    first = [int(g) for g in redis_client.lrange(first_key, 0, -1)]
    consumed_before_kill = first[:-1]  # the last one's on_group never returned
    assert sorted(consumed_before_kill + delivered) == [0, 1, 2, 3]
    assert redis_client.xlen(f"rlb:{{{run_id}}}:done:0") == 4, "each group completed once"
    assert_complete(log, 0, groups, length)
    for g in groups:
        for record in log.read_group(0, g.group_id):
            assert record.token_ids[: len(prefixes[record.sample_id])] == prefixes[record.sample_id]
            assert record.attempts == 1
    assert isinstance(report, StepReport) and report.groups_done == 4
    assert report.tokens_generated == sum(2 * n for n in (4, 10, 90, 110))
    assert sum(report.instance_tokens.values()) == report.tokens_generated, "credited once"
