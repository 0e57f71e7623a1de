"""The shared pretraining of `pretrained_tiny_model` (`tests.pretrained`): a pretraining that failed
or was killed elsewhere fails the next taker at once, with its reason, and pretrains nothing."""

from __future__ import annotations

import pytest

from tests.pretrained import FAILED, PretrainingFailed, pretrained_model


def test_a_pretraining_that_failed_elsewhere_fails_at_once_with_its_reason(tmp_path):
    (tmp_path / FAILED).write_text("it stopped before it ended (killed or timed out)")
    with pytest.raises(PretrainingFailed, match="killed or timed out"):
        pretrained_model(tmp_path)
    assert not (tmp_path / "pretrained").exists()
