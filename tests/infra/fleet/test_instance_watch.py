"""The instance watch over real local process groups and a real registry (a real Redis): an
instance whose worker exits before it registers, or never registers, is stopped and replaced and
counted; one that registers resets its pool's count; a pool whose instances keep failing gives up
with the last one's error on one line. How a worker's flow run ended (what `InstanceRuns` reads
from Prefect, tested against a real server in test_instance_runs) is given here as data: a Failed
run stops its instance at once, another end only after `settle_s`, and an instance asked to drain
or preempted is no failure. An instance that holds no version the open step accepts for
`stall_s` (no source delivered one that passes its checks) is stopped and replaced too, unless the
version it holds keeps moving. The watch looks at most every `WATCH_S`, or at once when forced."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from infra.fleet.instance_watch import WATCH_S, InstanceWatch, PoolFailure, WorkerEnd
from infra.providers import LocalProvider, PoolSpec
from infra.providers.local import RESTART_BACKOFF_S
from infra.rollout.instance import InstanceSpec
from infra.rollout.registry import InstanceRegistry
from tests.helpers import Clock, wait_for

pytestmark = pytest.mark.integration

CHILD = r"""
import os, signal, sys
me = os.environ["RLBOOST_INSTANCE_ID"]
if sys.argv[1] == "fail" or (sys.argv[1] == "first-fails" and me.endswith("-0")):
    print("loading the model", flush=True)
    print(f"worker {me} cannot start: its engine failed: OSError: no model", flush=True)
    sys.exit(3)
while True:
    signal.pause()
"""
REGISTER_TIMEOUT_S = 300.0
SETTLE_S = 40.0
STALL_S = 60.0


def pool(name: str = "spot", size: int = 1) -> PoolSpec:
    return PoolSpec.model_validate(
        {"name": name, "capacity_class": "spot", "size": size, "machine_type": "cpu", "price_per_hour": 1.0}
    )


class Run:
    """A local provider of `mode` children, the run's registry, and the watch over both."""

    def __init__(self, tmp_path: Path, redis_client, mode: str, ends: dict[str, WorkerEnd] | None = None) -> None:
        self.clock = Clock()
        self.provider = LocalProvider(
            lambda spec, instance_id: [sys.executable, "-S", "-c", CHILD, mode],
            clock=self.clock,
            log_dir=tmp_path / "logs",
        )
        self.registry = InstanceRegistry(redis_client, f"watch-{uuid.uuid4().hex[:8]}")
        self.ends = ends if ends is not None else {}
        self.accepted: int | None = None
        """The oldest version the open step accepts (None: no step open)."""
        self.watch = InstanceWatch(
            self.provider,
            [pool("spot", 3), pool("flaky")],
            registered=lambda: {s.spec.instance_id: s.policy_version for s in self.registry.all()},
            max_failures=3,
            register_timeout_s=REGISTER_TIMEOUT_S,
            settle_s=SETTLE_S,
            worker_ends=lambda live: {i: end for i, end in self.ends.items() if i in live},
            explain=self.provider.last_log_line,
            clock=self.clock,
            accepted=lambda: self.accepted,
            stall_s=STALL_S,
        )

    def register(self, instance_id: str) -> None:
        self.registry.register(InstanceSpec.of_pool(instance_id, pool()), slots=1, ttl_s=60)

    def holds(self, instance_id: str, version: int | None) -> None:
        """A heartbeat of `instance_id` saying it holds `version`."""
        assert self.registry.heartbeat(instance_id, version, free_slots=1, running=0, ttl_s=60)

    def state(self, instance_id: str) -> tuple[str, str | None]:
        record = self.provider.describe(instance_id)
        return record.state, record.reason

    def exited(self, instance_id: str) -> None:
        def gone() -> bool:
            self.provider.tick()
            return self.state(instance_id)[0] == "terminated"

        wait_for(gone, f"{instance_id} gone")

    def look(self) -> None:
        """A watch's look, `WATCH_S` after the previous one."""
        self.clock.advance(WATCH_S)
        self.watch.check()


def test_an_instance_that_exits_before_registering_is_replaced_and_one_that_registers_resets(tmp_path, redis_client):
    run = Run(tmp_path, redis_client, "first-fails")
    with run.provider:
        run.look()
        run.provider.launch(pool("flaky"), 1)
        run.exited("flaky-0")
        run.watch.check()  # within WATCH_S of its last look: it does not look again
        assert run.watch.replaced == 0
        run.watch.check(force=True)  # a step's start or end: it looks now
        assert run.watch.replaced == 1 and run.watch.failure is None
        run.clock.advance(RESTART_BACKOFF_S)
        run.provider.tick()  # the provider starts the replacement after its back-off
        assert run.state("flaky-1") == ("running", None)
        run.register("flaky-1")
        run.look()
        run.look()
        assert run.watch.replaced == 1
        assert run.watch._in_a_row == {"flaky": 0}  # flaky-1 registered: the count starts again


