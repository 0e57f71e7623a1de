"""The chunk-level swarm over real HTTP and Redis: partial holders serve the chunks they have
verified, refuse the others without being dropped, are skipped when they serve corrupt bytes, and
withdraw their offer when their pull fails; pullers started together all finish with the
published bytes, trading chunks instead of each taking the whole version from the trainer."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from infra.weights.config import WeightsConfig
from infra.weights.holders import chunk_bitmap, mark_chunk
from infra.weights.manifest import EncodedVersion, encode, fingerprint
from infra.weights.peer_client import PeerClient, SourceFailed, SourceLacks
from infra.weights.peer_server import PeerServer
from infra.weights.publisher import WeightPublisher
from infra.weights.puller import STORE, PullError, WeightPuller
from tests.helpers import PEER_SECRET

pytestmark = pytest.mark.integration


def _state_dict(megabytes: float, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    rows = max(1, int(megabytes * 2**20 / (256 * 4) / 4))
    return {f"layer{i}.weight": torch.randn(rows, 256) for i in range(4)}


def _stored(publisher: WeightPublisher, version: int) -> EncodedVersion:
    """The version exactly as published, read back from the publisher's store."""
    store = publisher.store
    manifest = store.read_manifest(version)
    chunks = tuple(store.read_chunk(version, info.file) for info in manifest.chunks)
    return EncodedVersion(manifest=manifest, manifest_bytes=store.read_manifest_bytes(version), chunks=chunks)


def _partial_peer(encoded: EncodedVersion, chunks: dict[int, bytes], advertised, registry) -> PeerServer:
    """A peer server holding `chunks` of `encoded` (index -> bytes), advertised as holding `advertised`."""
    server = PeerServer(WeightsConfig())
    server.offer_manifest(encoded.manifest, encoded.manifest_bytes)
    for index, data in chunks.items():
        server.offer_chunk(encoded.version, index, data)
    bitmap = chunk_bitmap(len(encoded.chunks))
    for index in advertised:
        mark_chunk(bitmap, index)
    registry.hold_chunks(encoded.version, server.url, bytes(bitmap), bytes(len(bitmap)))
    return server


def test_a_partial_holder_serves_the_chunks_it_has_and_refuses_the_others_without_being_dropped(redis_client, run):
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 64, parallel_fetches=1, chunk_timeout_s=5, pull_timeout_s=30)
    state_dict = _state_dict(0.25)
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    publisher.publish(1, state_dict)
    publisher.flush(timeout=30)
    publisher.close()  # the trainer is gone: the partial peer and the store are left
    encoded = _stored(publisher, 1)
    assert len(encoded.chunks) >= 12
    partial = _partial_peer(encoded, {0: encoded.chunks[0]}, advertised=range(8), registry=registry)
    client = PeerClient(PEER_SECRET.encode(), config)
    puller = WeightPuller(config, redis_client, run_id, "instance", run_dir=run_dir)
    try:
        held, missing = (f"/weights/v1/{encoded.manifest.chunks[i].file}" for i in (0, 1))
        assert client.get(partial.url, held, {}) == encoded.chunks[0]
        with pytest.raises(SourceLacks):
            client.get(partial.url, missing, {})
        assert client.get(partial.url, "/weights/v1/manifest.json", {}) == encoded.manifest_bytes
        with pytest.raises(SourceFailed, match="HTTP 404") as refused:
            client.get(partial.url, "/weights/v2/manifest.json", {})  # a version it does not serve at all
        assert not isinstance(refused.value, SourceLacks)
        assert partial.versions() == []  # nothing served whole

        # one request at a time, rarest first: the store's chunks, then the 8 it advertises in
        # random order; whichever of them came first, the held one still comes from it
        assert fingerprint(puller.pull(1)) == fingerprint(state_dict)
        report = puller.last_report
        assert report.bytes_by_source[partial.url] == len(encoded.chunks[0])
        assert report.bytes_by_source[STORE] == report.bytes - len(encoded.chunks[0])
        assert not [failure for failure in report.failures if failure.startswith(partial.url)]
    finally:
        client.close()
        puller.close()
        partial.close()


