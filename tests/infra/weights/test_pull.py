"""Pulling versions end to end over real HTTP, Redis and stores: a peer SIGKILLed mid-transfer,
the store-only and peer-only paths, monotonic versions, only verified chunks served while pulling
and only whole versions loaded, and store retention around pull leases."""

from __future__ import annotations

import http.client
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch

from infra.services.ports import free_port
from infra.weights.auth import authorization
from infra.weights.config import WeightsConfig
from infra.weights.holders import weights_channel
from infra.weights.manifest import encode, fingerprint
from infra.weights.peer_server import PeerServer
from infra.weights.publisher import WeightPublisher
from infra.weights.puller import STORE, AdapterBaseMismatch, PullError, WeightPuller
from tests.helpers import PEER_SECRET, REPO_ROOT

pytestmark = pytest.mark.integration

REPO = REPO_ROOT


def _state_dict(megabytes: float, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    rows = max(1, int(megabytes * 2**20 / (256 * 4) / 4))
    return {f"layer{i}.weight": torch.randn(rows, 256) for i in range(4)}


def _status(url: str, path: str) -> int:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", path, headers={"Authorization": authorization(PEER_SECRET.encode(), "GET", path)})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


class _InstanceProcess:
    """`python -m tests.infra.weights.instance` as a real child process, driven over stdin/stdout."""

    def __init__(self, redis_url: str, instance_id: str, run_dir: Path) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.infra.weights.instance",
                "--redis-url",
                redis_url,
                "--instance-id",
                instance_id,
                "--run-dir",
                str(run_dir),
            ],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def command(self, message: dict, timeout: float = 60) -> dict:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        assert ready, f"no answer to {message['op']} within {timeout} s"
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


def test_a_peer_killed_mid_transfer_does_not_stop_the_pull(redis_url, redis_client, run):
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 16, upload_cap_mb_s=2, holder_ttl_s=2, chunk_timeout_s=5, pull_timeout_s=60)
    state_dict = _state_dict(megabytes=4)
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    peer = _InstanceProcess(redis_url, "peer", run_dir)
    puller = WeightPuller(config, redis_client, run_id, "instance", run_dir=run_dir)
    try:
        publisher.publish(1, state_dict)
        publisher.flush(timeout=30)
        answer = peer.command({"op": "pull", "run_id": run_id, "version": 1, "config": config.model_dump()})
        assert answer["op"] == "pulled", answer
        assert peer.command({"op": "fingerprint", "version": 1})["fingerprint"] == fingerprint(state_dict)
        peer_url = answer["url"]
        assert set(registry.holders(1)) == {publisher.url, peer_url}

        killed_at_bytes: list[int] = []

        def kill_once_the_peer_has_served_some() -> None:
            while puller.last_report is None or puller.last_report.bytes_by_source.get(peer_url, 0) == 0:
                time.sleep(0.005)
            os.kill(peer.process.pid, signal.SIGKILL)
            killed_at_bytes.append(puller.last_report.bytes)

        killer = threading.Thread(target=kill_once_the_peer_has_served_some)
        killer.start()
        pulled = puller.pull(1)
        killer.join(timeout=10)

        assert peer.process.wait(timeout=10) == -signal.SIGKILL
        report = puller.last_report
        assert fingerprint(pulled) == fingerprint(state_dict)
        assert killed_at_bytes and killed_at_bytes[0] < report.bytes  # the pull was under way
        assert any(failure.startswith(peer_url) for failure in report.failures)
        assert STORE not in report.bytes_by_source  # the trainer delivered the rest
        assert report.bytes_by_source[publisher.url] > 0
        deadline = time.monotonic() + 10
        while peer_url in registry.holders(1) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert peer_url not in registry.holders(1)  # the dead peer aged out (holder_ttl_s)
    finally:
        peer.close()
        puller.close()
        publisher.close()


