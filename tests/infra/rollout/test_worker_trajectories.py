"""Multi-turn trajectories through a rollout worker (in process, a real HF engine on a tiny model
that memorised two calculator trajectories, a real redis-server): model turns and environment
segments alternate in the token log, rendered once and masked; the engine decodes other samples
while a tool call waits; a ``release_all`` hands a trajectory in a tool call back after its answer
is logged; the trained token ids are the logged ones; infrastructure failures are
retried, then fail the sample (`renormalize` keeps its group); a single-turn group is unchanged."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest
import redis

from infra.rollout.control import ReleaseAll, Resume
from infra.rollout.controller import samples_of_group
from infra.rollout.instance import InstanceSpec
from infra.rollout.protocol import set_current_step
from infra.rollout.tokenlog import ENV_VERSION, GroupSpec, LoggedTurn, Outcome, TokenLog
from infra.rollout.worker import RolloutWorker, WorkerConfig, WorkerMode
from rl.config import GRPOConfig, OptimConfig
from rl.generation import GenerationRequest, SamplingParams
from rl.models import load_model
from rl.rollout import read_samples, write_samples
from rl.stops import StopStrings
from rl.streaming import train_batch
from rl.trainer import Trainer
from tests.helpers import hf_on_cpu, wait_for
from tests.infra.rollout import agentic
from tests.infra.rollout.agentic import FORMAT, ONE_CALL, TWO_CALLS

pytestmark = pytest.mark.integration

STEP = 1


@pytest.fixture(scope="module")
def memorised(tmp_path_factory) -> Path:
    return agentic.memorised_model(tmp_path_factory.mktemp("agentic") / "model")


class Fabric:
    """One run's token log and an in-process worker on the memorised model."""

    def __init__(self, redis_url: str, model_dir: Path, slots: int = 8) -> None:
        self.client = redis.Redis.from_url(redis_url)
        self.run_id = f"traj-{uuid.uuid4().hex[:8]}"
        self.log = TokenLog(self.client, self.run_id)
        self.model, self.tokenizer = load_model(model_dir)
        engine = StopStrings(
            hf_on_cpu(self.model, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, max_batch_size=slots),
            self.tokenizer,
        )
        self.engine = engine
        config = WorkerConfig(
            redis_url=redis_url,
            run_id=self.run_id,
            instance=InstanceSpec(instance_id="w", pool="local-spot"),
            model_path=str(model_dir),
            slots=slots,
            flush_tokens=2,
            flush_ms=5,
            heartbeat_s=0.2,
            ttl_s=10,
            poll_ms=10,
        )
        self.worker = RolloutWorker(config, client=redis.Redis.from_url(redis_url), engine=engine)
        self.thread = threading.Thread(target=self.worker.run, daemon=True)

    def run(self, groups: list[GroupSpec]) -> None:
        self.log.enqueue_step(STEP, 0, groups)
        set_current_step(self.client, self.run_id, STEP, 0)
        self.thread.start()

    def stop(self) -> None:
        self.worker.request_stop("test over")
        self.thread.join(timeout=20)

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.fixture
def fabric(redis_url, memorised):
    fabrics: list[Fabric] = []

    def make(**kwargs) -> Fabric:
        fabrics.append(Fabric(redis_url, memorised, **kwargs))
        return fabrics[-1]

    yield make
    for made in fabrics:
        made.stop()


def test_a_trajectory_logs_its_turns_and_the_environments_answers(fabric, tmp_path):
    f = fabric()
    f.run([agentic.group(0, TWO_CALLS, 2, f.tokenizer, agentic.environment(TWO_CALLS))])
    wait_for(lambda: f.log.step_status(STEP).complete, "the trajectories", timeout_s=120)
    records = f.log.read_group(STEP, 0)
    rendered = [f.tokenizer.encode(FORMAT.render(r), add_special_tokens=False) for r in TWO_CALLS[3]]
    turns = agentic.model_turns(TWO_CALLS)
    for record in records:
        assert record.state == "done" and f.text(record.token_ids) == agentic.transcript(TWO_CALLS)
        first = len(turns[0])
        second = first + len(rendered[0]) + len(turns[1])
        assert record.turns == (LoggedTurn(first, "357"), LoggedTurn(second, "513"))
        # Each environment segment is the observation rendered and encoded once, masked, logprob 0.
        assert record.token_ids[first : first + len(rendered[0])] == rendered[0]
        mask = record.loss_mask()
        env = [i for i, m in enumerate(mask) if not m]
        assert env == [*range(first, first + len(rendered[0])), *range(second, second + len(rendered[1]))]
        assert all(record.logprobs[i] == 0.0 for i in env) and all(record.logprobs[i] < 0 for i in range(first))
        assert [v for _, v in record.version_spans] == [ENV_VERSION, 0, ENV_VERSION, 0]
        assert record.outcome == Outcome(reward=1.0) and record.finish_reason == "stop"
    assert f.worker.stats.env_steps == 6 and f.worker.stats.finished == 2
    # No retokenization: through the rollout file and the batch, the trainer's targets are the log's ids.
    samples = samples_of_group(records)
    write_samples(tmp_path / "rollout.jsonl", samples)
    batch = train_batch(read_samples(tmp_path / "rollout.jsonl"), [1.0, -1.0])
    seen = []

    class Probe(Trainer):
        def _logprobs(self, model, packed):
            seen.append(packed)
            return super()._logprobs(model, packed)

    Probe(
        f.model, f.tokenizer.pad_token_id, GRPOConfig(), OptimConfig(), temperature=1.0, gradient_checkpointing=False
    ).train_step(batch)
    for row, record in enumerate(records):
        trained = seen[0].response_mask[row].bool()
        assert seen[0].targets[row, : len(record.token_ids)].tolist() == record.token_ids
        assert seen[0].targets[row][trained].tolist() == [t for t, m in zip(record.token_ids, record.loss_mask()) if m]


