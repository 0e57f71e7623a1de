"""HTTPS between weight peers (`weights.tls`) over real sockets: a puller gets a version from the
trainer's and a peer's HTTPS servers, trusting the run's certificate only; a plain-HTTP client, and
a client pinning another run's certificate, get nothing."""

from __future__ import annotations

import http.client
import ssl
import uuid
from urllib.parse import urlsplit

import pytest
import torch

from infra.weights.auth import authorization
from infra.weights.config import WeightsConfig
from infra.weights.manifest import fingerprint
from infra.weights.peer_client import PeerClient, SourceFailed
from infra.weights.publisher import WeightPublisher
from infra.weights.puller import STORE, WeightPuller
from infra.weights.tls import CERT_ENV, KEY_ENV, PeerCertificate

pytestmark = pytest.mark.integration

SECRET = "peer-secret-for-the-tls-tests-0123456789"
CERTIFICATE = PeerCertificate.generate()


@pytest.fixture(autouse=True)
def _environment(monkeypatch):
    monkeypatch.setenv("RLBOOST_WEIGHTS_SECRET", SECRET)
    for name, value in CERTIFICATE.environment().items():
        monkeypatch.setenv(name, value)


def _state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"layer{i}.weight": torch.randn(64, 64) for i in range(4)}


@pytest.fixture
def published(redis_client, tmp_path):
    """Version 1 served over HTTPS by a trainer whose store is gone (peers are the only source)."""
    run_id = uuid.uuid4().hex
    config = WeightsConfig(tls=True, chunk_mb=1 / 64, chunk_timeout_s=5, pull_timeout_s=30)
    publisher = WeightPublisher(config, redis_client, run_id, run_dir=tmp_path)
    state_dict = _state_dict()
    publisher.publish(1, state_dict)
    publisher.flush(timeout=30)
    for path in (tmp_path / "store" / "weights" / "v1").iterdir():
        path.unlink()
    yield config, run_id, publisher, state_dict
    publisher.close()


def test_pullers_get_the_version_over_https_from_the_trainer_and_from_a_peer(redis_client, tmp_path, published):
    config, run_id, publisher, state_dict = published
    assert publisher.url.startswith("https://127.0.0.1:")
    first = WeightPuller(config, redis_client, run_id, "first", run_dir=tmp_path)
    try:
        assert fingerprint(first.pull(1)) == fingerprint(state_dict)
        assert set(first.last_report.bytes_by_source) == {publisher.url}
        assert first.url.startswith("https://")
        publisher.server.withdraw(1)  # now only the first instance serves it
        second = WeightPuller(config, redis_client, run_id, "second", run_dir=tmp_path)
        try:
            assert fingerprint(second.pull(1)) == fingerprint(state_dict)
            assert set(second.last_report.bytes_by_source) - {STORE} == {first.url}
        finally:
            second.close()
    finally:
        first.close()


def test_a_plain_http_client_gets_nothing(published):
    _, _, publisher, _ = published
    parts = urlsplit(publisher.url)
    path = "/weights/v1/manifest.json"
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
    try:
        conn.request("GET", path, headers={"Authorization": authorization(SECRET.encode(), "GET", path)})
        response = conn.getresponse()
        assert response.status == 400 and b"chunks" not in response.read()  # uvicorn: not a TLS handshake
    except (ConnectionError, http.client.HTTPException):
        pass  # the server dropped the plaintext connection
    finally:
        conn.close()


def test_a_client_that_pins_another_certificate_is_refused(published):
    config, _, publisher, _ = published
    client = PeerClient(SECRET.encode(), config, PeerCertificate.generate())
    with pytest.raises(SourceFailed, match="CERTIFICATE_VERIFY_FAILED"):
        client.get(publisher.url, "/weights/v1/manifest.json", {})
    client.close()
    trusting = PeerClient(SECRET.encode(), config, CERTIFICATE)
    assert b"chunks" in trusting.get(publisher.url, "/weights/v1/manifest.json", {})
    trusting.close()
    with pytest.raises(ssl.SSLError):  # and an ordinary client, trusting the system's CAs, refuses it too
        http.client.HTTPSConnection(urlsplit(publisher.url).hostname, urlsplit(publisher.url).port, timeout=5).request(
            "GET", "/"
        )


def test_tls_without_the_certificate_in_the_environment_names_the_variables(monkeypatch):
    monkeypatch.delenv(CERT_ENV)
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ValueError, match=f"{CERT_ENV} and {KEY_ENV}"):
        WeightsConfig(tls=True).certificate()
