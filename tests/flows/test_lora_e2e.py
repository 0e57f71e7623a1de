"""LoRA GRPO through the whole loop: rl-train under a real Prefect server with `model.lora`, rollout
on two worker processes (a reserved instance and a spot instance preempted by real SIGTERM and
SIGKILL) that pull each version over HTTP. Every version the instances load is the adapters alone; the engines decode
the trained adapters, not the base (the silent "never delivered" failure would show as a gap
between the trainer's log-probs and the engines'); samples that migrated between instances carry the same
keyed tokens as one in-process engine with the same adapters; the checkpoint is a PEFT adapter."""

from __future__ import annotations

import json

import pytest
import torch

from flows.rl_train import rl_train
from infra.ledger.recorder import Ledger
from infra.run.config import load_config
from rl.lora import ADAPTER_WEIGHTS_FILE, add_adapters, read_adapter
from rl.models import load_model, load_policy
from rl.prompt_source import PromptSource
from rl.rollout import build_requests, read_samples
from rl.trainer import WEIGHTS_FILE
from tests.helpers import POISSON_CHURN, RESERVED_POOL, hf_on_cpu, spot_pool, tiny_run

pytestmark = pytest.mark.integration

POOLS = [RESERVED_POOL, spot_pool(**POISSON_CHURN)]


def engine_vs_base_gap(model_dir, samples) -> float:
    """Mean |engine log-prob - base model log-prob| over the samples' response tokens."""
    base = load_policy(model_dir)
    gaps = []
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor([sample.prompt_ids + sample.response_ids])
            logp = torch.log_softmax(base(input_ids=ids).logits[0].float(), dim=-1)
            start = len(sample.prompt_ids) - 1
            for j, (token, engine_lp) in enumerate(zip(sample.response_ids, sample.logprobs)):
                gaps.append(abs(float(logp[start + j, token]) - engine_lp))
    return sum(gaps) / len(gaps)


def test_a_lora_run_publishes_adapters_and_every_engine_decodes_them(prefect_harness, pretrained_tiny_model, tmp_path):
    base = pretrained_tiny_model  # rewards that differ within a group: the adapters train
    overrides = tiny_run(
        base,
        tmp_path,
        "lora-e2e",
        3,
        {
            "model.lora": {"r": 4, "alpha": 8},
            "optim.lr": 0.05,  # large enough that the adapters move the policy visibly in 3 steps
            "rollout.max_new_tokens": 16,
            "run.checkpoint_every": 1,  # the adapters of version 2, to regenerate step 3 with
            "fabric.pools": POOLS,
            "fabric.worker": {"flush_tokens": 2, "flush_ms": 50, "heartbeat_s": 0.3, "ttl_s": 1.5},
            "fabric.controller": {"reap_timeout_s": 1.5},
            "training.max_logprob_gap": 0.01,  # a step whose engines decoded other weights fails
        },
    )
    state = rl_train(overrides=overrides, return_state=True)
    assert state.is_completed(), state
    run_dir = tmp_path / "runs" / "lora-e2e"
    checkpoint = run_dir / "checkpoints" / "step_000003"
    adapters, settings = read_adapter(checkpoint)
    assert settings.r == 4 and not (checkpoint / WEIGHTS_FILE).exists()
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapters.values())
    model_bytes = (base / "model.safetensors").stat().st_size
    assert (checkpoint / ADAPTER_WEIGHTS_FILE).stat().st_size < 0.5 * model_bytes

    with Ledger() as ledger:
        costs = ledger.report(state.result()["ledger_run_id"])
    pulls = costs.transfer_bytes
    # The instances pulled versions (adapters, then sparse deltas of them), never a whole model:
    # every pull of the run together is less than one model.
    assert adapter_bytes <= pulls < model_bytes, (pulls, adapter_bytes, model_bytes)

    for step in (2, 3):  # versions 1 and 2: adapters that differ from the base
        directory = run_dir / "steps" / f"{step:06d}"
        metrics = json.loads((directory / "metrics.json").read_text())
        trainer_gap = metrics["logprob_gap"]
        base_gap = engine_vs_base_gap(base, read_samples(directory / "rollout.jsonl"))
        print(f"step {step}: trainer vs engines {trainer_gap:.2e}, base vs engines {base_gap:.2e}")
        assert trainer_gap < 1e-3
        assert base_gap > 10 * trainer_gap, "the engines decoded the base, not the adapters"

    # Step 3 ran on version 2: the same requests on one in-process HF engine with version 2's
    # adapters give the same keyed tokens, whichever instances (and migrations) made them.
    config = load_config(None, overrides)
    model, tokenizer = load_model(base)
    engine = hf_on_cpu(add_adapters(model, settings).eval(), tokenizer.eos_token_id, tokenizer.pad_token_id)
    engine.load_weights(read_adapter(run_dir / "checkpoints" / "step_000002")[0], 2)
    records = PromptSource(config.data).take(2 * config.rollout.prompts_per_step, config.rollout.prompts_per_step)
    requests = build_requests(tokenizer, records, 3, config.rollout, config.run.seed)
    expected = {r.sample_id: res.token_ids for r, res in zip(requests, engine.generate(requests))}
    got = {s.sample_id: s.response_ids for s in read_samples(run_dir / "steps" / "000003" / "rollout.jsonl")}
    assert got.keys() == expected.keys()
    matching = sum(sum(a == b for a, b in zip(expected[k], got[k])) for k in expected)
    positions = sum(len(t) for t in expected.values())
    metrics = json.loads((run_dir / "steps" / "000003" / "metrics.json").read_text())
    print(f"step 3 against in-process: token match {matching / positions:.4f}, preemptions {metrics['preemptions']}")
    assert matching / positions >= 0.99
