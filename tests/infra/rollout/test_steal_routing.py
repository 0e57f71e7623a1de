"""A steal lands on the receiver the policy chose, exactly once: real rollout worker processes
(`RolloutWorker` with a scripted engine, each its own process, stopped by SIGTERM) against a real
redis-server and a real `RolloutController`.

The victim `a` runs four long samples; `b` (one slot, a slow claimer) and `c` (eight slots, a fast
one) are idle. The policy gives one sample to `b` (the least loaded; ties by id) and one to `c`.
Through the shared queue the fast `c` would claim both; routed, each goes to its receiver.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from infra.rollout.control import ControlMessage, Release
from infra.rollout.controller import RolloutController
from infra.rollout.controller_config import ControllerConfig
from infra.rollout.policies import StealConfig
from infra.rollout.protocol import set_current_step
from infra.rollout.registry import InstanceRegistry
from infra.rollout.tokenlog import GroupSpec, SampleRecord, TokenLog
from tests.fakes.engine import scripted_response
from tests.helpers import REPO_ROOT, wait_for

pytestmark = pytest.mark.integration

LENGTH = 600
"""Response tokens of every sample."""
VICTIM_STEP_S = 0.05
"""The victim's decode step: 30 s per sample, far longer than the receivers take to start."""

_WORKER_PROCESS = """
import json, sys
from infra.rollout.worker import RolloutWorker, WorkerConfig
from tests.fakes.engine import ScriptedEngine
spec = json.loads(sys.argv[1])
worker = RolloutWorker(
    WorkerConfig(**spec["config"]),
    engine=ScriptedEngine(lambda sample_id: spec["length"], step_s=spec["step_s"]),
)
worker.install_signal_handlers()
sys.exit(worker.run())
"""


def spawn(root: Path, redis_url: str, run_id: str, instance_id: str, *, slots: int, step_s: float, poll_ms: int):
    config = {
        "redis_url": redis_url,
        "run_id": run_id,
        "instance": {"instance_id": instance_id, "pool": "local-spot", "capacity_class": "spot"},
        "model_path": "(scripted engine)",
        "slots": slots,
        "flush_tokens": 1,
        "flush_ms": 5,
        "heartbeat_s": 0.1,
        "ttl_s": 10,
        "poll_ms": poll_ms,
    }
    spec = json.dumps({"config": config, "length": LENGTH, "step_s": step_s})
    with (root / f"{instance_id}.log").open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-c", _WORKER_PROCESS, spec],
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def ignore(group_id: int, records: list[SampleRecord]) -> None:
    pass


def test_stolen_samples_land_on_the_chosen_receiver_exactly_once(redis_client, redis_url, tmp_path, monkeypatch):
    run_id = f"steal-{os.urandom(4).hex()}"
    sent: dict[str, list[ControlMessage]] = defaultdict(list)
    deliver = InstanceRegistry.request

    def recording(registry: InstanceRegistry, instance_id: str, command: ControlMessage) -> bool:
        delivered = deliver(registry, instance_id, command)
        if delivered:
            sent[instance_id].append(command)
        return delivered

    monkeypatch.setattr(InstanceRegistry, "request", recording)
    log = TokenLog(redis_client, run_id)
    groups = [GroupSpec(0, [1, 2, 3], 4, LENGTH)]
    assert log.enqueue_step(0, 0, groups) and set_current_step(redis_client, run_id, 0, 0)
    procs = {"a": spawn(tmp_path, redis_url, run_id, "a", slots=4, step_s=VICTIM_STEP_S, poll_ms=20)}
    registry = InstanceRegistry(redis_client, run_id)
    try:
        wait_for(lambda: len(log.running("a")) == 4, "a to claim all four", timeout_s=60)
        # b, still busy with its one sample when c has finished the rest, is never a receiver again
        procs["b"] = spawn(tmp_path, redis_url, run_id, "b", slots=1, step_s=0.02, poll_ms=400)
        procs["c"] = spawn(tmp_path, redis_url, run_id, "c", slots=8, step_s=0.005, poll_ms=10)
        wait_for(
            lambda: {i.spec.instance_id for i in registry.all() if i.policy_version == 0} == {"a", "b", "c"},
            "b and c to register",
            timeout_s=60,
        )
        steal = StealConfig(min_remaining_tokens=1, cooldown_s=600, route_s=30)
        controller = RolloutController(redis_client, run_id, ControllerConfig(poll_s=0.05, steal=steal))
        with ThreadPoolExecutor(max_workers=1) as background:
            done = background.submit(controller.run_step, 0, 0, groups, ignore)

            def routes() -> dict[str, str | None]:
                return {sid: m.to for m in list(sent["a"]) if isinstance(m, Release) for sid in m.sample_ids or ()}

            # one steal is two messages (one per receiver), sent one after the other
            wait_for(lambda: len(routes()) >= 2 or done.done(), "the steal")
            routed = routes()

            def owner(sid: str) -> str:
                return log.sample_owners([sid])[0]

            wait_for(lambda: all(owner(s) == to for s, to in routed.items()), "the receivers to claim", timeout_s=30)
            procs["a"].send_signal(signal.SIGTERM)  # a preemption: its other two go to the shared queue
            report = done.result(timeout=60)
        for name in ("b", "c"):
            procs[name].send_signal(signal.SIGTERM)
        for name, proc in procs.items():
            assert proc.wait(timeout=30) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    assert sorted(routed.values()) == ["b", "c"], "one sample for each idle instance (4/0/0 -> 2/1/1)"
    assert report.steals == 2 and report.groups_done == 1
    records = {r.sample_id: r for r in log.read_group(0, 0)}
    for sid, record in records.items():
        assert record.state == "done" and record.token_ids == scripted_response(sid, LENGTH), sid
    for sid, receiver in routed.items():
        assert owner(sid) == receiver, f"{sid} was stolen for {receiver}"
        assert (records[sid].attempts, records[sid].migrations) == (2, 1), "claimed once after the steal"
    assert log.completions(0) == 1, "the group completed once"