def test_store_only_when_no_peer_is_alive(redis_client, run):
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 64, chunk_timeout_s=5, pull_timeout_s=30)
    state_dict = _state_dict(megabytes=0.25)
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    publisher.publish(1, state_dict)
    publisher.flush(timeout=30)
    publisher.close()  # the trainer is gone
    dead = PeerServer(WeightsConfig())
    dead.close()
    registry.hold(1, dead.url)  # a holder that died without leaving the registry
    puller = WeightPuller(config, redis_client, run_id, "instance", run_dir=run_dir)
    try:
        assert fingerprint(puller.pull(1)) == fingerprint(state_dict)
        report = puller.last_report
        assert set(report.bytes_by_source) == {STORE}
        assert any(failure.startswith(dead.url) and "ConnectionRefused" in failure for failure in report.failures)
    finally:
        puller.close()


def test_peer_only_when_the_store_is_unreachable(redis_client, run):
    run_id, run_dir, registry = run
    unreachable = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}", "region_name": "us-west-2"},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
        "retries": 1,
    }
    config = WeightsConfig(
        store_url="s3://nowhere/run", store_options=unreachable, chunk_mb=1 / 64, chunk_timeout_s=5, pull_timeout_s=30
    )
    state_dict = _state_dict(megabytes=0.25)
    publisher = WeightPublisher(config, redis_client, run_id)
    first, second = (WeightPuller(config, redis_client, run_id, f"instance-{i}") for i in range(2))
    try:
        publisher.publish(1, state_dict)
        publisher.flush(timeout=60)
        assert publisher.last_upload_error is not None
        assert registry.latest() == 1  # announced anyway: the trainer serves it

        assert fingerprint(first.pull(1)) == fingerprint(state_dict)
        assert set(first.last_report.bytes_by_source) == {publisher.url}
        publisher.close()  # from now on only the first instance holds version 1
        assert fingerprint(second.pull(1)) == fingerprint(state_dict)
        assert set(second.last_report.bytes_by_source) == {first.url}
    finally:
        first.close()
        second.close()
        publisher.close()


def test_versions_are_monotonic(redis_client, run):
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 64)
    subscriber = redis_client.pubsub(ignore_subscribe_messages=True)
    subscriber.subscribe(weights_channel(run_id))
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    puller = WeightPuller(config, redis_client, run_id, "instance", run_dir=run_dir)
    try:
        publisher.publish(2, _state_dict(0.05, seed=2))
        with pytest.raises(ValueError, match="only move forward"):
            publisher.publish(1, _state_dict(0.05, seed=1))
        with pytest.raises(ValueError, match="only move forward"):
            publisher.publish(2, _state_dict(0.05, seed=2))
        publisher.publish(3, _state_dict(0.05, seed=3))
        publisher.flush(timeout=30)
        assert registry.latest() == 3
        assert not registry.announce(2)
        assert registry.latest() == 3
        announced = []
        deadline = time.monotonic() + 5
        while len(announced) < 2 and time.monotonic() < deadline:
            message = subscriber.get_message(timeout=0.1)
            if message:
                announced.append(int(message["data"]))
        assert announced == [2, 3]
        assert publisher.store.read_manifest(3).parent == 2

        assert fingerprint(puller.pull(3)) == fingerprint(_state_dict(0.05, seed=3))
        with pytest.raises(ValueError, match="only move forward"):
            puller.pull(2)
        assert fingerprint(puller.pull(3)) == fingerprint(_state_dict(0.05, seed=3))
    finally:
        subscriber.close()
        puller.close()
        publisher.close()


