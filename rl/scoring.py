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


def score_samples(
    samples: list[Sample], records: list[PromptRecord], tokenizer, reward_fn: RewardFn,
    correctness_fn: RewardFn, group_size: int, grpo: GRPOConfig,
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
    texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    answers = [records[s.group].answer for s in samples]
    rewards = [reward_fn(text, answer) for text, answer in zip(texts, answers)]
    correct = [correctness_fn(text, answer) > 0 for text, answer in zip(texts, answers)]
    advantages = group_advantages(
        torch.tensor(rewards, dtype=torch.float32), group_size,
        normalize_std=grpo.normalize_std, eps=grpo.eps,
    )
    return Scores(rewards, advantages.tolist(), correct)
