"""Request signatures and the shared-secret configuration of the peer endpoints."""

from __future__ import annotations

import pytest

from infra.weights.auth import SCHEME, authorization, is_authorized
from infra.weights.config import WeightsConfig

SECRET = b"a-shared-secret-of-enough-length"
PATH = "/weights/v3/chunk-00000.safetensors"


def test_a_fresh_signature_of_the_same_request_is_accepted():
    header = authorization(SECRET, "GET", PATH, now=1000.0)
    assert header.startswith(SCHEME + " 1000:")
    assert is_authorized(SECRET, header, "GET", PATH, max_skew_s=60, now=1030.0)


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer " + SECRET.decode(),
        SCHEME,
        f"{SCHEME} 1000",
        f"{SCHEME} 1000:",
        f"{SCHEME} abc:def",
        f"{SCHEME} -5:00",
        authorization(b"another-secret-of-enough-length", "GET", PATH, now=1000.0),
        authorization(SECRET, "GET", "/weights/v3/manifest.json", now=1000.0),
        authorization(SECRET, "POST", PATH, now=1000.0),
        authorization(SECRET, "GET", PATH, now=900.0),  # stale
        authorization(SECRET, "GET", PATH, now=1100.0),  # from the future
        authorization(SECRET, "GET", PATH, now=1000.0) + "00",
    ],
)
def test_missing_wrong_or_stale_signatures_are_rejected(header):
    assert not is_authorized(SECRET, header, "GET", PATH, max_skew_s=60, now=1000.0 + (30 if header is None else 0))


def test_the_secret_never_appears_in_the_header():
    assert SECRET.decode() not in authorization(SECRET, "GET", PATH)


def test_secret_comes_from_the_configured_environment_variable(monkeypatch):
    monkeypatch.setenv("MY_WEIGHTS_SECRET", "0123456789abcdef0123")
    assert WeightsConfig(secret_env="MY_WEIGHTS_SECRET").secret() == b"0123456789abcdef0123"


def test_unset_or_short_secret_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("MY_WEIGHTS_SECRET", raising=False)
    config = WeightsConfig(secret_env="MY_WEIGHTS_SECRET")
    with pytest.raises(ValueError, match="MY_WEIGHTS_SECRET .*is not set"):
        config.secret()
    monkeypatch.setenv("MY_WEIGHTS_SECRET", "short")
    with pytest.raises(ValueError, match="has only 5 characters"):
        config.secret()


def test_config_rejects_unknown_keys_and_defaults_the_store_to_the_run_dir(tmp_path):
    with pytest.raises(ValueError, match="chunk_size"):
        WeightsConfig(chunk_size=3)
    assert WeightsConfig().resolve_store_url(tmp_path) == (tmp_path / "store").as_uri()
    assert WeightsConfig(store_url="s3://b/run").resolve_store_url(None) == "s3://b/run"
    with pytest.raises(ValueError, match="store_url is not set"):
        WeightsConfig().resolve_store_url(None)
