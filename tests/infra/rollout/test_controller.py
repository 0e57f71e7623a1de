"""The rollout controller against a real redis-server and real rollout workers
(`infra.rollout.worker.RolloutWorker`, each on a thread) whose engines are scripted (`tests.fakes.engine`):
a sample's tokens are a pure function of its id and position, so any migration must reproduce
them exactly. Each worker talks to Redis through its own `GatedRedis` client, which a test freezes
to pause that instance (its heartbeats and flushes stop) and thaws to let it come back as a zombie.
The controller only ever sees Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from infra.availability.capacity import CapacityClass
from infra.rollout.control import ControlMessage, Release, ReleaseAll
from infra.rollout.controller import RolloutController, StepReport, samples_of_group
from infra.rollout.controller_config import ControllerConfig, OffloadSettings
from infra.rollout.instance import InstanceSpec
from infra.rollout.policies import StealConfig
from infra.rollout.registry import InstanceRegistry
from infra.rollout.tokenlog import GroupSpec, SampleRecord, TokenLog
from infra.rollout.worker import RolloutWorker, WorkerConfig
from tests.fakes.engine import ScriptedEngine, scripted_response
from tests.fakes.redis_gate import GatedRedis
from tests.helpers import REPO_ROOT, wait_for

pytestmark = pytest.mark.integration

ROOT = REPO_ROOT
STEP_S = 0.02
"""Seconds per engine step (one token per running sample)."""


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


class Instance:
    """A rollout instance: a `RolloutWorker` running on a thread with a `ScriptedEngine` and its
    own `GatedRedis` client. It flushes every token and heartbeats every 50 ms; its heartbeat TTL
    is long, so only the controller's `reap_timeout_s` decides that it is dead."""

    def __init__(
        self,
        redis_url: str,
        run_id: str,
        instance_id: str,
        length: Callable[[str], int],
        *,
        capacity_class: CapacityClass = "spot",
        slots: int = 4,
        step_s: float = STEP_S,
        policy_version: int = 0,
    ) -> None:
        self.client = GatedRedis.from_url(redis_url)
        self.engine = ScriptedEngine(length, step_s=step_s, policy_version=policy_version)
        config = WorkerConfig(
            redis_url=redis_url,
            run_id=run_id,
            instance=InstanceSpec(
                instance_id=instance_id, pool=f"local-{capacity_class}", capacity_class=capacity_class
            ),
            model_path="(scripted engine)",
            slots=slots,
            flush_tokens=1,
            flush_ms=5,
            heartbeat_s=0.05,
            ttl_s=10,
            poll_ms=20,
        )
        self.worker = RolloutWorker(config, client=self.client, engine=self.engine)
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._run, name=f"worker-{instance_id}", daemon=True)

    def _run(self) -> None:
        self.exit_code = self.worker.run()

    def start(self) -> Instance:
        self._thread.start()
        return self

    def held(self) -> dict[str, int]:
        """Sample id -> logged tokens, of the samples the worker holds."""
        return {h.sample_id: h.logged for h in list(self.worker.held.values())}

    def wait_stopped(self, timeout_s: float = 10.0) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"worker {self.worker.config.instance.instance_id} did not stop"

    def stop(self) -> None:
        self.client.thaw()
        self.worker.request_stop("test over")
        self.wait_stopped()
        self.client.close()


@pytest.fixture
def run_id() -> str:
    return f"ctl-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def fleet(redis_url, run_id):
    """Starts instances; stops them all after the test."""
    started: list[Instance] = []

    def start(instance_id: str, length: Callable[[str], int], **kwargs) -> Instance:
        started.append(Instance(redis_url, run_id, instance_id, length, **kwargs).start())
        return started[-1]

    yield start
    for instance in started:
        instance.stop()