def test_the_engine_decodes_other_samples_while_a_tool_call_waits(fabric, tmp_path):
    f = fabric()
    gate = tmp_path / "gate"
    held = agentic.environment(ONE_CALL, "tests.infra.rollout.agentic:GatedCalculator", args={"gates": [str(gate)]})
    f.run(
        [
            agentic.group(0, ONE_CALL, 1, f.tokenizer, held),
            agentic.group(1, TWO_CALLS, 2, f.tokenizer, agentic.environment(TWO_CALLS)),
        ]
    )
    wait_for(lambda: f.log.step_status(STEP).groups_done == 1, "the trajectories without a gate", timeout_s=120)
    (waiting,) = f.log.read_group(STEP, 0)
    assert waiting.state == "running" and waiting.turns == ()
    assert f.text(waiting.token_ids) == agentic.model_turns(ONE_CALL)[0]  # its call, logged, waits
    gate.touch()
    wait_for(lambda: f.log.step_status(STEP).complete, "the gated trajectory", timeout_s=60)
    assert f.text(f.log.read_group(STEP, 0)[0].token_ids) == agentic.transcript(ONE_CALL)


def test_release_all_hands_a_trajectory_in_a_tool_call_back_once_its_answer_is_logged(fabric, tmp_path):
    """At `T_local` a reserved instance releases its samples; a trajectory whose tool call runs stays
    until the answer is logged, then goes back with it (the call is not cut off to be made again), and
    the instance that claims it next continues from the answer to the undisturbed transcript."""
    f = fabric()
    gate, calls = tmp_path / "gate", tmp_path / "calls"
    gated = agentic.environment(
        ONE_CALL, "tests.infra.rollout.agentic:GatedCalculator", args={"gates": [str(gate)], "calls": str(calls)}
    )
    f.run([agentic.group(0, ONE_CALL, 1, f.tokenizer, gated)])
    wait_for(lambda: calls.exists() and "waiting" in calls.read_text(), "the tool call", timeout_s=120)
    assert f.worker.registry.request("w", ReleaseAll(STEP))
    wait_for(lambda: f.worker.mode in (WorkerMode.RELEASED, WorkerMode.ASLEEP), "the release", timeout_s=30)
    (record,) = f.log.read_group(STEP, 0)
    assert record.state == "running" and record.turns == ()  # kept while its call runs
    gate.touch()
    wait_for(lambda: f.log.read_group(STEP, 0)[0].state == "queued", "the hand-back", timeout_s=30)
    (record,) = f.log.read_group(STEP, 0)
    first = f.tokenizer.encode(agentic.model_turns(ONE_CALL)[0], add_special_tokens=False)
    answer = f.tokenizer.encode(FORMAT.render(ONE_CALL[3][0]), add_special_tokens=False)
    assert record.turns == (LoggedTurn(len(record.token_ids) - len(answer), "15012"),)
    assert record.token_ids[-len(answer) :] == answer and f.text(record.token_ids[: -len(answer)]) == f.text(first)
    assert f.worker.stats.released == 1 and f.worker.held == {}
    assert calls.read_text().splitlines() == [f"waiting {STEP}/0/0 0", f"called {STEP}/0/0 0"]
    assert f.worker.registry.request("w", Resume(STEP))
    wait_for(lambda: f.log.step_status(STEP).complete, "the trajectory", timeout_s=60)
    (record,) = f.log.read_group(STEP, 0)
    assert f.text(record.token_ids) == agentic.transcript(ONE_CALL) and record.attempts == 2


