"""Peer servers over real HTTP: authentication, bounded uploads, and pullers facing corrupt,
tampered or slow peers."""

from __future__ import annotations

import dataclasses
import http.client
import threading
import time
import uuid
from urllib.parse import urlsplit

import pytest
import torch

from infra.weights.auth import authorization
from infra.weights.config import WeightsConfig
from infra.weights.holders import HolderRegistry
from infra.weights.manifest import EncodedVersion, encode, fingerprint
from infra.weights.peer_server import PeerServer
from infra.weights.publisher import WeightPublisher
from infra.weights.puller import STORE, WeightPuller
from tests.helpers import PEER_SECRET

pytestmark = pytest.mark.integration


def _state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, 64) for i in range(4)} | {"bias": torch.randn(64)}


def _get(url: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read(), {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()


def _stored(publisher: WeightPublisher, version: int) -> EncodedVersion:
    """The version exactly as published, read back from the publisher's store."""
    store = publisher.store
    manifest = store.read_manifest(version)
    chunks = tuple(store.read_chunk(version, info.file) for info in manifest.chunks)
    return EncodedVersion(manifest=manifest, manifest_bytes=store.read_manifest_bytes(version), chunks=chunks)


def _corrupted(encoded: EncodedVersion) -> EncodedVersion:
    """The same version with every chunk's middle byte flipped (the manifest is the genuine one)."""
    chunks = []
    for data in encoded.chunks:
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0xFF
        chunks.append(bytes(flipped))
    return dataclasses.replace(encoded, chunks=tuple(chunks))


@pytest.fixture
def run(redis_client, tmp_path):
    """(config, run_id, run_dir, registry) of a fresh run; the registry's entries go on teardown."""
    config = WeightsConfig(chunk_mb=4096 / 2**20, chunk_timeout_s=5, pull_timeout_s=30)
    run_id = uuid.uuid4().hex
    registry = HolderRegistry(redis_client, run_id, ttl_s=10)
    yield config, run_id, tmp_path, registry
    registry.close()


def test_requests_without_or_with_a_wrong_secret_get_401_and_no_bytes():
    encoded = encode(_state_dict(), version=1, chunk_bytes=4096)
    server = PeerServer(WeightsConfig())
    server.offer(encoded)
    chunk = f"/weights/v1/{encoded.manifest.chunks[0].file}"
    try:
        for path in (chunk, "/weights/v1/manifest.json", "/weights/v99/manifest.json", "/anything"):
            for headers in (
                {},
                {"Authorization": f"Bearer {PEER_SECRET}"},
                {"Authorization": authorization(b"not-the-secret-but-long-enough", "GET", path)},
                {"Authorization": authorization(PEER_SECRET.encode(), "GET", path, now=0)},
                {"Authorization": authorization(PEER_SECRET.encode(), "GET", "/weights/v1/other")},
            ):
                status, body, response_headers = _get(server.url, path, headers)
                assert (status, body, response_headers["content-length"]) == (401, b"", "0"), (path, headers)
        status, body, _ = _get(server.url, chunk, {"Authorization": authorization(PEER_SECRET.encode(), "GET", chunk)})
        assert (status, body) == (200, encoded.chunks[0])
        assert server.bytes_sent == len(encoded.chunks[0])
    finally:
        server.close()


def test_uploads_per_server_are_bounded_and_excess_requests_get_503():
    encoded = encode({"w": torch.randn(64 * 1024)}, version=1, chunk_bytes=1 << 20)  # one 256 KiB chunk
    server = PeerServer(WeightsConfig(max_uploads_per_peer=1, queue_timeout_s=0.2, upload_cap_mb_s=0.5))
    server.offer(encoded)
    path = f"/weights/v1/{encoded.manifest.chunks[0].file}"
    results: list[tuple[int, bytes]] = []

    def fetch() -> None:
        status, body, _ = _get(server.url, path, {"Authorization": authorization(PEER_SECRET.encode(), "GET", path)})
        results.append((status, body))

    try:
        threads = [threading.Thread(target=fetch) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(status for status, _ in results) == [200, 503, 503]
        assert [body for status, body in results if status == 200] == [encoded.chunks[0]]
        assert all(body == b"" for status, body in results if status == 503)
        deadline = time.monotonic() + 5
        while server.slots.busy and time.monotonic() < deadline:  # released just after the last byte
            time.sleep(0.01)
        assert server.slots.busy == 0
    finally:
        server.close()


def test_a_peer_serving_corrupt_chunks_is_detected_and_the_chunks_come_from_elsewhere(redis_client, run):
    config, run_id, run_dir, registry = run
    state_dict = _state_dict()
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    bad_peer = PeerServer(WeightsConfig())
    first, second = (WeightPuller(config, redis_client, run_id, f"instance-{i}", run_dir=run_dir) for i in range(2))
    try:
        publisher.publish(1, state_dict)
        publisher.flush(timeout=30)
        bad_peer.offer(_corrupted(_stored(publisher, 1)))
        registry.hold(1, bad_peer.url)

        assert fingerprint(first.pull(1)) == fingerprint(state_dict)
        report = first.last_report
        assert any(f.startswith(f"{bad_peer.url}: chunk") and "corrupt" in f for f in report.failures)
        assert report.bytes_by_source.get(bad_peer.url, 0) == 0
        assert report.bytes_by_source[publisher.url] > 0
        assert bad_peer.bytes_sent > 0

        publisher.close()  # the trainer is gone: only the corrupt peer and the store are left
        assert fingerprint(second.pull(1)) == fingerprint(state_dict)
        sources = second.last_report.bytes_by_source
        assert sources.get(bad_peer.url, 0) == 0
        assert sources.get(STORE, 0) + sources.get(first.url, 0) == second.last_report.bytes
    finally:
        first.close()
        second.close()
        bad_peer.close()
        publisher.close()


def test_a_tampered_manifest_is_rejected(redis_client, run):
    """A peer whose manifest is self-consistent but not the one the trainer published is ignored."""
    config, run_id, run_dir, registry = run
    state_dict = _state_dict()
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    impostor = PeerServer(WeightsConfig())
    puller = WeightPuller(config, redis_client, run_id, "instance-0", run_dir=run_dir)
    try:
        publisher.publish(1, state_dict)
        publisher.flush(timeout=30)
        publisher.server.withdraw(1)  # only the impostor and the store remain
        impostor.offer(encode(_state_dict(seed=666), version=1, chunk_bytes=4096))
        registry.hold(1, impostor.url)
        assert fingerprint(puller.pull(1)) == fingerprint(state_dict)
        assert puller.last_report.bytes_by_source.get(impostor.url, 0) == 0
        assert set(puller.last_report.bytes_by_source) <= {STORE, publisher.url}
    finally:
        puller.close()
        impostor.close()
        publisher.close()


def test_a_slow_peer_is_abandoned_and_its_chunk_fetched_elsewhere(redis_client, run):
    config, run_id, run_dir, registry = run
    config = config.model_copy(update={"chunk_mb": 16 / 1024, "chunk_timeout_s": 0.5})
    # whole 16 KiB chunks only: a tiny last one (the bias) would reach the puller in time even from it
    state_dict = {name: tensor for name, tensor in _state_dict().items() if name != "bias"}
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    slow_peer = PeerServer(WeightsConfig(upload_cap_mb_s=4 / 1024))  # a 16 KiB chunk takes 4 s
    puller = WeightPuller(config, redis_client, run_id, "instance-0", run_dir=run_dir)
    try:
        publisher.publish(1, state_dict)
        publisher.flush(timeout=30)
        slow_peer.offer(_stored(publisher, 1))
        registry.hold(1, slow_peer.url)
        assert fingerprint(puller.pull(1)) == fingerprint(state_dict)
        report = puller.last_report
        assert any(f.startswith(f"{slow_peer.url}: chunk") and "slow" in f for f in report.failures)
        assert report.bytes_by_source.get(slow_peer.url, 0) == 0
        assert report.seconds < 4
    finally:
        puller.close()
        slow_peer.close()
        publisher.close()
