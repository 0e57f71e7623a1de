"""Versions published as sparse deltas, pulled end to end over real Redis, HTTP peers and a file://
store: instances that follow every version, skip some, join mid-run or hold a broken base all load
exactly the published weights, or none; the store and the servers keep every delta's chain."""

from __future__ import annotations

import pytest
import torch

from infra.weights.config import WeightsConfig
from infra.weights.delta import diff
from infra.weights.manifest import encode, fingerprint
from infra.weights.publisher import WeightPublisher
from infra.weights.puller import STORE, PullError, WeightPuller

pytestmark = pytest.mark.integration


def _versions(count: int, fraction: float = 0.01) -> list[dict[str, torch.Tensor]]:
    """`count` successive bf16 state dicts, each with about `fraction` of its floats changed."""
    generator = torch.Generator().manual_seed(0)
    state = {
        "embed": torch.randn(256, 128, generator=generator).to(torch.bfloat16),
        "proj": torch.randn(128, 128, generator=generator).to(torch.bfloat16),
        "norm": torch.ones(128, dtype=torch.bfloat16),
        "position": torch.arange(16),
    }
    versions = [state]
    for _ in range(count - 1):
        state = {name: tensor.clone() for name, tensor in state.items()}
        for tensor in state.values():
            if tensor.is_floating_point():
                flat = tensor.view(-1)
                picked = torch.rand(flat.numel(), generator=generator) < fraction
                flat[picked] = (flat[picked].float() * 1.05 + 0.01).to(torch.bfloat16)
        versions.append(state)
    return versions


def _publish(publisher: WeightPublisher, versions, start: int = 0, stop: int | None = None) -> None:
    for version in range(start, len(versions) if stop is None else stop):
        publisher.publish(version, versions[version])
    publisher.flush(timeout=30)


def test_an_instance_following_every_version_pulls_small_deltas_and_rebuilds_them_exactly(redis_client, run):
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 64, full_every=10)
    versions = _versions(5)
    whole = encode(versions[0], 0, config.chunk_bytes).manifest.total_bytes
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    puller = WeightPuller(config, redis_client, run_id, "instance", run_dir=run_dir)
    try:
        for version, state in enumerate(versions):
            _publish(publisher, versions, version, version + 1)
            assert fingerprint(puller.pull(version)) == fingerprint(state)
            report = puller.last_report
            assert report.full_fallbacks == 0
            if version:
                assert publisher.store.read_manifest(version).base == version - 1
                assert report.delta_bytes == report.bytes < 0.05 * whole
        assert publisher.store.read_manifest(0).base is None
    finally:
        puller.close()
        publisher.close()


def test_the_publisher_measures_the_bytes_an_instance_pulls_per_version(redis_client, run):
    """What the capacity manager prices an instance's egress with (`WeightPublisher.updates`): the
    whole version's bytes until a delta is encoded, then the deltas' mean, which is what an
    instance following every version pulls."""
    run_id, run_dir, _ = run
    config = WeightsConfig(chunk_mb=1 / 64, full_every=10)
    versions = _versions(4)
    whole = encode(versions[0], 0, config.chunk_bytes).manifest.total_bytes
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    puller = WeightPuller(config, redis_client, run_id, "instance", run_dir=run_dir)
    try:
        assert publisher.updates() is None
        _publish(publisher, versions, 0, 1)
        first = publisher.updates()
        assert first is not None and (first.bytes_per_version, first.versions_per_hour) == (whole, 0.0)
        puller.pull(0)
        pulled = []
        for version in range(1, len(versions)):
            _publish(publisher, versions, version, version + 1)
            puller.pull(version)
            pulled.append(puller.last_report.bytes)
        updates = publisher.updates()
        assert updates is not None and updates.versions_per_hour > 0
        assert updates.bytes_per_version == pytest.approx(sum(pulled) / len(pulled))
        assert updates.bytes_per_version < 0.05 * whole
    finally:
        puller.close()
        publisher.close()


def test_a_new_instance_joining_mid_run_gets_the_whole_version_and_the_deltas_after_it(redis_client, run):
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 64, full_every=4, keep_versions=1, keep_in_memory=1)
    versions = _versions(7)  # whole: 0 and 4; deltas 1-3 and 5-6
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    joining = WeightPuller(config, redis_client, run_id, "joining", run_dir=run_dir)
    try:
        _publish(publisher, versions)
        assert [publisher.store.read_manifest(v).base for v in (4, 5, 6)] == [None, 4, 5]
        assert publisher.store.complete_versions() == [4, 5, 6]  # 6's chain, nothing older
        assert fingerprint(joining.pull(6)) == fingerprint(versions[6])
        report = joining.last_report
        assert report.full_fallbacks == 1  # it lacked 6's base
        assert report.bytes > report.delta_bytes > 0
        assert joining.held_versions == [4, 5, 6]  # it serves the chain too
        assert registry.leased_versions() == set()
    finally:
        joining.close()
        publisher.close()


def test_from_the_store_alone_after_the_trainer_is_gone(redis_client, run):
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 64, full_every=10, serve_from_peers=False)
    versions = _versions(4)
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    _publish(publisher, versions)
    publisher.close()
    puller = WeightPuller(config, redis_client, run_id, "instance", run_dir=run_dir)
    try:
        assert fingerprint(puller.pull(3)) == fingerprint(versions[3])
        assert set(puller.last_report.bytes_by_source) == {STORE}
    finally:
        puller.close()


