"""Scoring a step's samples: rewards per response and group-normalised advantages per group.

A multi-turn trajectory (`Sample.turns`) is scored on its final model turn's text: with the
environment's terminal reward when it gave one (`Sample.env_reward`), else by the reward function,
which gets the whole `rl.environments.protocol.Trajectory` as `trajectory=` when it takes it. A
group may have fewer samples than the group size when trajectories failed for the infrastructure
and `training.infra_failed` is `renormalize` (`partial_groups`): its advantages are over the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.config import GRPOConfig
from rl.datasets import PromptRecord
from rl.environments.protocol import Trajectory, Turn
from rl.environments.registry import Reward
from rl.grpo import group_advantages
from rl.rewards import RewardFn
from rl.rollout import Sample


@dataclass
class Scores:
    rewards: list[float]
    advantages: list[float]
    correct: list[bool]


def trajectory_of(sample: Sample, record: PromptRecord, tokenizer) -> Trajectory:
    """The sample as the environment protocol's `Trajectory`: each model turn decoded on its own
    (from the logged tokens) with the observation that followed it."""
    turns = tuple(
        Turn(tokenizer.decode(sample.response_ids[start:end], skip_special_tokens=True), observation)
        for start, end, observation in sample.model_turns()
    )
    return Trajectory(record.prompt, record.answer, turns, sample.truncated)


def _score(sample: Sample, record: PromptRecord, tokenizer, reward_fn: RewardFn, correctness_fn: RewardFn):
    """(reward, correct) of one sample."""
    if not sample.turns and sample.env_reward is None:  # a single-turn response
        text = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        return reward_fn(text, record.answer), correctness_fn(text, record.answer) > 0
    trajectory = trajectory_of(sample, record, tokenizer)
    if sample.env_reward is not None:
        return sample.env_reward, sample.env_reward > 0
    if isinstance(reward_fn, Reward):
        reward = reward_fn(trajectory.response, record.answer, trajectory=trajectory)
    else:
        reward = reward_fn(trajectory.response, record.answer)
    return reward, correctness_fn(trajectory.response, record.answer) > 0


def score_group(
    samples: list[Sample],
    record: PromptRecord,
    tokenizer,
    reward_fn: RewardFn,
    correctness_fn: RewardFn,
    grpo: GRPOConfig,
) -> Scores:
    """Rewards, correctness and group-normalised advantages of the responses to one prompt."""
    scored = [_score(s, record, tokenizer, reward_fn, correctness_fn) for s in samples]
    rewards = [reward for reward, _ in scored]
    correct = [ok for _, ok in scored]
    advantages = group_advantages(
        torch.tensor(rewards, dtype=torch.float32),
        len(samples),
        normalize_std=grpo.normalize_std,
        eps=grpo.eps,
    )
    return Scores(rewards, advantages.tolist(), correct)


def _check_groups(samples: list[Sample], records: list[PromptRecord], group_size: int, partial: bool) -> None:
    groups = [s.group for s in samples]
    runs = list(dict.fromkeys(groups))
    sizes = [groups.count(g) for g in runs]
    consecutive = groups == [g for g, size in zip(runs, sizes) for _ in range(size)]
    complete = all(size == group_size for size in sizes) or (partial and all(size <= group_size for size in sizes))
    if not (consecutive and complete) or any(g >= len(records) for g in groups):
        raise ValueError(
            f"samples must come in {'consecutive groups of at most' if partial else 'complete consecutive groups of'} "
            f"{group_size} for the {len(records)} prompts; got groups {groups}"
        )


def score_samples(
    samples: list[Sample],
    records: list[PromptRecord],
    tokenizer,
    reward_fn: RewardFn,
    correctness_fn: RewardFn,
    group_size: int,
    grpo: GRPOConfig,
    partial_groups: bool = False,
) -> Scores:
    """`samples` come grouped consecutively, `group_size` per group, groups in record order;
    `sample.group` indexes `records`. Groups may be missing (a distributed rollout drops a group
    whose sample failed), but every group present must be complete, unless `partial_groups`
    (`training.infra_failed: renormalize`: the group's trajectories failed by the infrastructure
    are left out)."""
    _check_groups(samples, records, group_size, partial_groups)
    total = Scores([], [], [])
    start = 0
    while start < len(samples):
        end = start
        while end < len(samples) and samples[end].group == samples[start].group:
            end += 1
        group = samples[start:end]
        scores = score_group(group, records[group[0].group], tokenizer, reward_fn, correctness_fn, grpo)
        total.rewards += scores.rewards
        total.advantages += scores.advantages
        total.correct += scores.correct
        start = end
    return total


class NothingToTrain(RuntimeError):
    """Every sample of a step failed for an infrastructure reason (counted, never scored 0): the
    run stops at the step before it, which a rerun resumes from."""

    def __init__(self, step: int) -> None:
        self.step = step
        super().__init__(
            f"every sample of step {step} failed for an infrastructure reason (the step's infra_failed "
            "counts them by kind; the run log has each failure): nothing to train. Fix the cause (an "
            "environment or its server down?)"
        )
