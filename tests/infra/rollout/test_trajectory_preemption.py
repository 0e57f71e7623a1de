"""A trajectory preempted mid-tool-call (SIGKILL) and mid-turn (SIGTERM) through real worker
processes ends token for token identical to an undisturbed one: keyed sampling, the memorised tiny
model and the deterministic calculator; the new owner rebuilds the environment from the logged
turns and steps a turn logged without its result with the same `StepKey`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from infra.rollout.control import ReleaseAll, Resume
from infra.rollout.protocol import set_current_step
from infra.rollout.registry import InstanceRegistry
from infra.rollout.tokenlog import SampleRecord, TokenLog
from rl.models import load_model
from tests.helpers import REPO_ROOT, process_state, wait_for
from tests.infra.rollout import agentic
from tests.infra.rollout.agentic import FORMAT, TWO_CALLS

pytestmark = pytest.mark.integration

STEP = 1
GATED = "tests.infra.rollout.agentic:GatedCalculator"
SLICE_S = 0.005
"""How long a paused worker runs at a time in `Workers.run_until`."""


class Workers:
    """Rollout worker processes on the memorised model, each in its own process group."""

    def __init__(self, url: str, root: Path, model: Path) -> None:
        self.url, self.root, self.model = url, root, model
        self.procs: dict[str, subprocess.Popen] = {}

    def spawn(self, name: str, run_id: str) -> None:
        command = [
            sys.executable,
            "-m",
            "infra.rollout.worker",
            *("--run-id", run_id, "--redis-url", self.url, "--model", str(self.model), "--instance-id", name),
            *("--slots", "4", "--flush-tokens", "2", "--flush-ms", "5", "--heartbeat-s", "0.5", "--ttl-s", "3"),
            *("--poll-ms", "20", "--pool", "local-spot", "--capacity-class", "spot"),
        ]
        with (self.root / f"{name}.log").open("wb") as out:
            self.procs[name] = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def running(self) -> bool:
        """True while every worker runs (raises with its log when one exited)."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"worker {name} exited ({proc.returncode}):\n{self.log(name)}")
        return True

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")[-3000:]

    def signal(self, name: str, signum: int) -> int:
        os.killpg(self.procs[name].pid, signum)
        return self.procs[name].wait(timeout=30)

    def pause(self, name: str) -> None:
        """Stop worker `name` (SIGSTOP to its group); return once it is stopped."""
        pid = self.procs[name].pid
        os.killpg(pid, signal.SIGSTOP)
        wait_for(lambda: process_state(pid) == "T", f"worker {name} stopped", timeout_s=30)

    def run_until(self, name: str, condition: Callable[[], object], what: str, timeout_s: float) -> None:
        """Let the paused worker `name` run `SLICE_S` at a time until `condition()` holds between two
        slices, and leave it paused there: however loaded the host, it cannot run on past the moment
        the condition came true (a worker left running finished a whole turn between a test's look
        and its signal, 2026-12-06)."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
            os.killpg(self.procs[name].pid, signal.SIGCONT)
            time.sleep(SLICE_S)
            self.pause(name)

    def terminate_paused(self, name: str) -> int:
        """SIGTERM the paused worker `name`, let it handle the signal, and return its exit code."""
        os.killpg(self.procs[name].pid, signal.SIGTERM)
        os.killpg(self.procs[name].pid, signal.SIGCONT)
        return self.procs[name].wait(timeout=30)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def memorised(tmp_path_factory) -> Path:
    return agentic.memorised_model(tmp_path_factory.mktemp("agentic") / "model")


def _turn_text(record: SampleRecord, tokenizer, index: int, rendered: list[int]) -> str:
    """The text of model turn `index` (0 or 1) as logged so far."""
    if index == 0:
        return tokenizer.decode(record.token_ids[: record.turns[0].end if record.turns else None])
    return tokenizer.decode(record.token_ids[record.turns[0].end + len(rendered) :])


def test_a_trajectory_preempted_mid_tool_call_and_mid_turn_ends_as_an_undisturbed_one(redis_url, memorised, tmp_path):
    client = redis.Redis.from_url(redis_url)
    _, tokenizer = load_model(memorised)
    runs = {"undisturbed": f"ref-{uuid.uuid4().hex[:6]}", "preempted": f"pre-{uuid.uuid4().hex[:6]}"}
    logs = {name: TokenLog(client, run_id) for name, run_id in runs.items()}
    registry = InstanceRegistry(client, runs["preempted"])
    workers = Workers(redis_url, tmp_path, memorised)
    gate, calls = tmp_path / "gate0", tmp_path / "calls.txt"
    turns = agentic.model_turns(TWO_CALLS)
    rendered = tokenizer.encode(FORMAT.render(TWO_CALLS[3][0]), add_special_tokens=False)
    try:
        workers.spawn("ref", runs["undisturbed"])
        for name in ("a", "b", "c"):
            workers.spawn(name, runs["preempted"])
        wait_for(
            lambda: (
                workers.running()
                and len(InstanceRegistry(client, runs["undisturbed"]).alive()) == 1
                and len(registry.alive()) == 3
            ),
            "four workers registered",
            timeout_s=240,
        )
        for name, env in (
            ("undisturbed", agentic.environment(TWO_CALLS, GATED)),
            ("preempted", agentic.environment(TWO_CALLS, GATED, args={"gates": [str(gate)], "calls": str(calls)})),
        ):
            if name == "preempted":
                for sitting_out in ("b", "c"):
                    registry.request(sitting_out, ReleaseAll(STEP))
            assert logs[name].enqueue_step(STEP, 0, [agentic.group(0, TWO_CALLS, 2, tokenizer, env)])
            assert set_current_step(client, runs[name], STEP, 0)
            if name == "undisturbed":
                wait_for(lambda: logs[name].step_status(STEP).complete, "the undisturbed step", timeout_s=120)
        log = logs["preempted"]

        # Mid-tool-call: both turns 0 logged with their call, the calls waiting at the gate.
        def calling() -> bool:
            records = log.read_group(STEP, 0)
            return all(r.turns == () and tokenizer.decode(r.token_ids) == turns[0] for r in records)

        wait_for(calling, "worker a's tool calls", timeout_s=120)
        assert workers.signal("a", signal.SIGKILL) == -signal.SIGKILL
        assert log.reap("a", max_reaps=5) == 2
        gate.touch()
        workers.pause("b")
        registry.request("b", Resume())

        # Mid-turn: the call answered, turn 1 under way on worker b (paused there, then SIGTERMed).
        def turning() -> bool:
            return any(
                len(r.turns) == 1 and len(r.token_ids) > r.turns[0].end + len(rendered) + 2
                for r in log.read_group(STEP, 0)
            )

        workers.run_until("b", turning, "worker b's second turn", timeout_s=120)
        assert workers.terminate_paused("b") == 0, workers.log("b")
        handed_back = log.read_group(STEP, 0)
        assert all(r.state == "queued" for r in handed_back)
        mid_turn = [r for r in handed_back if len(r.turns) == 1 and _turn_text(r, tokenizer, 1, rendered) != turns[1]]
        assert mid_turn, "worker b's SIGTERM landed after the second turn ended"
        assert all(turns[1].startswith(_turn_text(r, tokenizer, 1, rendered)) for r in mid_turn)
        registry.request("c", Resume())
        wait_for(lambda: log.step_status(STEP).complete, "worker c finishing", timeout_s=120)

        undisturbed = logs["undisturbed"].read_group(STEP, 0)
        preempted = log.read_group(STEP, 0)
        for want, got in zip(undisturbed, preempted):
            assert tokenizer.decode(want.token_ids, skip_special_tokens=True) == agentic.transcript(TWO_CALLS)
            assert got.token_ids == want.token_ids  # token for token
            assert got.loss_mask() == want.loss_mask() and got.turns == want.turns
            assert got.outcome == want.outcome and got.outcome is not None and got.outcome.reward == 1.0
            assert got.migrations == 2
        # Worker a's call of turn 0 never returned; worker b made it again with the same key.
        lines = calls.read_text().splitlines()
        for record in preempted:
            assert lines.count(f"waiting {record.sample_id} 0") >= 2 and f"called {record.sample_id} 0" in lines
    except BaseException:
        for name in workers.procs:
            print(f"--- worker {name} ---\n{workers.log(name)}")
        raise
    finally:
        workers.stop()
        client.close()
    print(f"\nmid-turn migrations: {len(mid_turn)} of 2; environment calls: {len(lines)} lines")
