"""What a run records as its workload (`infra.run.workload`): from its configuration and its
model's `config.json`, written to the ledger when a real training session opens."""

from __future__ import annotations

import json

from infra.ledger.recorder import Ledger
from infra.run.config import load_config
from infra.run.session import TrainingSession
from infra.run.workload import model_architecture, run_workload
from rl.config import LoraSettings
from tests.infra.run.test_session_prompts import TEMPLATE, config_for, tiny_model


def test_the_demo_configuration_records_its_batch_every_pool_and_the_spot_availability():
    recorded = run_workload(load_config(None), params=None)
    assert recorded["batch"] == {
        "prompts_per_step": 32,
        "group_size": 8,
        "max_new_tokens": 6,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "max_staleness": 0,
    }
    reserved, spot = recorded["pools"]
    assert (reserved["name"], reserved["colocated"], reserved["price_per_hour"]) == ("reserved", True, 3.67)
    assert spot["availability"]["poisson"] == {"mean_life_s": 60.0, "mean_gap_s": 5.0, "seed": 1}
    assert recorded["model"]["params"] is None
    assert recorded["trainer"] == {  # the torch trainer (no ZeRO stage); its machine is the colocated pool
        "backend": "torch",
        "world_size": 1,
        "nodes": 1,
        "zero_stage": None,
        "gradient_checkpointing": False,
        "machine": None,
    }
    assert recorded["optim"]["lr"] == 2.5e-4 and recorded["grpo"]["clip_eps"] == 0.2
    assert recorded["lora"] is None  # full fine-tuning
    assert recorded["data"] == {"source": "arithmetic", "family": "add", "path": None, "mean_prompt_tokens": None}
    json.dumps(recorded)  # JSON-ready: the ledger stores it as JSON


def test_a_session_records_its_workload_with_the_models_size(tmp_path):
    model = tiny_model(tmp_path / "chat", TEMPLATE)
    config = config_for(tmp_path, model, chat_template=True)
    session = TrainingSession(config)
    try:
        params = sum(p.numel() for p in session.model.parameters())
        run_id = session.run_id
    finally:
        session.close()
    with Ledger(config.ledger.resolved_url()) as ledger:
        recorded = ledger.report(run_id).workload
    architecture = model_architecture(model)
    assert architecture["layers"] >= 1 and architecture["kv_heads"] >= 1 and architecture["head_dim"] >= 1
    assert recorded["model"] == {
        "path": str(model),
        "gguf_file": None,
        "dtype": "fp32",
        "params": params,
        **architecture,
    }
    assert recorded["batch"]["group_size"] == 2 and recorded["pools"] == []
    assert recorded["data"]["mean_prompt_tokens"] > 1  # the held-out prompts, encoded with the chat template


def test_a_lora_session_records_its_adapters_so_the_ledger_tells_it_from_a_full_run(tmp_path):
    """With `model.lora` the workload says so: rank, alpha, dropout, targets, the trainable
    parameters (the adapters alone: counted here on the live model) and one adapter version's bytes."""
    model = tiny_model(tmp_path / "chat", TEMPLATE)
    config = config_for(tmp_path, model, chat_template=True)
    lora = LoraSettings(r=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    config = config.model_copy(update={"model": config.model.model_copy(update={"lora": lora})})
    session = TrainingSession(config)
    try:
        trainable = sum(p.numel() for p in session.model.parameters() if p.requires_grad)
        run_id = session.run_id
    finally:
        session.close()
    with Ledger(config.ledger.resolved_url()) as ledger:
        recorded = ledger.report(run_id).workload["lora"]
    assert recorded == {
        "r": 4,
        "alpha": 8.0,
        "dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "trainable_parameters": trainable,
        "adapter_bytes": 4 * trainable,  # fp32 adapters
    }
    assert 0 < trainable < sum(p.numel() for p in session.model.parameters()) // 10
