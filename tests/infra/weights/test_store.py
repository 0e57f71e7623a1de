"""The fsspec weight store on `file://` and on S3 (a local moto server), and pulling from it alone."""

from __future__ import annotations

import uuid

import pytest
import torch

from infra.services.ports import free_port
from infra.weights.config import WeightsConfig
from infra.weights.manifest import MANIFEST_FILE, encode, fingerprint
from infra.weights.publisher import WeightPublisher
from infra.weights.puller import STORE, WeightPuller
from infra.weights.store import WeightStore

pytestmark = pytest.mark.integration

BUCKET = "rlboost-weights"


@pytest.fixture(scope="module")
def s3_options():
    """fsspec options of a private moto S3 server on a free port, with one bucket."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-west-2"},
    }
    WeightStore(f"s3://{BUCKET}", options).fs.mkdir(BUCKET)
    yield options
    server.stop()


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return WeightStore((tmp_path / "store").as_uri())
    return WeightStore(f"s3://{BUCKET}/{uuid.uuid4().hex}", request.getfixturevalue("s3_options"))


def _encoded(version: int, seed: int = 0):
    torch.manual_seed(seed)
    return encode({"a": torch.randn(300), "b": torch.randn(20, 20)}, version=version, chunk_bytes=1024)


def test_a_version_is_complete_exactly_when_its_manifest_is_written(store):
    assert store.versions() == {}
    encoded = _encoded(1)
    directory = store.version_dir(1)
    store.fs.makedirs(directory, exist_ok=True)
    for info, data in zip(encoded.manifest.chunks, encoded.chunks):
        store.fs.pipe_file(f"{directory}/{info.file}", data)
    assert store.versions() == {1: False}
    assert store.complete_versions() == []
    with pytest.raises(FileNotFoundError):
        store.read_manifest(1)
    store.write(encoded)
    assert store.versions() == {1: True}
    assert store.read_manifest(1) == encoded.manifest
    assert store.read_manifest_bytes(1) == encoded.manifest_bytes
    assert [store.read_chunk(1, info.file) for info in encoded.manifest.chunks] == list(encoded.chunks)
    assert sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(directory, detail=False))[-1] == MANIFEST_FILE


def test_versions_are_listed_and_deleted(store):
    for version in (1, 2, 10):
        store.write(_encoded(version, seed=version))
    assert store.complete_versions() == [1, 2, 10]
    store.delete(2)
    assert store.versions() == {1: True, 10: True}
    with pytest.raises(FileNotFoundError):
        store.read_manifest(2)
    store.delete(2)  # deleting what is gone is fine
    assert store.read_manifest(10).version == 10


def test_store_only_transfer_over_s3_needs_no_peers_and_no_secret(s3_options, redis_client, monkeypatch):
    """Nobody serves over HTTP: the trainer announces a version once it is in S3, instances pull
    it from there. No secret is configured, and none is needed."""
    monkeypatch.delenv("RLBOOST_WEIGHTS_SECRET", raising=False)
    config = WeightsConfig(
        store_url=f"s3://{BUCKET}/{uuid.uuid4().hex}",
        store_options=s3_options,
        serve_from_trainer=False,
        serve_from_peers=False,
        chunk_mb=0.05,
        keep_versions=1,
        full_every=1,  # whole versions: the store keeps just the newest (deltas: tests/infra/weights/test_delta_pull.py)
    )
    run_id = uuid.uuid4().hex
    torch.manual_seed(1)
    state_dicts = {v: {"w": torch.randn(64, 64), "b": torch.randn(64)} for v in (1, 2)}
    publisher = WeightPublisher(config, redis_client, run_id)
    puller = WeightPuller(config, redis_client, run_id, "instance-0")
    try:
        for version, state_dict in state_dicts.items():
            publisher.publish(version, state_dict)
            publisher.flush(timeout=30)
            assert publisher.registry.latest() == version
            pulled = puller.pull(version)
            assert fingerprint(pulled) == fingerprint(state_dict)
            assert set(puller.last_report.bytes_by_source) == {STORE}
            assert puller.last_report.manifest_sha256 == publisher.registry.manifest_sha256(version)
            assert puller.url is None
        assert publisher.store.complete_versions() == [2]  # keep_versions=1
    finally:
        puller.close()
        publisher.close()


def test_the_base_model_copy_for_cloud_vms_goes_through_s3_with_the_stores_options(s3_options, tmp_path):
    from infra.weights.model_source import INDEX, fetch_model, upload_model

    model = tmp_path / "base"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}/base-model"
    upload_model(model, url, s3_options)
    local = fetch_model(url, s3_options, cache_dir=tmp_path / "cache")
    assert (local / "model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()
    assert (local / INDEX).exists()
