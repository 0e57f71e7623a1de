"""Store retention policy: what may be deleted, and what never is."""

from __future__ import annotations

import pytest

from infra.weights.retention import versions_to_delete


def test_keeps_the_newest_complete_versions():
    versions = {1: True, 2: True, 3: True, 4: True}
    assert versions_to_delete(versions, leased=set(), keep=2) == [1, 2]
    assert versions_to_delete(versions, leased=set(), keep=1) == [1, 2, 3]
    assert versions_to_delete(versions, leased=set(), keep=10) == []


def test_never_deletes_a_version_being_pulled():
    versions = {1: True, 2: True, 3: True}
    assert versions_to_delete(versions, leased={1}, keep=1) == [2]


def test_newest_complete_version_survives_even_when_newer_uploads_are_incomplete():
    versions = {5: True, 6: False, 7: False}
    assert versions_to_delete(versions, leased=set(), keep=1) == []


def test_incomplete_versions_older_than_the_newest_complete_one_are_deleted_unless_leased():
    versions = {1: False, 2: True, 3: False, 4: True, 5: False}
    assert versions_to_delete(versions, leased=set(), keep=1) == [1, 2, 3]
    assert versions_to_delete(versions, leased={3}, keep=2) == [1]


def test_nothing_is_deleted_without_a_complete_version():
    assert versions_to_delete({1: False, 2: False}, leased=set(), keep=1) == []
    assert versions_to_delete({}, leased=set(), keep=1) == []


def test_keep_must_protect_at_least_the_newest():
    with pytest.raises(ValueError, match="keep must be >= 1"):
        versions_to_delete({1: True}, leased=set(), keep=0)
