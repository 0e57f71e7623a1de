"""A copy of a version that fails its check never strands an instance (real Redis, a file:// store,
real publishers, the worker's `PulledWeights` and its puller): the trainer is gone, so an instance
reads version 1, a delta, from the store first, where a chunk or the manifest was tampered with.
The failure is logged at once naming the instance, the version and the source; the try gives up
at once instead of after `pull_timeout_s`; the next one takes the version from the restarted
trainer's peer server (it publishes its version again, whole), and the step's weight traffic
counts the fallback."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import pytest
import torch

from infra.rollout.weight_source import RETRY_S, PulledWeights
from infra.run.accounting import weight_traffic
from infra.weights.config import WeightsConfig
from infra.weights.manifest import MANIFEST_FILE, fingerprint
from infra.weights.publisher import WeightPublisher
from infra.weights.shared import drain_transfers, share_config
from tests.helpers import wait_for

pytestmark = pytest.mark.integration


def _versions() -> list[dict[str, torch.Tensor]]:
    """Two successive bf16 state dicts, about 1% of the second's floats changed."""
    generator = torch.Generator().manual_seed(0)
    first = {name: torch.randn(128, 128, generator=generator).to(torch.bfloat16) for name in ("embed", "proj")}
    second = {name: tensor.clone() for name, tensor in first.items()}
    for tensor in second.values():
        flat = tensor.view(-1)
        picked = torch.rand(flat.numel(), generator=generator) < 0.01
        flat[picked] = (flat[picked].float() * 1.05 + 0.01).to(torch.bfloat16)
    return [first, second]


def _tamper(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("part", ["chunk", "manifest"])
def test_a_tampered_store_copy_is_logged_at_once_and_the_version_comes_from_another_source(
    redis_client, tmp_path, caplog, part
):
    run_id = uuid.uuid4().hex
    config = WeightsConfig(chunk_mb=1 / 64, full_every=10, pull_timeout_s=600)
    share_config(redis_client, run_id, config, tmp_path)
    versions = _versions()
    weights = PulledWeights(redis_client, run_id, "spot-0")
    trainer = WeightPublisher(config, redis_client, run_id, run_dir=tmp_path)
    restarted = None
    try:
        trainer.publish(0, versions[0])
        trainer.flush(timeout=30)
        assert fingerprint(weights.fetch(0)) == fingerprint(versions[0])
        weights.loaded(0)
        trainer.publish(1, versions[1])
        trainer.close()  # the driver is gone: version 1, a delta on 0, is only in the store
        manifest = trainer.store.read_manifest(1)
        assert manifest.base == 0
        name = manifest.chunks[0].file if part == "chunk" else MANIFEST_FILE
        _tamper(Path(trainer.store.version_dir(1)) / name)
        drain_transfers(redis_client, run_id)

        started = time.monotonic()
        with caplog.at_level(logging.WARNING):
            assert weights.fetch(1) is None  # no peer holds it: the store first, whose copy fails
        assert time.monotonic() - started < config.pull_timeout_s / 10  # at once, not after the timeout
        what = "chunk 0" if part == "chunk" else "manifest"
        assert any(
            record.getMessage().startswith(f"instance spot-0: policy version 1: the {what} from store failed its check")
            for record in caplog.records
        ), [record.getMessage() for record in caplog.records]
        assert weights.fetch(1) is None  # within RETRY_S of the failure: no new try yet

        restarted = WeightPublisher(config, redis_client, run_id, run_dir=tmp_path)
        restarted.publish(1, versions[1])  # a new driver publishes its version again, whole
        wait_for(lambda: restarted.url in trainer.registry.holders(1), "the restarted trainer serving version 1")
        pulled: list = []
        wait_for(lambda: pulled.append(weights.fetch(1)) or pulled[-1] is not None, "version 1", timeout_s=10 * RETRY_S)
        assert fingerprint(pulled[-1]) == fingerprint(versions[1])
        weights.loaded(1)
        (transfer,) = drain_transfers(redis_client, run_id)
        assert (transfer.source, transfer.version, transfer.source_fallbacks) == (restarted.url, 1, 1)
        assert weight_traffic([transfer]).source_fallbacks == 1  # the step table's fallbacks
    finally:
        weights.close()
        trainer.close()
        if restarted is not None:
            restarted.close()
