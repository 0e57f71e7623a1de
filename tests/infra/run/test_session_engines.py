"""The training session's in-process engine as configured (infra/run/session.py): vLLM in bf16 beside
an fp32 trainer gets every new policy version, and the HF engine in fp32 runs the trainer's model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from infra.run.config import load_config
from infra.run.session import TrainingSession
from rl.engine import HFEngine
from rl.generation import SamplingParams
from rl.rollout import build_requests
from rl.vllm_engine import VLLMEngine
from tests.helpers import RESERVED_POOL, hf_on_cpu, match_rate, save_tiny_model, tiny_run, tiny_shape

pytestmark = pytest.mark.integration


def _session(tmp_path, **overrides) -> TrainingSession:
    base = save_tiny_model(tmp_path / "base", tiny_shape())
    config = load_config(
        None,
        tiny_run(
            base,
            tmp_path,
            "engines",
            None,
            {
                "fabric.enabled": False,
                "rollout.vllm": {"max_num_seqs": 16, "kv_cache_bytes": 64 << 20},
                "optim.lr": 1e-2,
                "eval.size": None,
                "ledger.url": f"sqlite:///{tmp_path / 'ledger.sqlite'}",
                **overrides,
            },
        ),
    )
    return TrainingSession(config)


def _one_step(session: TrainingSession, step: int) -> None:
    rollout = session.rollout(step)
    scores = session.score(step, rollout["path"])
    session.train(step, rollout["path"], scores["path"])


def test_a_bf16_vllm_engine_follows_the_fp32_trainer(tmp_path):
    session = _session(tmp_path, **{"rollout.engine": "vllm", "model.dtype": "bf16"})
    try:
        assert isinstance(session.engine.inner, VLLMEngine) and session.engine.policy_version == 0
        assert {p.dtype for p in session.model.parameters()} == {torch.float32}
        _one_step(session, 1)
        _one_step(session, 2)
        engine = session.engine
        assert engine.policy_version == 2
        # The engine decodes what the trained weights decode (HF on a bf16 copy of them), not the base model.
        hf = hf_on_cpu(session.model.to(torch.bfloat16), session.tokenizer.eos_token_id, session.tokenizer.pad_token_id)
        requests = [
            replace(r, sampling=SamplingParams(greedy=True))
            for r in build_requests(session.tokenizer, session._records(), 3, session.config.rollout, 0)
        ]
        assert match_rate(engine.generate(requests), hf.generate(requests)) >= 0.9
        assert 0.0 <= session.evaluate() <= 1.0
    finally:
        session.close()


def test_the_fp32_hf_engine_runs_the_trainers_own_model(tmp_path):
    session = _session(tmp_path)
    try:
        assert isinstance(session.engine.inner, HFEngine) and session.engine.inner.model is session.model
        _one_step(session, 1)
        assert session.engine.policy_version == 1
    finally:
        session.close()


def test_with_the_fabric_the_evaluation_engine_is_closed_after_each_evaluation(tmp_path):
    """With the fabric the in-process engine only evaluates: one holding its own weights (here an HF
    copy in bf16) is closed after each evaluation and built again, at the current version, for the next."""
    session = _session(tmp_path, **{"fabric.enabled": None, "fabric.pools": [RESERVED_POOL], "model.dtype": "bf16"})
    try:
        assert session.fabric is not None
        assert 0.0 <= session.evaluate() <= 1.0
        assert session._engine is None
        _one_step(session, 1)
        assert session.engine.policy_version == 1 and session.engine.inner.model is not session.model
        assert 0.0 <= session.evaluate() <= 1.0
        assert session._engine is None
    finally:
        session.close()
