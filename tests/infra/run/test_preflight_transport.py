"""Cloud pools refuse plain text: `rlboost train` with a gcp or azure pool whose VMs would reach the
run's Redis over redis://, or read its secrets from a Prefect server over HTTP or without
credentials, exits 2 before Prefect starts, naming the field and the fix; `fabric.allow_plaintext`
is the explicit opt-out."""

from __future__ import annotations

import json

import pytest
from prefect.settings import PREFECT_API_AUTH_STRING, temporary_settings
from typer.testing import CliRunner

from infra.cli.app import app
from infra.run.config import load_config
from infra.run.preflight import PreflightError, check_cloud_transport
from tests.helpers import save_tiny_model
from tests.infra.providers.test_azure import azure_pool
from tests.infra.providers.test_gcp import gcp_pool

GCP_POOL = gcp_pool(name="gcp-spot").model_dump(mode="json")
AZURE_POOL = azure_pool(name="azure-spot").model_dump(mode="json")
TLS = {"fabric.redis_url": "rediss://:pw@redis.internal:6380/0"}
API = "https://prefect.internal/api"


@pytest.fixture(autouse=True)
def _no_prefect_credentials(monkeypatch):
    for name in ("PREFECT_API_KEY", "PREFECT_API_AUTH_STRING", "RLBOOST_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)


def cloud(pool=GCP_POOL, **overrides):
    return load_config(None, {"fabric.enabled": True, "fabric.pools": [pool], **overrides})


@pytest.mark.parametrize("pool", [GCP_POOL, AZURE_POOL], ids=["gcp", "azure"])
def test_a_plaintext_redis_is_refused_naming_the_field_and_the_fix(pool):
    with pytest.raises(PreflightError) as refused:
        check_cloud_transport(cloud(pool, **{"fabric.redis_url": "redis://:pw@10.0.0.5:6379/0"}), API)
    message = str(refused.value)
    assert message.startswith(f"fabric.redis_url: pool {pool['name']!r} ({pool['provider']}) has VMs")
    assert "rediss://" in message and "fabric.redis_ca_file" in message and "fabric.allow_plaintext: true" in message
    assert "pw" not in message.replace("plaintext", "")  # the URL (and its password) is not repeated


def test_a_prefect_server_without_credentials_or_without_tls_is_refused():
    with pytest.raises(
        PreflightError, match=r"^PREFECT_API_URL: .* without credentials: start it with `rlboost up --host"
    ):
        check_cloud_transport(cloud(**TLS), API)
    with temporary_settings(updates={PREFECT_API_AUTH_STRING: "rlboost:secret"}):
        check_cloud_transport(cloud(**TLS), API)
        bootstrap = {"fabric.cloud.bootstrap.prefect_api_url": "http://10.0.0.2:4200/api"}
        with pytest.raises(PreflightError, match=r"^fabric.cloud.bootstrap.prefect_api_url: .* plain HTTP.*TLS proxy"):
            check_cloud_transport(cloud(**TLS, **bootstrap))


def test_the_opt_out_and_local_pools_pass():
    check_cloud_transport(cloud(**{"fabric.redis_url": "redis://10.0.0.5:6379/0", "fabric.allow_plaintext": True}))
    local = {"name": "spot", "capacity_class": "spot", "size": 1, "machine_type": "cpu", "price_per_hour": 0.1}
    check_cloud_transport(cloud(local, **{"fabric.redis_url": "redis://10.0.0.5:6379/0"}), "http://127.0.0.1:4200/api")


def test_rlboost_train_exits_2_before_prefect_starts(tmp_path):
    model = save_tiny_model(tmp_path / "model")
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--set",
            f"model.path={model}",
            "--set",
            "fabric.enabled=true",
            "--set",
            "fabric.redis_url=redis://10.0.0.5:6379/0",
            "--set",
            f"fabric.pools={json.dumps([GCP_POOL])}",
        ],
    )
    assert result.exit_code == 2, result.output
    assert "fabric.redis_url" in result.output and "fabric.allow_plaintext" in result.output
