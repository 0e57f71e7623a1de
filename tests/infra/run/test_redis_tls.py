"""The run's Redis over TLS: a real redis-server that speaks only TLS (certificates made in the
test), a real fabric whose controller and worker process run a step over it with the CA of
`fabric.redis_ca_file`; a plaintext client, and a TLS client that does not trust that CA, are
refused."""

from __future__ import annotations

import pytest

from infra.run.fabric_config import FabricConfig
from infra.services.redis_embedded import RedisSettings, RedisUnavailable
from rl.config import DataConfig, RolloutConfig
from rl.models import load_model
from rl.prompt_source import PromptSource
from tests.helpers import rollout_fabric, save_tiny_model, tiny_shape
from tests.tls_material import tls_redis

pytestmark = pytest.mark.integration

POOL = {"name": "reserved", "capacity_class": "reserved", "size": 1, "machine_type": "cpu", "price_per_hour": 1.0}
WORKER = {"slots": 4, "flush_tokens": 2, "flush_ms": 20, "heartbeat_s": 0.2, "ttl_s": 2.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tls_redis(tmp_path_factory.mktemp("tls-redis")) as running:
        yield running


def test_a_worker_process_and_the_controller_run_a_step_over_tls(server, tmp_path):
    save_tiny_model(tmp_path / "base", tiny_shape(smallest=True))
    model, tokenizer = load_model(tmp_path / "base")
    config = FabricConfig.model_validate(
        {
            "enabled": True,
            "redis_url": server.url,
            "redis_ca_file": str(server.ca_file),
            "pools": [POOL],
            "worker": WORKER,
        }
    )
    fabric = rollout_fabric(config, "tls", tmp_path / "run", tmp_path / "base")
    try:
        fabric.publish(0, model.state_dict())
        records = PromptSource(DataConfig(family="chain")).take(0, 2)
        rollout = RolloutConfig(prompts_per_step=2, group_size=2, max_new_tokens=8)
        samples, report = fabric.rollout(tokenizer, records, 1, 0, rollout, run_seed=1)
        assert len(samples) == 4 and not report.groups_dropped
    finally:
        fabric.close()
    log = next((tmp_path / "run" / "instances").glob("*.log")).read_text()
    assert "SSL" not in log and "Redis unavailable" not in log, log


def test_a_plaintext_client_is_refused(server):
    with pytest.raises(RedisUnavailable, match=r"cannot reach Redis at 127\.0\.0\.1:\d+"):
        RedisSettings(url=server.plaintext_url, connect_timeout_s=2).client()


def test_a_client_that_does_not_trust_the_run_s_ca_is_refused(server, tmp_path):
    from tests.tls_material import make_ca

    other = make_ca(tmp_path, "other-ca")
    with pytest.raises(RedisUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
        RedisSettings(url=server.url, ca_file=other.cert, connect_timeout_s=2).client()
    assert RedisSettings(url=server.url, ca_file=server.ca_file).client().ping()


def test_a_ca_file_without_a_tls_url_names_the_fields():
    with pytest.raises(ValueError, match=r"fabric\.redis_ca_file .* fabric\.redis_url is not rediss://"):
        FabricConfig(redis_url="redis://10.0.0.5:6379/0", redis_ca_file="/etc/ca.pem")
