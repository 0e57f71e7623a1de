"""A training session with the DeepSpeed trainer (infra/run/session.py + rl/distributed/): steps,
evaluation on the gathered policy, bf16 with gradient checkpointing, and a rank killed mid-step
whose run resumes from its last checkpoint, and LoRA adapters trained on the ranks."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from infra.run.config import load_config
from infra.run.session import TrainingSession
from infra.run.step_record import StepRecord
from rl.distributed.group import RankFailure
from rl.lora import adapter_state
from tests.helpers import save_tiny_model, tiny_run, tiny_shape

pytestmark = pytest.mark.integration


def _config(tmp_path, **overrides):
    base = tmp_path / "base"
    if not base.exists():
        save_tiny_model(base, tiny_shape())
    return load_config(
        None,
        tiny_run(
            base,
            tmp_path,
            "deepspeed",
            None,
            {
                "fabric.enabled": False,
                "optim.lr": 1e-2,
                "optim.micro_batch_size": 4,
                "trainer.backend": "deepspeed",
                "trainer.world_size": 2,
                "trainer.threads_per_rank": 1,
                "ledger.url": f"sqlite:///{tmp_path / 'ledger.sqlite'}",
                **overrides,
            },
        ),
    )


def _step(session: TrainingSession, step: int) -> dict:
    rollout = session.rollout(step)
    scores = session.score(step, rollout["path"])
    metrics = session.train(step, rollout["path"], scores["path"])
    session.record(StepRecord(step=step, reward=scores["reward"], tokens=rollout["tokens"]))
    return metrics


def test_a_killed_rank_fails_the_step_and_the_rerun_resumes_from_the_checkpoint(tmp_path):
    config = _config(tmp_path)
    session = TrainingSession(config)
    try:
        assert session.model is None  # the policy lives in the ranks
        for step in (1, 2):
            metrics = _step(session, step)
            assert metrics["response_tokens"] > 0  # (an untrained model earns no reward: zero gradients)
        assert 0.0 <= session.evaluate() <= 1.0
        assert session.engine.policy_version == 2
        session.checkpoint()
        at_checkpoint = {k: v.clone() for k, v in session.trainer.policy_state().items()}
        rollout = session.rollout(3)
        scores = session.score(3, rollout["path"])
        os.kill(session.trainer.group.pids[0], signal.SIGKILL)
        with pytest.raises(RankFailure, match=r"rank 0 .* killed by SIGKILL .*'(begin|accumulate|finish)'"):
            session.train(3, rollout["path"], scores["path"])
    finally:
        session.close()
    assert (config.run.directory / "trainer" / "ranks.log").exists()

    again = TrainingSession(config)
    try:
        assert again.resumed_from == 2 and again.cursor == 2 * config.rollout.prompts_per_step
        state = again.trainer.policy_state()
        assert all(torch.equal(state[k], v) for k, v in at_checkpoint.items())
        _step(again, 3)
        assert again.step == 3
    finally:
        again.close()


def test_bf16_autocast_and_gradient_checkpointing_on_the_ranks(tmp_path):
    session = TrainingSession(_config(tmp_path, **{"model.dtype": "bf16", "trainer.gradient_checkpointing": True}))
    try:
        metrics = _step(session, 1)
        assert metrics["response_tokens"] > 0
        state = session.trainer.policy_state()
        assert {t.dtype for t in state.values() if t.is_floating_point()} == {torch.bfloat16}  # the engines' dtype
        assert session.engine.policy_version == 1
    finally:
        session.close()


def test_lora_adapters_trained_on_the_ranks_reach_the_engine_and_the_checkpoint(tmp_path):
    config = _config(tmp_path, **{"model.lora": {"r": 4, "alpha": 8.0}})
    session = TrainingSession(config)
    try:
        _step(session, 1)
        state = session.trainer.policy_state()
        # The version is the adapters alone (the untrained model earns no reward, so B is still 0: the
        # step's update is tested against the torch trainer in tests/rl/test_distributed_trainer.py).
        assert state and all(".lora_A." in key or ".lora_B." in key for key in state)
        engine = session.engine
        assert engine.policy_version == 1
        applied = adapter_state(engine.inner.model)  # the in-process HF engine's adapters
        assert applied.keys() == state.keys() and all(
            torch.equal(applied[k], v.to(applied[k].dtype)) for k, v in state.items()
        )
        checkpoint = Path(session.checkpoint())
        assert (checkpoint / "adapter_model.safetensors").exists() and not (checkpoint / "model.safetensors").exists()
    finally:
        session.close()
