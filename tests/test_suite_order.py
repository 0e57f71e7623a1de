"""The full run's schedule hint (`tests/conftest.py` HEAVY_FIRST) names files that exist."""

from __future__ import annotations

from tests.conftest import HEAVY_FIRST
from tests.helpers import REPO_ROOT


def test_every_file_scheduled_first_exists_once():
    assert len(set(HEAVY_FIRST)) == len(HEAVY_FIRST)
    assert [path for path in HEAVY_FIRST if not (REPO_ROOT / path).is_file()] == []
