"""The whole loop on the rollout fabric: rl-train under a real Prefect server, rollout on worker
processes (1 reserved + 2 spot instances with real SIGTERM/SIGKILL preemptions) over an embedded
Redis token log, training in the flow process. Preempted samples migrate with their logged
tokens; the responses equal what one in-process engine generates for the same requests."""

from __future__ import annotations

import json

import pytest

from flows.rl_train import rl_train
from infra.ledger.recorder import Ledger
from infra.run.config import load_config
from rl.models import load_model, save_model
from rl.prompt_source import PromptSource
from rl.rollout import build_requests, read_samples
from tests.helpers import POISSON_CHURN, RESERVED_POOL, hf_on_cpu, spot_pool, tiny_model, tiny_run

pytestmark = pytest.mark.integration

POOLS = [RESERVED_POOL, spot_pool(2, **POISSON_CHURN)]


def test_fabric_run_with_preemptions_matches_in_process_generation(prefect_harness, tmp_path):
    base = tmp_path / "base"
    model, tokenizer = tiny_model()
    save_model(model, tokenizer, base)
    overrides = tiny_run(
        base,
        tmp_path,
        "fabric-e2e",
        3,
        {
            "rollout.prompts_per_step": 6,
            "rollout.max_new_tokens": 48,
            "fabric.enabled": True,
            "fabric.pools": POOLS,
            "fabric.worker": {"slots": 8, "flush_tokens": 2, "flush_ms": 50, "heartbeat_s": 0.3, "ttl_s": 1.5},
            "fabric.controller": {"reap_timeout_s": 1.5},
        },
    )
    state = rl_train(overrides=overrides, return_state=True)
    assert state.is_completed(), state
    with Ledger() as ledger:  # every step's instances, usage and weight pulls were recorded
        costs = ledger.report(state.result()["ledger_run_id"])
    assert [s.step for s in costs.steps] == [1, 2, 3] and costs.total_usd > 0
    assert costs.transfer_bytes > 0 and costs.tokens_generated > 0
    assert sum(s.transfer_bytes for s in costs.steps) == costs.transfer_bytes
    assert all((s.pull_s_max or 0) > 0 for s in costs.steps if s.pulls)  # every pull recorded its seconds
    reserved = next(c for c in costs.classes if c.capacity_class == "reserved")
    assert reserved.booted == 1 and reserved.boot_s_mean > 0  # its worker's registration is its ready time
    run_dir = tmp_path / "runs" / "fabric-e2e"
    config = load_config(None, overrides)

    # Every step trained on every sample exactly once.
    for step in (1, 2, 3):
        samples = read_samples(run_dir / "steps" / f"{step:06d}" / "rollout.jsonl")
        ids = [s.sample_id for s in samples]
        assert len(ids) == len(set(ids)) == 24
        assert all(0 < len(s.response_ids) <= 48 and len(s.logprobs) == len(s.response_ids) for s in samples)
        metrics = json.loads((run_dir / "steps" / f"{step:06d}" / "metrics.json").read_text())
        assert metrics["groups_dropped"] == 0
        assert metrics["policy_version"] == step
        ledger_step = costs.steps[step - 1]  # the step row's pulls are the ledger's, with their time
        assert (metrics["pulls"], metrics["pull_s"]) == (ledger_step.pulls, ledger_step.pull_s_max)
        assert metrics["train_overlap_s"] > 0, "groups should be trained as they complete, during the rollout"

    totals = [json.loads((run_dir / "steps" / f"{s:06d}" / "metrics.json").read_text()) for s in (1, 2, 3)]
    migrations = sum(m["migrations"] for m in totals)
    print(
        f"preemptions {totals[-1]['preemptions']}, migrations {migrations}, wasted {sum(m['tokens_wasted'] for m in totals)}"
    )
    assert totals[-1]["preemptions"] >= 1, "the spot pool's Poisson schedule should have preempted an instance"

    # Step 1 ran on version 0 (the base model): regenerate it in process and compare token by token.
    base_model, base_tokenizer = load_model(base)
    engine = hf_on_cpu(base_model, base_tokenizer.eos_token_id, base_tokenizer.pad_token_id)
    records = PromptSource(config.data).take(0, 6)
    requests = build_requests(base_tokenizer, records, 1, config.rollout, config.run.seed)
    expected = {r.sample_id: res.token_ids for r, res in zip(requests, engine.generate(requests))}
    got = {s.sample_id: s.response_ids for s in read_samples(run_dir / "steps" / "000001" / "rollout.jsonl")}
    positions = sum(len(t) for t in expected.values())
    matching = sum(sum(a == b for a, b in zip(expected[k], got[k])) for k in expected)
    exact = sum(expected[k] == got[k] for k in expected)
    print(
        f"fabric vs in-process: {exact}/{len(expected)} samples identical, token match rate {matching / positions:.4f}"
    )
    assert matching / positions >= 0.99