def test_a_corrupt_chunk_from_a_partial_holder_is_fetched_elsewhere(redis_client, run):
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 64, chunk_timeout_s=5, pull_timeout_s=30)
    state_dict = _state_dict(0.5)
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    puller = WeightPuller(config, redis_client, run_id, "instance", run_dir=run_dir)
    partial = None
    try:
        publisher.publish(1, state_dict)
        publisher.flush(timeout=30)
        encoded = _stored(publisher, 1)
        corrupt = {}
        for index in range(4):
            flipped = bytearray(encoded.chunks[index])
            flipped[len(flipped) // 2] ^= 0xFF
            corrupt[index] = bytes(flipped)
        # The trainer's requests fill up on the chunks only it holds, so the corrupt ones go here.
        partial = _partial_peer(encoded, corrupt, advertised=range(4), registry=registry)
        assert fingerprint(puller.pull(1)) == fingerprint(state_dict)
        report = puller.last_report
        assert any(f.startswith(f"{partial.url}: chunk") and "corrupt" in f for f in report.failures)
        assert report.bytes_by_source.get(partial.url, 0) == 0
        assert report.bytes_by_source[publisher.url] == report.bytes
        assert partial.bytes_sent > 0
    finally:
        puller.close()
        if partial is not None:
            partial.close()
        publisher.close()


def test_pullers_started_together_all_finish_with_the_published_bytes_trading_chunks(redis_client, run):
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 32, upload_cap_mb_s=4, chunk_timeout_s=10, pull_timeout_s=60)
    state_dict = _state_dict(2)
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    pullers = [WeightPuller(config, redis_client, run_id, f"instance-{i}", run_dir=run_dir) for i in range(4)]
    pulled: dict[int, str] = {}
    seen_partial: set[str] = set()
    served_while_pulling: set[str] = set()
    try:
        publisher.publish(1, state_dict)
        publisher.flush(timeout=30)
        size = _stored(publisher, 1).manifest.total_bytes

        def pull(i: int) -> None:
            pulled[i] = fingerprint(pullers[i].pull(1))

        threads = [threading.Thread(target=pull, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            seen_partial |= {url for url, partial in registry.partial_holders(1).items() if partial.held}
            served_while_pulling |= {p.url for p in pullers if p.server.bytes_sent and 1 not in p.server.versions()}
            time.sleep(0.01)
        assert pulled == dict.fromkeys(range(4), fingerprint(state_dict))
        assert seen_partial <= {p.url for p in pullers} and len(seen_partial) >= 2  # advertised while pulling
        assert set(registry.holders(1)) == {publisher.url} | {p.url for p in pullers}
        assert registry.partial_holders(1) == {}  # complete holders now
        assert served_while_pulling  # some served chunks before they held the whole version
        assert STORE not in {url for p in pullers for url in p.last_report.bytes_by_source}
        # about one copy from the trainer; a swarm of whole-version holders needs 1 + 1/2 + 1/3 + 1/4
        assert publisher.server.bytes_sent < 2 * size
    finally:
        for puller in pullers:
            puller.close()
        publisher.close()


def test_a_failed_pull_withdraws_its_partial_offer(redis_client, run):
    """The only source serves one corrupt chunk and the store is empty: the pull offers the chunks
    it verified while it runs, and none of them once it has failed."""
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 64, chunk_timeout_s=2, pull_timeout_s=3)
    encoded = encode(_state_dict(0.1), version=1, chunk_bytes=config.chunk_bytes)
    corrupt = list(encoded.chunks)
    corrupt[-1] = corrupt[-1][:-1] + bytes([corrupt[-1][-1] ^ 0xFF])
    bad_peer = PeerServer(WeightsConfig())
    bad_peer.offer(dataclasses.replace(encoded, chunks=tuple(corrupt)))
    registry.record_manifest(1, encoded.manifest_sha256)
    registry.hold(1, bad_peer.url)
    puller = WeightPuller(config, redis_client, run_id, "instance", run_dir=run_dir)
    client = PeerClient(PEER_SECRET.encode(), config)
    offered: list[frozenset[int]] = []

    def watch() -> None:
        while not offered:
            offered.extend(partial.held for url, partial in registry.partial_holders(1).items() if url == puller.url)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        watcher.start()
        with pytest.raises(PullError, match="chunks after"):
            puller.pull(1)
        watcher.join(timeout=5)
        assert offered and len(encoded.chunks) - 1 not in offered[0]  # offered while pulling: verified chunks
        assert registry.partial_holders(1) == {}
        assert puller.url not in registry.holders(1)
        assert puller.held_versions == [] and puller.server.versions() == []
        for path in ("/weights/v1/manifest.json", f"/weights/v1/{encoded.manifest.chunks[0].file}"):
            with pytest.raises(SourceFailed, match="HTTP 404") as refused:
                client.get(puller.url, path, {})
            assert not isinstance(refused.value, SourceLacks)  # not served at all
    finally:
        client.close()
        puller.close()
        bad_peer.close()
