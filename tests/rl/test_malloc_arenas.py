"""Tests for rl/malloc_arenas.py: the cap is set through glibc, and a user's own setting wins."""

from __future__ import annotations

import sys

from rl.malloc_arenas import cap_malloc_arenas


def test_the_cap_is_set_on_glibc_and_left_to_a_users_setting(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert cap_malloc_arenas() is sys.platform.startswith("linux")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert cap_malloc_arenas() is False
