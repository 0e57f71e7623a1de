"""Prefect task that makes sure the run's base model exists, pretraining it when it is the tiny
model this project builds itself."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from infra.run.config import RunConfig
from rl.pretrain import pretrain


@task(name="ensure-base-model", cache_policy=NO_CACHE, persist_result=False)
def ensure_base_model(config: RunConfig) -> str:
    path = Path(config.model.path)
    if (path / "config.json").exists():
        return str(path)
    if path.resolve() != Path(config.pretrain.output).resolve():
        raise FileNotFoundError(
            f"model.path {path} holds no Hugging Face model (no config.json); point model.path at a "
            f"model directory, or at pretrain.output ({config.pretrain.output}) to pretrain one"
        )
    logger = get_run_logger()
    logger.info(
        "no base model at %s: pretraining the tiny model (stops at %.0f%% held-out accuracy)",
        path,
        100 * config.pretrain.accuracy_threshold,
    )
    result = pretrain(
        config.pretrain,
        config.model,
        on_eval=lambda step, loss, acc: logger.info("pretrain step %d loss %.3f held-out acc %.3f", step, loss, acc),
        threads=config.run.torch_threads,
    )
    logger.info(
        "pretrained in %d steps (%.0f s), held-out greedy accuracy %.3f", result.steps, result.seconds, result.accuracy
    )
    return str(path)