def test_an_instance_that_never_registers_is_stopped_and_replaced(tmp_path, redis_client):
    run = Run(tmp_path, redis_client, "wait")
    with run.provider:
        run.provider.launch(pool("flaky"), 1)
        run.clock.advance(REGISTER_TIMEOUT_S - 2 * WATCH_S + 0.5)
        run.look()
        assert run.state("flaky-0") == ("running", None)  # not yet
        run.look()
        assert run.state("flaky-0") == ("terminating", "crashed")
        run.exited("flaky-0")
        assert run.provider.describe("flaky-0").exit_code == -9  # killed at once: it held nothing
        assert run.state("flaky-1") == ("running", None)  # replaced
        assert run.watch.replaced == 1 and run.provider.preemptions() == []


def test_a_pool_whose_instances_keep_failing_gives_up_with_the_last_error_on_one_line(tmp_path, redis_client):
    run = Run(tmp_path, redis_client, "fail")
    with run.provider:
        run.provider.launch(pool("flaky"), 1)
        for attempt in range(2):
            run.exited(f"flaky-{attempt}")
            run.look()
            run.clock.advance(RESTART_BACKOFF_S * 2**attempt)
            run.provider.tick()
        run.exited("flaky-2")
        with pytest.raises(PoolFailure) as failure:
            run.look()
        log = tmp_path / "logs" / "flaky-2.log"
        assert str(failure.value) == (
            "pool flaky: 3 instances in a row failed (fabric.max_instance_failures); the last, flaky-2, exited "
            "with status 3 0 s after its launch, before it registered: worker flaky-2 cannot start: its engine "
            f"failed: OSError: no model (its log: {log})"
        )
        with pytest.raises(PoolFailure):  # again at every look
            run.watch.check()
        assert run.watch.replaced == 3


def test_how_a_workers_flow_run_ended_decides_and_asked_ends_are_no_failures(tmp_path, redis_client):
    run = Run(tmp_path, redis_client, "wait")
    with run.provider:
        run.provider.launch(pool("spot", 3), 3)
        for instance_id in ("spot-0", "spot-1", "spot-2"):
            run.register(instance_id)
        run.look()
        now = run.clock()
        run.ends["spot-0"] = WorkerEnd("FAILED", "rlboost boot failed on spot-0: no python3", now)
        run.ends["spot-1"] = WorkerEnd("CRASHED", "preempted: SIGTERM received", now)
        run.ends["spot-2"] = WorkerEnd("COMPLETED", "drained", now)
        run.watch.expect_end("spot-2")  # asked to drain (a scale-down)
        run.look()
        assert run.state("spot-0") == ("terminating", "crashed")  # a Failed run: at once
        assert run.state("spot-1") == ("running", None)  # maybe a preemption the cloud reports later
        run.clock.advance(SETTLE_S)
        run.look()
        assert run.state("spot-1") == ("terminating", "crashed")
        assert run.state("spot-2") == ("running", None)
        assert run.watch.replaced == 2 and run.watch._in_a_row == {"spot": 2}
        run.provider.tick()
        run.provider.launch(pool("flaky"), 1)
        run.provider.terminate("flaky-0", "preempted")
        run.exited("flaky-0")
        run.look()
        assert run.watch.replaced == 2  # a preemption is not a failure


def test_an_instance_that_holds_no_accepted_version_for_stall_s_is_stopped_and_replaced(tmp_path, redis_client):
    """No source can supply a valid version 2: spot-0 stays on version 1 and is stopped and replaced
    `STALL_S` after it was first seen behind, while spot-1, slow but pulling each version, is not;
    a replacement that stalls too does not reset the pool's count of failures in a row."""
    run = Run(tmp_path, redis_client, "wait")
    with run.provider:
        run.provider.launch(pool("spot", 3), 2)
        for instance_id in ("spot-0", "spot-1"):
            run.register(instance_id)
            run.holds(instance_id, 1)
        run.accepted = 1
        run.look()
        assert run.watch._in_a_row == {"spot": 0}
        run.accepted = 2  # the next step opens: both instances are behind from this look on
        run.look()
        run.clock.advance(STALL_S / 2 - WATCH_S)
        run.holds("spot-1", None)  # spot-1 is loading a version (it moved): its clock starts again
        run.look()
        run.clock.advance(STALL_S / 2 - 2 * WATCH_S)
        run.look()
        assert run.state("spot-0") == ("running", None)  # not yet: STALL_S after it was first seen behind
        run.look()
        assert run.state("spot-0") == ("terminating", "crashed")  # killed like a failed instance
        assert run.state("spot-1") == ("running", None)
        assert run.watch.replaced == 1
        run.exited("spot-0")
        assert run.state("spot-2") == ("running", None)  # its replacement
        run.holds("spot-1", 2)
        run.register("spot-2")
        run.look()
        assert run.watch._in_a_row == {"spot": 1}  # spot-2 holds no accepted version: no reset
        run.clock.advance(STALL_S)
        run.look()
        assert run.state("spot-2") == ("terminating", "crashed") and run.state("spot-1") == ("running", None)
        assert run.watch.replaced == 2 and run.watch._in_a_row == {"spot": 2}
