"""Strict mode (`training.max_staleness: 0`, the default) is the loop as it was before bounded
staleness: on the demo configuration, three steps through the fabric (co-located reserved engine,
spot workers, streamed training) train only tokens of each step's own version, the very tokens an
in-process engine draws from the step's checkpoint, and the parameters after three steps equal, to
1e-6, those of the previous trainer's math (a separate no-grad forward for the old log-probs, the
clipped surrogate on their ratio) replayed on the run's own samples and advantages."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from flows.rl_train import rl_train
from infra.run.config import load_config
from rl.models import load_model
from rl.prompt_source import PromptSource
from rl.rollout import build_requests, read_samples
from tests.helpers import hf_on_cpu, tiny_run

pytestmark = pytest.mark.integration

STEPS = 3


@pytest.fixture
def base_model(pretrained_tiny_model):
    """The demo's pretrained base (a random model earns no reward: its advantages are all zero)."""
    return pretrained_tiny_model


def _previous_trainer_replay(base, run_dir, config) -> dict[str, torch.Tensor]:
    """The run's steps replayed with the previous trainer's update, written out here."""
    model, tokenizer = load_model(base)
    optim = config.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (optim.warmup_steps + 1)))
    pad, clip = tokenizer.pad_token_id, config.grpo.clip_eps
    for step in range(1, STEPS + 1):
        folder = run_dir / "steps" / f"{step:06d}"
        samples = read_samples(folder / "rollout.jsonl")
        advantages = json.loads((folder / "scores.json").read_text())["advantages"]
        width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        ids = torch.full((len(samples), width), pad)
        attention = torch.zeros((len(samples), width), dtype=torch.long)
        for i, s in enumerate(samples):
            ids[i, : len(s.prompt_ids) + len(s.response_ids)] = torch.tensor(s.prompt_ids + s.response_ids)
            attention[i, : len(s.prompt_ids) + len(s.response_ids)] = 1
        positions = (attention.cumsum(1) - 1).clamp(min=0)

        def response_logprobs() -> list[torch.Tensor]:
            logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False).logits
            logp = torch.log_softmax(logits.float() / config.rollout.temperature, dim=-1)
            return [
                torch.stack([logp[i, len(s.prompt_ids) - 1 + j, t] for j, t in enumerate(s.response_ids)])
                for i, s in enumerate(samples)
            ]

        optimizer.zero_grad()
        with torch.no_grad():
            old = response_logprobs()
        new = response_logprobs()
        terms = []
        for logp, old_logp, a in zip(new, old, advantages):
            ratio = torch.exp(logp - old_logp)
            terms.append(-torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip, 1 + clip) * a))
        (torch.cat(terms).sum() / sum(len(t) for t in terms)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.max_grad_norm)
        optimizer.step()
        schedule.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_strict_mode_trains_the_steps_own_tokens_with_the_previous_update(prefect_harness, base_model, tmp_path):
    demo_batch = {"rollout.prompts_per_step": None, "rollout.group_size": None}
    overrides = tiny_run(
        base_model,
        tmp_path,
        "strict",
        STEPS,
        {
            "run.checkpoint_every": 1,
            "run.keep_checkpoints": STEPS + 1,
            "eval.size": 16,
            "eval.every": 100,
            **demo_batch,
        },
    )
    config = load_config(None, overrides)  # the demo configuration, three steps
    assert config.training.max_staleness == 0 and config.fabric.enabled and config.fabric.stream_training
    state = rl_train(overrides=overrides, return_state=True)
    assert state.is_completed()
    run_dir = tmp_path / "runs" / "strict"
    model, tokenizer = load_model(base_model)
    engine = hf_on_cpu(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    prompts = PromptSource(config.data)
    same = total = 0
    for step in range(1, STEPS + 1):
        metrics = json.loads((run_dir / "steps" / f"{step:06d}" / "metrics.json").read_text())
        assert metrics["version_lag_histogram"] == {"0": metrics["tokens"]}
        samples = read_samples(run_dir / "steps" / f"{step:06d}" / "rollout.jsonl")
        assert all(s.policy_version == step - 1 and s.token_versions == [] for s in samples)
        if step > 1:
            engine.load_weights(load_file(run_dir / "checkpoints" / f"step_{step - 1:06d}" / "model.safetensors"), step)
        records = prompts.take((step - 1) * config.rollout.prompts_per_step, config.rollout.prompts_per_step)
        requests = build_requests(tokenizer, records, step, config.rollout, config.run.seed, config.prompt)
        expected = {r.sample_id: res.token_ids for r, res in zip(requests, engine.generate(requests))}
        assert sorted(expected) == sorted(s.sample_id for s in samples)
        same += sum(s.response_ids == expected[s.sample_id] for s in samples)
        total += len(samples)
    assert same / total >= 0.99, f"{same}/{total} responses identical to in-process generation"
    want = _previous_trainer_replay(base_model, run_dir, config)
    got = load_file(run_dir / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors")
    start = load_model(base_model)[0].state_dict()
    assert max((got[k] - start[k]).abs().max().item() for k in got) > 1e-5  # it did train
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)