def test_a_peer_serves_the_chain_to_a_joining_instance(redis_client, run, tmp_path):
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 64, full_every=10, store_url=(tmp_path / "elsewhere").as_uri())
    versions = _versions(3)
    publisher = WeightPublisher(config, redis_client, run_id)
    first, second = (WeightPuller(config, redis_client, run_id, f"instance-{i}") for i in range(2))
    try:
        _publish(publisher, versions)
        assert fingerprint(first.pull(2)) == fingerprint(versions[2])
        publisher.close()
        publisher.store.delete(0)  # the whole version survives only on the first instance
        assert fingerprint(second.pull(2)) == fingerprint(versions[2])
        assert second.last_report.bytes_by_source[first.url] > 0
    finally:
        first.close()
        second.close()
        publisher.close()


def test_an_instance_that_skipped_versions_applies_the_deltas_it_missed(redis_client, run):
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 64, full_every=10)
    versions = _versions(5)
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    puller = WeightPuller(config, redis_client, run_id, "instance", run_dir=run_dir)
    try:
        _publish(publisher, versions, 0, 2)
        puller.pull(1)
        _publish(publisher, versions, 2)
        assert fingerprint(puller.pull(4)) == fingerprint(versions[4])
        report = puller.last_report
        assert report.full_fallbacks == 0 and report.bytes == report.delta_bytes  # 2, 3, 4 on its 1
    finally:
        puller.close()
        publisher.close()


def test_a_broken_base_falls_back_to_the_whole_version_never_to_wrong_weights(redis_client, run):
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 64, full_every=10)
    versions = _versions(3)
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    puller = WeightPuller(config, redis_client, run_id, "instance", run_dir=run_dir)
    try:
        _publish(publisher, versions, 0, 2)
        held = puller.pull(1)
        held["proj"].view(-1)[5] += 1  # the held base no longer is version 1 (it is read only)
        _publish(publisher, versions, 2)
        assert fingerprint(puller.pull(2)) == fingerprint(versions[2])
        report = puller.last_report
        assert report.full_fallbacks == 1
        assert any("sha256 does not match" in failure for failure in report.failures)
    finally:
        puller.close()
        publisher.close()


def test_a_delta_that_rebuilds_wrong_weights_is_never_loaded_or_served(redis_client, run):
    """A published delta whose chunks verify but whose result is not the version (a publisher bug,
    or a tampered store and Redis): the pull fails and the instance holds and serves nothing new."""
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 64, full_every=10, serve_from_trainer=False)
    versions = _versions(3)
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    puller = WeightPuller(config, redis_client, run_id, "instance", run_dir=run_dir)
    try:
        _publish(publisher, versions, 0, 2)
        puller.pull(1)
        wrong = dict(versions[2], norm=versions[2]["norm"] * 2)
        tampered = encode(
            diff(versions[1], wrong),
            2,
            config.chunk_bytes,
            parent=1,
            base=1,
            full_sha256=fingerprint(versions[2]),  # claims to rebuild version 2
        )
        publisher.store.write(tampered)
        registry.record_manifest(2, tampered.manifest_sha256)
        registry.announce(2)
        with pytest.raises(PullError, match="cannot be rebuilt"):
            puller.pull(2)
        assert puller.last_report.full_fallbacks == 1  # it tried the whole version and the chain too
        assert puller.held_versions == [0, 1]
        assert 2 not in puller.server.versions()
        assert fingerprint(puller.pull(1)) == fingerprint(versions[1])
    finally:
        puller.close()
        publisher.close()


def test_store_retention_keeps_each_kept_or_leased_versions_chain(redis_client, run):
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 64, full_every=3, keep_versions=1, keep_in_memory=1)
    versions = _versions(8)  # whole: 0, 3, 6
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    try:
        _publish(publisher, versions, 0, 3)
        assert publisher.store.complete_versions() == [0, 1, 2]
        registry.lease(2, "a-slow-instance")
        _publish(publisher, versions, 3, 5)
        assert publisher.store.complete_versions() == [0, 1, 2, 3, 4]  # 2 is leased: its chain stays
        registry.unlease(2, "a-slow-instance")
        _publish(publisher, versions, 5)
        assert publisher.store.complete_versions() == [6, 7]
        assert registry.recorded_versions() == [6, 7]
    finally:
        publisher.close()


def test_full_every_one_publishes_whole_versions_only(redis_client, run):
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 64, full_every=1, keep_versions=3)
    versions = _versions(3)
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    try:
        for version in range(3):
            _publish(publisher, versions, version, version + 1)
        assert [publisher.store.read_manifest(v).base for v in range(3)] == [None, None, None]
    finally:
        publisher.close()


def test_a_delta_no_smaller_than_the_whole_version_is_published_whole(redis_client, run):
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 64, full_every=10, keep_versions=3)
    first, _, third = _versions(3)
    generator = torch.Generator().manual_seed(7)
    everything_changed = {  # random bits: their differences from the old do not compress
        name: torch.randint(-(2**15), 2**15, tensor.shape, dtype=torch.int16, generator=generator).view(tensor.dtype)
        if tensor.dtype == torch.bfloat16
        else torch.randint(-(2**62), 2**62, tensor.shape, generator=generator)
        for name, tensor in first.items()
    }
    versions = [first, everything_changed, dict(everything_changed, proj=third["proj"])]
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    try:
        for version in range(3):
            _publish(publisher, versions, version, version + 1)
        assert [publisher.store.read_manifest(v).base for v in range(3)] == [None, None, 1]
    finally:
        publisher.close()