def test_an_instance_serves_only_verified_chunks_while_it_pulls_and_all_of_it_once_done(redis_client, run):
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 16, upload_cap_mb_s=1, chunk_timeout_s=5, pull_timeout_s=30)
    state_dict = _state_dict(megabytes=1)
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    puller = WeightPuller(config, redis_client, run_id, "instance", run_dir=run_dir)
    manifest_path = "/weights/v1/manifest.json"
    try:
        publisher.publish(1, state_dict)
        publisher.flush(timeout=30)
        manifest = publisher.store.read_manifest(1)
        result: dict = {}
        pulling = threading.Thread(target=lambda: result.update(state_dict=puller.pull(1)))
        pulling.start()
        offered: frozenset[int] = frozenset()
        while not offered:
            partial = registry.partial_holders(1).get(puller.url)
            offered = partial.held if partial else frozenset()
            time.sleep(0.005)
        assert 0 < len(offered) < len(manifest.chunks)
        assert 0 < puller.last_report.bytes < sum(t.numel() * 4 for t in state_dict.values())
        assert puller.url not in registry.holders(1)  # not a complete holder yet
        assert puller.server.versions() == []
        assert _status(puller.url, manifest_path) == 200
        assert all(_status(puller.url, f"/weights/v1/{manifest.chunks[i].file}") == 200 for i in offered)
        pulling.join(timeout=30)
        assert fingerprint(result["state_dict"]) == fingerprint(state_dict)
        assert puller.url in registry.holders(1)
        assert puller.url not in registry.partial_holders(1)
        assert puller.server.versions() == [1]
        assert all(_status(puller.url, f"/weights/v1/{info.file}") == 200 for info in manifest.chunks)
    finally:
        puller.close()
        publisher.close()


def test_a_failed_pull_keeps_nothing_and_serves_nothing(redis_client, run):
    """The only holder serves corrupt chunks and the store is empty: the pull fails, and the
    instance neither holds nor serves nor advertises any part of the version."""
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 64, chunk_timeout_s=2, pull_timeout_s=2)
    encoded = encode(_state_dict(0.1), version=1, chunk_bytes=config.chunk_bytes)
    corrupt = [bytearray(data) for data in encoded.chunks]
    corrupt[-1][-1] ^= 0xFF
    bad_peer = PeerServer(WeightsConfig())
    bad_peer.offer(type(encoded)(encoded.manifest, encoded.manifest_bytes, tuple(bytes(c) for c in corrupt)))
    registry.record_manifest(1, encoded.manifest_sha256)
    registry.hold(1, bad_peer.url)
    puller = WeightPuller(config, redis_client, run_id, "instance", run_dir=run_dir)
    try:
        with pytest.raises(PullError, match="chunks after"):
            puller.pull(1)
        assert puller.held_versions == []
        assert puller.server.versions() == []
        assert puller.url not in registry.holders(1)
        assert _status(puller.url, "/weights/v1/manifest.json") == 404
        assert any("corrupt" in failure for failure in puller.last_report.failures)
    finally:
        puller.close()
        bad_peer.close()


def test_publish_snapshots_the_weights_so_the_trainer_can_keep_training(redis_client, run):
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 64)
    state_dict = _state_dict(0.1)
    published = fingerprint(state_dict)
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    puller = WeightPuller(config, redis_client, run_id, "instance", run_dir=run_dir)
    try:
        publisher.publish(1, state_dict)
        for tensor in state_dict.values():
            tensor.add_(1.0)  # the next optimizer step, right away
        publisher.flush(timeout=30)
        assert fingerprint(puller.pull(1)) == published
    finally:
        puller.close()
        publisher.close()


def test_serving_without_a_secret_is_refused_with_a_clear_error(redis_client, run, monkeypatch):
    run_id, run_dir, registry = run
    monkeypatch.delenv("RLBOOST_WEIGHTS_SECRET")
    with pytest.raises(ValueError, match="RLBOOST_WEIGHTS_SECRET"):
        WeightPublisher(WeightsConfig(), redis_client, run_id, run_dir=run_dir)
    with pytest.raises(ValueError, match="RLBOOST_WEIGHTS_SECRET"):
        WeightPuller(WeightsConfig(serve_from_peers=False), redis_client, run_id, "instance", run_dir=run_dir)


