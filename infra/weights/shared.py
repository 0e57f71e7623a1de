"""What the trainer and the rollout instances of a run share about weights through Redis.

* The run's `WeightsConfig` with its store URL resolved (``rlb:{<run_id>}:weights:config``): the
  trainer writes it once (`share_config`), and an instance reads it when it first needs weights
  (`shared_config`), so instances need no weights flags, wherever they run. The secret is not in
  it: each side reads it from its own environment (`WeightsConfig.secret_env`).
* Transfer reports (``rlb:{<run_id>}:weights:transfers``, a list): an instance pushes one per
  completed pull (`report_transfer`) and the trainer's accounting drains them into the cost
  ledger (`drain_transfers`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import redis

from infra.keyspace import weights_config_key, weights_transfers_key
from infra.weights.config import WeightsConfig
from infra.weights.puller import PullReport


def _config_key(run_id: str) -> str:
    return weights_config_key(run_id)


def _transfers_key(run_id: str) -> str:
    return weights_transfers_key(run_id)


def share_config(client: redis.Redis, run_id: str, config: WeightsConfig, run_dir: str | Path | None) -> WeightsConfig:
    """Store `config` for the run's instances, with `store_url` resolved; returns what was stored."""
    resolved = config.model_copy(update={"store_url": config.resolve_store_url(run_dir)})
    client.set(_config_key(run_id), resolved.model_dump_json())
    return resolved


def shared_config(client: redis.Redis, run_id: str) -> WeightsConfig | None:
    """The run's weights settings, or None before the trainer shared them."""
    raw = client.get(_config_key(run_id))
    return None if raw is None else WeightsConfig.model_validate_json(raw)


@dataclass(frozen=True)
class Transfer:
    """Bytes of one version that one instance received from one source."""

    instance_id: str
    version: int
    source: str
    """A peer server's base URL, or `store`."""
    nbytes: int
    seconds: float
    full_fallbacks: int = 0
    """Whole versions this pull fetched because a delta could not be applied (counted once per pull)."""
    source_fallbacks: int = 0
    """Payloads this pull took from other sources after a copy failed its check (once per pull)."""


def report_transfer(client: redis.Redis, run_id: str, report: PullReport) -> None:
    """Record a completed pull, one entry per source it received bytes from."""
    entries = [
        json.dumps(
            {
                "instance_id": report.instance_id,
                "version": report.version,
                "source": source,
                "nbytes": nbytes,
                "seconds": report.seconds,
                "full_fallbacks": report.full_fallbacks if i == 0 else 0,
                "source_fallbacks": report.source_fallbacks if i == 0 else 0,
            }
        )
        for i, (source, nbytes) in enumerate(sorted(report.bytes_by_source.items()))
    ]
    if entries:
        client.rpush(_transfers_key(run_id), *entries)


def drain_transfers(client: redis.Redis, run_id: str) -> list[Transfer]:
    """Take every transfer reported so far (each is returned once)."""
    pipe = client.pipeline(transaction=True)
    pipe.lrange(_transfers_key(run_id), 0, -1)
    pipe.delete(_transfers_key(run_id))
    raw, _ = pipe.execute()
    return [Transfer(**json.loads(entry)) for entry in raw]
