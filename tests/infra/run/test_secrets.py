"""The run's secrets (the Redis password in its URL, the weights secret) never reach a command line,
an instance log, a run file or the trainer's own environment: a real fabric runs one step on a real
worker process (which gets them through its environment argument), then `ps`, the logs and every
file under the run directory (the embedded Redis's append-only file among them) are searched. The
one file that holds the Redis URL, `redis.url` (for `rlboost status`), is owner-only and there only
while the fabric runs."""

from __future__ import annotations

import os
import stat
import subprocess
import time
from urllib.parse import urlsplit

import pytest

from infra.run.fabric_config import FabricConfig
from infra.run.redis_address import REDIS_URL_FILE
from rl.config import DataConfig, RolloutConfig
from rl.models import load_model
from rl.prompt_source import PromptSource
from tests.helpers import rollout_fabric, save_tiny_model, tiny_shape

pytestmark = pytest.mark.integration

CONFIG = FabricConfig.model_validate(
    {
        "enabled": True,
        "redis_appendfsync": "everysec",  # the token log's append-only file is a run file too
        "pools": [
            {"name": "reserved", "capacity_class": "reserved", "size": 1, "machine_type": "cpu", "price_per_hour": 1.0}
        ],
        "worker": {"slots": 4, "flush_tokens": 2, "flush_ms": 20, "heartbeat_s": 0.2, "ttl_s": 2.0},
    }
)


def test_no_secret_on_a_command_line_in_a_log_or_a_run_file(tmp_path):
    save_tiny_model(tmp_path / "base", tiny_shape())
    model, tokenizer = load_model(tmp_path / "base")
    run_dir = tmp_path / "run"
    before = dict(os.environ)
    fabric = rollout_fabric(CONFIG, "secrets", run_dir, tmp_path / "base")
    try:
        password = urlsplit(fabric.redis_url).password
        secret = fabric.peer_environment[CONFIG.weights.secret_env]
        assert password and secret
        assert dict(os.environ) == before, "the secrets reach instances through their environment argument"
        fabric.publish(0, model.state_dict())
        records = PromptSource(DataConfig(family="chain")).take(0, 2)
        rollout = RolloutConfig(prompts_per_step=2, group_size=2, max_new_tokens=8)
        samples, _ = fabric.rollout(tokenizer, records, 1, 0, rollout, run_seed=1)
        assert len(samples) == 4  # the worker joined the run's Redis and pulled the weights
        processes = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
        workers = [line for line in processes.splitlines() if "infra.rollout.worker" in line]
        assert workers, processes
        address = run_dir / REDIS_URL_FILE
        assert address.read_text().strip() == fabric.redis_url
        assert stat.S_IMODE(address.stat().st_mode) == 0o600
    finally:
        fabric.close()
    time.sleep(0.1)
    assert not address.exists(), "the Redis URL outlived the Redis"
    assert password not in processes and secret not in processes, workers
    files = [path for path in run_dir.rglob("*") if path.is_file()]
    assert any(path.suffix == ".log" for path in files), files  # the instance log is among them
    assert any(path.parent.name == "appendonlydir" for path in files), files  # and Redis's append-only file
    for path in files:
        content = path.read_bytes()
        assert password.encode() not in content and secret.encode() not in content, path
