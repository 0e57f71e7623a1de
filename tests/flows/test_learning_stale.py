"""It learns with bounded staleness: the demo at K = 2 gains as much as on-policy
(`tests/flows/test_learning.py` has the method and the measured figures)."""

from __future__ import annotations

import pytest

from tests.flows.test_learning import assert_learns

pytestmark = pytest.mark.integration


def test_grpo_raises_held_out_accuracy_two_versions_stale(prefect_harness, pretrained_tiny_model, tmp_path):
    assert_learns(pretrained_tiny_model, tmp_path, 2)
