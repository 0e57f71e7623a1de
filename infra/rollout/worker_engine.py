"""The engine a rollout worker runs: the configured engine (`rl.engine_spec`) on the run's base
model, whose weights are version 0 (downloaded first when the model is a URL), ending each sample
at its stop strings (`rl.stops.StopStrings`, with the model's tokenizer).
"""

from __future__ import annotations

import logging
from pathlib import Path

import redis

from infra.rollout.worker_config import WorkerConfig
from infra.weights.model_source import fetch_model, is_url
from infra.weights.shared import shared_config
from rl.generation import GenerationEngine

log = logging.getLogger("rlboost.worker")

HF_WORKER_MODULES = (
    "infra.rollout.worker",
    "rl.engine_factory",
    "rl.engine",
    "rl.stops",
    "rl.models",
    "rl.lora",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama",
)
"""What a worker with the `hf` engine on a Llama model imports before its first token: a local
pool's fork template imports them once (`infra.providers.warm_start`); 4.2 s of CPU here."""
VLLM_WORKER_MODULES = (*HF_WORKER_MODULES, "rl.vllm_engine", "vllm", "vllm.entrypoints.llm")
"""And with the `vllm` engine: vLLM's own modules (5.5 s of CPU more here)."""


def load_engine(config: WorkerConfig, client: redis.Redis) -> GenerationEngine:
    """The configured engine on the base model, applying each sample's stop strings."""
    from transformers import AutoTokenizer

    from rl.engine_factory import build_engine
    from rl.stops import StopStrings

    model_dir = _local_model(config, client)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    engine = build_engine(
        config.engine,
        model_dir,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        max_batch_size=config.slots,
        field="engine",
    )
    log.info(
        "engine %s on %s (%s) for instance %s",
        config.engine.kind,
        config.engine.device,
        config.engine.dtype,
        config.instance.instance_id,
    )
    return StopStrings(engine, tokenizer)


def adapter_base(config: WorkerConfig, client: redis.Redis) -> str | None:
    """The digest of the base model this worker applies LoRA adapters to (None without `lora`)."""
    from rl.lora import base_digest

    return None if config.engine.lora is None else base_digest(_local_model(config, client))


def _local_model(config: WorkerConfig, client: redis.Redis) -> Path:
    """The base model's local directory, downloaded first when it is a URL (read with the run's
    weight-store options when it lies under the store)."""
    location = config.model_path
    if not is_url(location):
        return fetch_model(location)
    settings = shared_config(client, config.run_id)
    if settings is not None and settings.store_url and location.startswith(settings.store_url.rstrip("/")):
        return fetch_model(location, settings.store_options)
    return fetch_model(location, None)
