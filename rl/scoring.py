"""Scoring a step's samples: rewards per response and group-normalised advantages per group."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.config import GRPOConfig
from rl.datasets import PromptRecord
from rl.grpo import group_advantages
from rl.rewards import RewardFn
from rl.rollout import Sample


@dataclass
class Scores:
    rewards: list[float]
    advantages: list[float]
    correct: list[bool]


def score_group(
    samples: list[Sample],
    record: PromptRecord,
    tokenizer,
    reward_fn: RewardFn,
    correctness_fn: RewardFn,
    grpo: GRPOConfig,
) -> Scores:
    """Rewards, correctness and group-normalised advantages of the responses to one prompt."""
    texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    rewards = [reward_fn(text, record.answer) for text in texts]
    correct = [correctness_fn(text, record.answer) > 0 for text in texts]
    advantages = group_advantages(
        torch.tensor(rewards, dtype=torch.float32),
        len(samples),
        normalize_std=grpo.normalize_std,
        eps=grpo.eps,
    )
    return Scores(rewards, advantages.tolist(), correct)


def score_samples(
    samples: list[Sample],
    records: list[PromptRecord],
    tokenizer,
    reward_fn: RewardFn,
    correctness_fn: RewardFn,
    group_size: int,
    grpo: GRPOConfig,
) -> Scores:
    """`samples` come grouped consecutively, `group_size` per group, groups in record order;
    `sample.group` indexes `records`. Groups may be missing (a distributed rollout drops a group
    whose sample failed), but every group present must be complete."""
    groups = [s.group for s in samples]
    expected = [g for g in dict.fromkeys(groups) for _ in range(group_size)]
    if groups != expected or any(g >= len(records) for g in groups):
        raise ValueError(
            f"samples must come in complete consecutive groups of {group_size} for the "
            f"{len(records)} prompts; got groups {groups}"
        )
    total = Scores([], [], [])
    for start in range(0, len(samples), group_size):
        group = samples[start : start + group_size]
        scores = score_group(group, records[group[0].group], tokenizer, reward_fn, correctness_fn, grpo)
        total.rewards += scores.rewards
        total.advantages += scores.advantages
        total.correct += scores.correct
    return total