def test_retention_keeps_the_newest_and_every_version_being_pulled(redis_client, run):
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 64, keep_versions=1, keep_in_memory=1, full_every=1)  # whole versions
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir)
    try:
        publisher.publish(1, _state_dict(0.05, seed=1))
        publisher.flush(timeout=30)
        registry.lease(1, "a-slow-instance")
        for version in (2, 3):
            publisher.publish(version, _state_dict(0.05, seed=version))
            publisher.flush(timeout=30)
        assert publisher.store.complete_versions() == [1, 3]
        assert registry.manifest_sha256(2) is None  # neither stored nor served any more
        registry.unlease(1, "a-slow-instance")
        publisher.publish(4, _state_dict(0.05, seed=4))
        publisher.flush(timeout=30)
        assert publisher.store.complete_versions() == [4]
        assert registry.recorded_versions() == [4]
    finally:
        publisher.close()


def test_weights_are_published_in_the_engines_dtype(redis_client, run):
    """bf16 engines get bf16 weights: half of fp32's bytes on every transfer; integer buffers stay as they are."""
    run_id, run_dir, registry = run
    config = WeightsConfig(chunk_mb=1 / 64)
    state_dict = {**_state_dict(0.1), "positions": torch.arange(7)}
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir, dtype=torch.bfloat16)
    puller = WeightPuller(config, redis_client, run_id, "instance", run_dir=run_dir)
    try:
        publisher.publish(1, state_dict)
        publisher.flush(timeout=30)
        pulled = puller.pull(1)
        assert pulled["positions"].dtype == torch.int64 and torch.equal(pulled["positions"], torch.arange(7))
        floats = [name for name, tensor in state_dict.items() if tensor.is_floating_point()]
        assert floats and all(pulled[name].dtype == torch.bfloat16 for name in floats)
        assert all(torch.equal(pulled[name], state_dict[name].to(torch.bfloat16)) for name in floats)
        fp32_bytes = sum(state_dict[name].numel() * 4 for name in floats)
        assert sum(puller.last_report.bytes_by_source.values()) < 0.55 * fp32_bytes + 1024
    finally:
        puller.close()
        publisher.close()


@pytest.mark.parametrize(
    ("published", "instance", "message"),
    [
        ("a" * 64, "b" * 64, "adapters of base model aaaaaaaaaaaa, but this instance's base model .* is bbbbbbbbbbbb"),
        ("a" * 64, None, "holds LoRA adapters .* runs without model.lora"),
        (None, "b" * 64, "holds whole weights, but this instance applies LoRA adapters"),
    ],
)
def test_a_version_for_another_base_is_refused_before_any_chunk(redis_client, run, published, instance, message):
    run_id, run_dir, _ = run
    config = WeightsConfig(chunk_mb=1 / 64, serve_from_trainer=False)
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir, adapter_base=published)
    publisher.publish(1, _state_dict(megabytes=0.1))
    publisher.flush(timeout=30)
    puller = WeightPuller(config, redis_client, run_id, "instance", run_dir=run_dir, adapter_base=instance)
    try:
        with pytest.raises(AdapterBaseMismatch, match=message):
            puller.pull(1)
        assert puller.last_report is not None and not puller.last_report.bytes_by_source  # no chunk fetched
        assert puller.held_versions == []
    finally:
        puller.close()
        publisher.close()


def test_adapters_of_the_instances_base_are_pulled(redis_client, run):
    run_id, run_dir, _ = run
    config = WeightsConfig(chunk_mb=1 / 64, serve_from_trainer=False)
    state_dict = _state_dict(megabytes=0.1)
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=run_dir, adapter_base="c" * 64)
    publisher.publish(1, state_dict)
    publisher.flush(timeout=30)
    puller = WeightPuller(config, redis_client, run_id, "instance", run_dir=run_dir, adapter_base="c" * 64)
    try:
        assert fingerprint(puller.pull(1)) == fingerprint(state_dict)
    finally:
        puller.close()
        publisher.close()
