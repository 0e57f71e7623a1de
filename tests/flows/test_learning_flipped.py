"""The learning test's control: the demo with the advantage's sign flipped does not learn
(`tests/flows/test_learning.py` has the method and the measured figures)."""

from __future__ import annotations

import pytest

import rl.scoring
from tests.flows.test_learning import MARGIN_POINTS, STEPS, _gain, _train

pytestmark = pytest.mark.integration


def test_a_flipped_advantage_does_not_learn(prefect_harness, pretrained_tiny_model, tmp_path, monkeypatch):
    """The scoring's group advantages negated, inside the training process (where every group is
    scored, streamed or not): the same run pushes the policy away from the right answers, so the
    margin above is one that only learning reaches."""
    original = rl.scoring.group_advantages
    flipped = []

    def negated(*args, **kwargs):
        flipped.append(1)
        return -original(*args, **kwargs)

    monkeypatch.setattr(rl.scoring, "group_advantages", negated)
    summary, _ = _train(pretrained_tiny_model, tmp_path, 0, "flipped")
    assert len(flipped) >= STEPS * 32  # every group of every step (32 prompts) was scored flipped
    assert summary["gain_points"] < MARGIN_POINTS, f"flipped: {_gain(summary)}, want < +{MARGIN_POINTS:.0f}"
