"""pass@k of a checkpoint through the rollout fabric, spot instances preempted as it runs, equals
pass@k of the same checkpoint in process: the keyed sampler draws each evaluation sample by its id,
wherever it runs and however often it migrates. The fabric's instances are billed as eval $."""

from __future__ import annotations

import pytest

from infra.ledger.recorder import Ledger
from infra.run.config import load_config
from infra.run.eval_result import EvalResult
from infra.run.evaluation import evaluate_checkpoint
from rl.checkpoint import save_checkpoint
from rl.config import GRPOConfig, OptimConfig
from rl.models import load_model
from tests.helpers import POISSON_CHURN, RESERVED_POOL, run_trainer, spot_pool, tiny_run

pytestmark = pytest.mark.integration

STEP = 3


def checkpoint_of(model_dir, run_dir, step: int = STEP):
    """A checkpoint of the model in `model_dir` as a run's step `step`."""
    model, tokenizer = load_model(model_dir)
    trainer = run_trainer(model, tokenizer.pad_token_id, GRPOConfig(), OptimConfig())
    trainer.step = step
    return save_checkpoint(run_dir / "checkpoints", trainer, {"cursor": 0})


def test_pass_at_k_on_the_fabric_with_preemptions_equals_in_process(pretrained_tiny_model, tmp_path):
    overrides = tiny_run(
        pretrained_tiny_model,
        tmp_path,
        "eval-fabric",
        None,
        {
            "eval.size": 16,
            "eval.samples": 8,
            "eval.k": [1, 4, 8],
            "fabric.pools": [{**RESERVED_POOL, "colocated": True}, spot_pool(1, **POISSON_CHURN)],
            "fabric.worker": {"slots": 2, "flush_tokens": 1, "flush_ms": 20, "heartbeat_s": 0.3, "ttl_s": 1.5},
            "fabric.controller": {"reap_timeout_s": 1.5},
        },
    )
    config = load_config(None, overrides)
    checkpoint = checkpoint_of(pretrained_tiny_model, config.run.directory)

    local = evaluate_checkpoint(config, checkpoint, fabric=False)
    remote = evaluate_checkpoint(config, checkpoint, fabric=True)

    print(
        f"in process {local.line()}; fabric {remote.line()}, {remote.preemptions} preemptions, {remote.migrations} migrations"
    )
    assert (local.step, remote.step) == (STEP, STEP)
    assert local.samples == remote.samples == 16 * 8
    assert 0 < local.pass_at_k[1] < local.pass_at_k[8] <= 1  # the pretrained model is right some of the time
    assert remote.pass_at_k == local.pass_at_k and remote.avg_at_k == local.avg_at_k
    assert remote.preemptions >= 1, "the spot pool's Poisson schedule should have preempted an instance"
    with Ledger() as ledger:  # the evaluation's instances, billed as its own run's one step
        report = ledger.report(remote.ledger_run_id)
    assert [s.step for s in report.steps] == [STEP] and remote.cost_usd == pytest.approx(report.total_usd) > 0
    written = sorted(p.name for p in (config.run.directory / "evals").glob("*.json"))
    assert written == [f"step_{STEP:06d}.fabric.json", f"step_{STEP:06d}.in_process.json"]
    again = EvalResult.model_validate_json((config.run.directory / "evals" / written[0]).read_text())
    assert again.pass_at_k == remote.pass_at_k
