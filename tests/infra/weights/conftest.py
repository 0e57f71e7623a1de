"""Fixtures of the weight-transfer tests: the peers' shared secret, and a fresh run's holder registry."""

from __future__ import annotations

import uuid

import pytest

from infra.weights.holders import HolderRegistry
from rl import env_vars
from tests.helpers import PEER_SECRET


@pytest.fixture(autouse=True)
def _peer_secret(monkeypatch):
    monkeypatch.setenv(env_vars.WEIGHTS_SECRET, PEER_SECRET)


@pytest.fixture
def run(redis_client, tmp_path):
    """(run_id, run_dir, registry) of a fresh run; the registry's entries go on teardown."""
    run_id = uuid.uuid4().hex
    registry = HolderRegistry(redis_client, run_id, ttl_s=10)
    yield run_id, tmp_path, registry
    registry.close()