@pytest.mark.parametrize(
    ("kind", "times", "counted"), [("raise", 1, None), ("raise", 5, "env_error"), ("gone", 5, "env_gone")]
)
def test_infrastructure_failures_are_retried_then_fail_the_sample_never_scored(fabric, kind, times, counted):
    agentic.FAILURES.clear()
    f = fabric()
    failing = agentic.environment(
        ONE_CALL, "tests.infra.rollout.agentic:FailingCalculator", args={"kind": kind, "times": times}, retries=2
    )
    renormalized = agentic.group(0, ONE_CALL, 2, f.tokenizer, failing, infra_failed="renormalize")
    plain = agentic.group(1, TWO_CALLS, 1, f.tokenizer, agentic.environment(TWO_CALLS))
    f.run([renormalized, plain])
    wait_for(lambda: f.log.step_status(STEP).complete, "the step", timeout_s=120)
    status = f.log.step_status(STEP)
    records = f.log.read_group(STEP, 0)
    if counted is None:  # one failure, retried: the trajectory is the undisturbed one
        assert status.infra_failed == {} and f.worker.stats.env_retries == 2
        assert all(f.text(r.token_ids) == agentic.transcript(ONE_CALL) for r in records)
        return
    assert status.infra_failed == {counted: 2} and f.worker.stats.env_retries == 4
    assert [r.finish_reason for r in records] == [f"infra:{counted}"] * 2
    assert status.dropped_group_ids == (0,) and status.groups_done == 1  # nothing left to renormalize


def test_an_environment_that_cannot_replay_restarts_its_trajectory_after_a_failure(fabric):
    """The second tool call fails once; the environment cannot rebuild the first call's state, so the
    trajectory starts again from scratch (its tokens discarded) and ends as an undisturbed one."""
    agentic.FAILURES.clear()
    f = fabric()
    forgetful = agentic.environment(
        TWO_CALLS, "tests.infra.rollout.agentic:ForgetfulCalculator", args={"turn": 1}, retries=1
    )
    f.run([agentic.group(0, TWO_CALLS, 1, f.tokenizer, forgetful)])
    wait_for(lambda: f.log.step_status(STEP).complete, "the step", timeout_s=120)
    (record,) = f.log.read_group(STEP, 0)
    assert f.text(record.token_ids) == agentic.transcript(TWO_CALLS) and record.attempts == 2
    assert f.log.stats().wasted_tokens > 0 and f.worker.stats.env_retries == 1


def test_a_step_past_its_timeout_fails_and_renormalize_keeps_the_rest_of_the_group(fabric):
    agentic.FAILURES.clear()
    f = fabric()
    hanging = agentic.environment(
        ONE_CALL,
        "tests.infra.rollout.agentic:FailingCalculator",
        args={"kind": "hang", "only": "/0"},
        retries=0,
        step_timeout_s=0.5,
    )
    agentic.RELEASE_HUNG.clear()
    try:
        f.run(
            [
                agentic.group(0, ONE_CALL, 2, f.tokenizer, hanging, infra_failed="renormalize"),
                agentic.group(1, ONE_CALL, 2, f.tokenizer, hanging),
            ]
        )
        wait_for(lambda: f.log.step_status(STEP).complete, "the step", timeout_s=120)
    finally:
        agentic.RELEASE_HUNG.set()
    status = f.log.step_status(STEP)
    assert status.infra_failed == {"env_timeout": 2} and f.worker.stats.infra_failed == 2
    assert status.dropped_group_ids == (1,) and status.groups_done == 1
    (kept,) = samples_of_group(f.log.read_group(STEP, 0))  # the hung trajectory is left out, unscored
    assert kept.sample_id == f"{STEP}/0/1" and f.text(kept.response_ids) == agentic.transcript(ONE_CALL)


def test_a_single_turn_group_gets_the_engines_tokens_as_before(fabric, memorised):
    f = fabric()
    prompt = f.tokenizer.encode(ONE_CALL[0])
    f.run([GroupSpec(0, prompt, 3, 30, seed=9, sampling={"temperature": 1.0})])
    wait_for(lambda: f.log.step_status(STEP).complete, "the step", timeout_s=60)
    model, tokenizer = load_model(memorised)
    reference = hf_on_cpu(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_batch_size=8)
    requests = [
        GenerationRequest(f"{STEP}/0/{i}", prompt, 30, seed=9, sampling=SamplingParams(temperature=1.0))
        for i in range(3)
    ]
    expected = reference.generate(requests)
    samples = samples_of_group(f.log.read_group(STEP, 0))
    assert [s.response_ids for s in samples] == [r.token_ids for r in expected]
    for sample in samples:
        assert (sample.loss_mask, sample.turns, sample.env_reward, sample.truncated) == ([], [], None, False)