@pytest.fixture
def sent(monkeypatch) -> dict[str, list[ControlMessage]]:
    """The control messages the controller delivered, by instance id."""
    messages: dict[str, list[ControlMessage]] = defaultdict(list)
    deliver = InstanceRegistry.request

    def recording(registry: InstanceRegistry, instance_id: str, command: ControlMessage) -> bool:
        delivered = deliver(registry, instance_id, command)
        if delivered:
            messages[instance_id].append(command)
        return delivered

    monkeypatch.setattr(InstanceRegistry, "request", recording)
    return messages


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
            assert record.token_ids == scripted_response(record.sample_id, length(record.sample_id))


def test_step_completes_and_streams_groups_as_they_finish(redis_client, run_id, fleet):
    groups = make_groups(4, 2, max_new=64)
    length = group_length({0: 3, 1: 15, 2: 27, 3: 40})
    fleet("a", length, policy_version=7)
    fleet("b", length, policy_version=7)
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
            assert s.response_ids == scripted_response(s.sample_id, length(s.sample_id))
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
    wait_for(lambda: len(a.held()) == 4 and all(logged >= 3 for logged in a.held().values()))
    a.client.freeze()  # paused: no heartbeat, no flush reaches Redis
    prefixes = {r.sample_id: r.token_ids for r in log.read_group(0, 0)}
    b = fleet("b", length, step_s=1.5 * STEP_S)
    b.engine.running.clear()  # b resumes the samples and generates once the zombie's flushes are refused
    wait_for(lambda: b.engine.added().keys() == prefixes.keys())  # a was reaped, b resumed all
    assert "a" not in {i.spec.instance_id for i in InstanceRegistry(redis_client, run_id).all()}
    a.client.thaw()  # the zombie wakes up and flushes its stale leases, within the step
    wait_for(lambda: a.worker.stats.dropped == 4)
    b.engine.running.set()
    report = done.result(timeout=20)
    a.wait_stopped()

    assert_complete(log, 0, groups, length)
    assert b.engine.added() == prefixes
    assert a.worker.stats.dropped == 4 and report.rejected_appends == 4
    assert a.worker.stats.finished == 0
    assert (report.reaped_instances, report.reaped_samples, report.migrations) == (1, 4, 4)
    by_a = sum(map(len, prefixes.values()))
    assert report.instance_tokens == {"a": by_a, "b": 4 * 30 - by_a}
    assert a.exit_code == 0 and not a.worker.heartbeat(), "a reaped instance is told to stop"


def test_samples_of_an_unregistered_owner_are_reaped(redis_client, run_id, fleet, background):
    """An instance that deregistered without handing its samples back does not stall the step."""
    groups = make_groups(1, 4, max_new=32)
    length = group_length({0: 30})
    log = TokenLog(redis_client, run_id)
    a = fleet("a", length)
    controller = RolloutController(redis_client, run_id, ControllerConfig(reap_timeout_s=0.4, poll_s=0.05))
    done = background.submit(controller.run_step, 0, 0, groups, ignore)
    wait_for(lambda: len(a.held()) == 4 and all(logged >= 3 for logged in a.held().values()))
    a.client.freeze()  # gone for good (until the test ends): it hands nothing back
    InstanceRegistry(redis_client, run_id).deregister("a")
    assert log.owners() == {"a"}
    prefixes = {r.sample_id: r.token_ids for r in log.read_group(0, 0)}
    b = fleet("b", length, step_s=1.5 * STEP_S)
    report = done.result(timeout=20)

    assert_complete(log, 0, groups, length)
    assert b.engine.added() == prefixes
    assert (report.reaped_instances, report.reaped_samples, report.migrations) == (1, 4, 4)
    assert log.owners() == set()


