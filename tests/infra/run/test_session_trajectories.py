"""Multi-turn trajectories through the training session (fabric: an embedded Redis, a co-located
instance; the tiny model that memorised two calculator trajectories): one step rolls out, scores
and trains them, the environment of one trajectory per group failing every try
(`training.infra_failed: renormalize`): the step counts it by kind, scores the rest, and trains
exactly their model tokens."""

from __future__ import annotations

import json

import pytest

from infra.run.config import load_config
from infra.run.session import TrainingSession
from infra.run.step_record import StepRecord
from rl.rollout import read_samples
from tests.helpers import RESERVED_POOL, tiny_run
from tests.infra.rollout import agentic
from tests.infra.rollout.agentic import ONE_CALL, TWO_CALLS

pytestmark = pytest.mark.integration

FAILING = {
    "class": "tests.infra.rollout.agentic:FailingCalculator",
    "args": {"kind": "raise", "times": 9, "only": "/0"},
}


def _data(root) -> dict[str, str]:
    lines = "".join(json.dumps({"prompt": p[0], "answer": p[1]}) + "\n" for p in (ONE_CALL, TWO_CALLS))
    for name in ("train", "eval"):
        (root / f"{name}.jsonl").write_text(lines)
    return {"data.source": "file", "data.path": str(root / "train.jsonl"), "data.eval_path": str(root / "eval.jsonl")}


def test_a_step_of_trajectories_counts_infra_failures_and_trains_only_model_tokens(tmp_path):
    agentic.FAILURES.clear()
    model = agentic.memorised_model(tmp_path / "model")
    overrides = {
        **_data(tmp_path),
        "environment": {**FAILING, "retries": 1, "max_turns": 4},
        "training.infra_failed": "renormalize",
        "fabric.pools": [{**RESERVED_POOL, "colocated": True}],
        "rollout.max_new_tokens": 400,
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 3,
        "eval.size": 2,
        "ledger.url": f"sqlite:///{tmp_path / 'ledger.sqlite'}",
    }
    session = TrainingSession(load_config(None, tiny_run(model, tmp_path, "trajectories", None, overrides)))
    try:
        assert "</call>" in session.rollout_prompt.stop  # the tool format's stop string rides along
        rollout = session.rollout(1)
        assert rollout["infra_failed"] == {"env_error": 2} and rollout["groups_dropped"] == 0
        samples = read_samples(rollout["path"])
        assert [s.sample_id for s in samples] == ["1/0/1", "1/0/2", "1/1/1", "1/1/2"]
        for sample in samples:
            prompt = session.tokenizer.decode(sample.prompt_ids, skip_special_tokens=True)
            problem = ONE_CALL if prompt == ONE_CALL[0] else TWO_CALLS
            text = session.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
            assert text == agentic.transcript(problem) and sample.env_reward == 1.0
            assert len(sample.turns) == len(problem[2]) and 0 in sample.loss_mask
        scores = session.score(1, rollout["path"])
        assert scores["reward"] == 1.0 and scores["accuracy"] == 1.0
        metrics = session.train(1, rollout["path"], scores["path"])
        assert metrics["response_tokens"] == sum(sum(s.trained()) for s in samples)
        assert metrics["response_tokens"] < sum(len(s.response_ids) for s in samples)
        assert metrics["version_lag_histogram"] == {"0": metrics["response_tokens"]}  # env tokens: no version
        counts = {k: v for k, v in rollout.items() if k not in ("path", "tokens", "seconds")}
        session.record(StepRecord(step=1, reward=scores["reward"], tokens=rollout["tokens"], **counts))
        written = json.loads(session.paths(1).metrics.read_text())
        assert written["infra_failed"] == {"env_error": 2}
    finally:
        session.close()


def test_trajectories_need_the_fabric(tmp_path):
    overrides = {"environment": {"name": "calculator"}, "fabric.enabled": False}
    with pytest.raises(Exception, match="multi-turn trajectories run on the fabric's rollout instances"):
        load_config(None, tiny_run(tmp_path / "model", tmp_path, "no-fabric", None, overrides))
