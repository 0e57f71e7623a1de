"""A verifiers taskset (tests.rl.verifiers_calc, verifiers' own classes) through real rollout
worker processes on the token log: its trajectories complete with the rubric's reward, the tool
results logged as masked environment segments, and one preempted mid-tool-call (SIGKILL, the
verifiers tool waiting at a gate) ends token for token identical to an undisturbed one: the new
owner rebuilds the verifiers trace from the logged turns and runs the unanswered call again."""

from __future__ import annotations

import json
import signal
import uuid

import pytest
import redis

from infra.rollout.control import ReleaseAll, Resume
from infra.rollout.protocol import set_current_step
from infra.rollout.registry import InstanceRegistry
from infra.rollout.tokenlog import EnvironmentSpec, TokenLog
from rl.environments.registry import ENVIRONMENTS
from rl.environments.verifiers_env import write_tasks
from rl.models import load_model
from tests.helpers import wait_for
from tests.infra.rollout import agentic
from tests.infra.rollout.agentic import TWO_CALLS
from tests.infra.rollout.test_trajectory_preemption import Workers

pytestmark = pytest.mark.integration

STEP = 1
TASKSET = "tests.rl.verifiers_calc:CalcTaskset"


@pytest.fixture(scope="module")
def memorised(tmp_path_factory):
    return agentic.memorised_model(tmp_path_factory.mktemp("verifiers") / "model")


def _spec(key: str, config: dict) -> EnvironmentSpec:
    args = {"taskset": TASKSET, "config": config}
    return EnvironmentSpec(ENVIRONMENTS["verifiers"], prompt=TWO_CALLS[0], answer=key, args=args, max_turns=4)


def test_a_verifiers_trajectory_preempted_mid_tool_call_ends_as_an_undisturbed_one(redis_url, memorised, tmp_path):
    client = redis.Redis.from_url(redis_url)
    _, tokenizer = load_model(memorised)
    write_tasks(TASKSET, tmp_path / "tasks.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    (key,) = [row["answer"] for row in rows if row["prompt"] == TWO_CALLS[0]]
    runs = {"undisturbed": f"vref-{uuid.uuid4().hex[:6]}", "preempted": f"vpre-{uuid.uuid4().hex[:6]}"}
    logs = {name: TokenLog(client, run_id) for name, run_id in runs.items()}
    registry = InstanceRegistry(client, runs["preempted"])
    workers = Workers(redis_url, tmp_path, memorised)
    gate, calls = tmp_path / "gate", tmp_path / "calls.txt"
    first_turn = agentic.model_turns(TWO_CALLS)[0]
    results = [tokenizer.encode(agentic.FORMAT.render(r), add_special_tokens=False) for r in TWO_CALLS[3]]
    try:
        workers.spawn("ref", runs["undisturbed"])
        for name in ("a", "b"):
            workers.spawn(name, runs["preempted"])
        wait_for(
            lambda: (
                workers.running()
                and len(InstanceRegistry(client, runs["undisturbed"]).alive()) == 1
                and len(registry.alive()) == 2
            ),
            "three workers registered",
            timeout_s=240,
        )
        ref = logs["undisturbed"]
        assert ref.enqueue_step(STEP, 0, [agentic.group(0, TWO_CALLS, 2, tokenizer, _spec(key, {}))])
        assert set_current_step(client, runs["undisturbed"], STEP, 0)
        wait_for(lambda: ref.step_status(STEP).complete, "the undisturbed step", timeout_s=120)

        log = logs["preempted"]
        registry.request("b", ReleaseAll(STEP))
        gated = _spec(key, {"task": {"gate": str(gate), "calls": str(calls)}})
        assert log.enqueue_step(STEP, 0, [agentic.group(0, TWO_CALLS, 2, tokenizer, gated)])
        assert set_current_step(client, runs["preempted"], STEP, 0)

        def calling() -> bool:  # both turns 0 logged with their call, the verifiers tool at the gate
            records = log.read_group(STEP, 0)
            logged = all(r.turns == () and tokenizer.decode(r.token_ids) == first_turn for r in records)
            return logged and calls.exists() and calls.read_text().count("waiting 12+345") == 2

        wait_for(calling, "worker a's tool calls", timeout_s=120)
        assert workers.signal("a", signal.SIGKILL) == -signal.SIGKILL
        assert log.reap("a", max_reaps=5) == 2
        gate.touch()
        registry.request("b", Resume())
        wait_for(lambda: log.step_status(STEP).complete, "worker b finishing", timeout_s=120)

        for want, got in zip(ref.read_group(STEP, 0), log.read_group(STEP, 0)):
            assert tokenizer.decode(want.token_ids, skip_special_tokens=True) == agentic.transcript(TWO_CALLS)
            assert got.token_ids == want.token_ids and got.turns == want.turns  # token for token
            assert got.loss_mask() == want.loss_mask()
            assert got.loss_mask().count(0) == sum(map(len, results))  # the tool results, masked
            for (start, end), result in zip(_segments(got), results):
                assert got.token_ids[start:end] == result
            assert got.outcome is not None and got.outcome.reward == 1.0 + 0.25 * 2  # the verifiers rubric
            assert got.migrations == 1
        lines = calls.read_text().splitlines()
        assert lines.count("called 12+345") == 2 and lines.count("called 357+67+89") == 2
    except BaseException:
        for name in workers.procs:
            print(f"--- worker {name} ---\n{workers.log(name)}")
        raise
    finally:
        workers.stop()
        client.close()


def _segments(record) -> list[tuple[int, int]]:
    """(start, end) of each run of masked tokens."""
    mask, spans, start = record.loss_mask(), [], None
    for i, bit in enumerate([*mask, 1]):
        if bit == 0 and start is None:
            start = i
        elif bit and start is not None:
            spans.append((start, i))
            start = None
    return spans
