"""Publishing the base model where cloud VMs read it, and fetching it there: complete copies only,
verified against their index, cached (S3, with the weight store's options, is tested with the store
in tests/infra/weights/test_store.py)."""

from __future__ import annotations

import pytest

from infra.weights.model_source import INDEX, ModelSourceError, fetch_model, is_url, upload_model


@pytest.fixture
def model_dir(tmp_path):
    directory = tmp_path / "base"
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    return directory


def test_local_paths_are_used_in_place():
    assert not is_url("/models/base") and not is_url("file:///models/base") and is_url("s3://b/base")
    assert str(fetch_model("/models/base")) == "/models/base"
    assert str(fetch_model("file:///models/base")) == "/models/base"


def test_a_copy_round_trips_is_cached_and_is_uploaded_once(model_dir, tmp_path):
    url = f"memory://rlboost-test/{tmp_path.name}/base-model"
    assert upload_model(model_dir, url) == url
    cache = tmp_path / "cache"
    local = fetch_model(url, cache_dir=cache)
    assert {p.name for p in local.iterdir()} == {"config.json", "model.safetensors", INDEX}
    assert (local / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    assert fetch_model(url, cache_dir=cache) == local  # cached: no second download
    assert list(cache.iterdir()) == [local]

    import fsspec

    fs = fsspec.filesystem("memory")
    stamp = fs.info(f"/rlboost-test/{tmp_path.name}/base-model/{INDEX}")["created"]
    upload_model(model_dir, url)  # the same files: nothing rewritten
    assert fs.info(f"/rlboost-test/{tmp_path.name}/base-model/{INDEX}")["created"] == stamp

    # A changed model is a new index, so a new cache entry.
    (model_dir / "config.json").write_text('{"model_type": "llama", "v": 2}')
    upload_model(model_dir, url)
    assert fetch_model(url, cache_dir=cache) != local


def test_an_incomplete_or_corrupted_copy_is_refused_and_leaves_nothing_cached(model_dir, tmp_path):
    import fsspec

    url = f"memory://rlboost-test/{tmp_path.name}/partial"
    fs = fsspec.filesystem("memory")
    fs.put_file(str(model_dir / "config.json"), f"/rlboost-test/{tmp_path.name}/partial/config.json")
    with pytest.raises(ModelSourceError, match=f"no complete model at {url}: {INDEX} is missing"):
        fetch_model(url, cache_dir=tmp_path / "cache")

    upload_model(model_dir, url)
    fs.pipe_file(f"/rlboost-test/{tmp_path.name}/partial/model.safetensors", b"tampered")
    with pytest.raises(ModelSourceError, match="model.safetensors does not match"):
        fetch_model(url, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []

    with pytest.raises(ModelSourceError, match="does not exist"):
        upload_model(tmp_path / "missing", url)