def test_idle_instance_steals_from_an_overloaded_one(redis_client, run_id, fleet, sent, background):
    groups = make_groups(1, 4, max_new=64)
    length = group_length({0: 60})
    steal = StealConfig(min_remaining_tokens=1, cooldown_s=0.5)
    config = ControllerConfig(poll_s=0.05, steal=steal)
    a = fleet("a", length, step_s=1.5 * STEP_S)
    controller = RolloutController(redis_client, run_id, config)
    done = background.submit(controller.run_step, 0, 0, groups, ignore)
    wait_for(lambda: len(a.held()) == 4)
    b = fleet("b", length)
    report = done.result(timeout=20)

    releases = [m for m in sent["a"] if isinstance(m, Release) and m.sample_ids is not None]
    assert len(releases[0].sample_ids or ()) == 2, "4 vs 0 running evens out at 2 vs 2"
    assert report.steals == sum(len(m.sample_ids or ()) for m in releases)
    released = [sid for m in releases for sid in m.sample_ids or ()]
    assert sorted(r.sample_id for r in b.engine.requests) == sorted(released)
    assert all(r.generated_ids for r in b.engine.requests), "stolen samples continue from their prefix"
    assert sorted(a.engine.released) == sorted(released)
    assert report.migrations == report.steals and report.instance_tokens["b"] > 0
    assert_complete(TokenLog(redis_client, run_id), 0, groups, length)


def test_reserved_instance_releases_at_t_local_while_spot_is_alive(redis_client, run_id, fleet, sent, background):
    groups = make_groups(2, 2, max_new=64)
    length = group_length({0: 40, 1: 40})
    clock = ManualClock()
    config = ControllerConfig(poll_s=0.05, offload=OffloadSettings(initial_t_local_s=10))
    reserved = fleet("r", length, capacity_class="reserved")
    fleet("s", length, slots=2)
    controller = RolloutController(redis_client, run_id, config, clock=clock)
    done = background.submit(controller.run_step, 0, 0, groups, ignore)
    wait_for(lambda: bool(reserved.engine.requests))
    time.sleep(0.2)
    assert sent["r"] == [], "no release before T_local"
    clock.now = 10.0
    wait_for(lambda: bool(sent["r"]))
    report = done.result(timeout=20)

    assert sent["r"] == [ReleaseAll(0)]
    assert (report.t_local_s, report.num_spot) == (10.0, 1)
    assert report.migrations == len(reserved.engine.requests) and report.instance_tokens["s"] > 0
    assert sorted(reserved.engine.released) == sorted(r.sample_id for r in reserved.engine.requests)
    assert_complete(TokenLog(redis_client, run_id), 0, groups, length)


def test_reserved_instance_never_releases_without_spot(redis_client, run_id, fleet, sent):
    groups = make_groups(1, 2, max_new=16)
    length = group_length({0: 10})
    config = ControllerConfig(poll_s=0.05, offload=OffloadSettings(initial_t_local_s=0))
    reserved = fleet("r", length, capacity_class="reserved")
    report = RolloutController(redis_client, run_id, config).run_step(0, 0, groups, ignore)

    assert sent["r"] == [] and reserved.engine.released == []
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

    # Step 1 on policy version 0 as well: scripted engines have no weights to pull.
    second = RolloutController(redis_client, run_id, config).run_step(1, 0, groups, train)
    assert second.t_local_s == t_local
    assert_complete(TokenLog(redis_client, run_id), 1, groups, length)


_CONTROLLER_PROCESS = """
import json, os, sys, time
import redis
from infra.rollout.controller import RolloutController
from infra.rollout.controller_config import ControllerConfig
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
            {
                "group_id": g.group_id,
                "prompt_ids": list(g.prompt_ids),
                "n": g.n,
                "max_new_tokens": g.max_new_tokens,
                "meta": g.meta,
            }
            for g in groups
        ],
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TEST_REDIS_URL": redis_url}
    process = subprocess.Popen(
        [sys.executable, "-c", _CONTROLLER_PROCESS, run_id, json.dumps(spec)],
        cwd=ROOT,
        env=env,
    )
    try:
        fleet("a", length, policy_version=1)
        fleet("b", length, policy_version=1)
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
    assert log.completions(0) == 4, "each group completed once"
    assert_complete(log, 0, groups, length)
    for g in groups:
        for record in log.read_group(0, g.group_id):
            assert record.token_ids[: len(prefixes[record.sample_id])] == prefixes[record.sample_id]
            assert record.attempts == 1
    assert isinstance(report, StepReport) and report.groups_done == 4
    assert report.tokens_generated == sum(2 * n for n in (4, 10, 90, 110))
    assert sum(report.instance_tokens.values()) == report.tokens_generated, "credited once"
