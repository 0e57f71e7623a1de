"""A rollout worker (a real `rlboost worker` process) given LoRA adapters made for another base
model than its own refuses them before loading anything: one error line naming both bases and the
fix, exit status 2, no traceback, no token logged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import redis

from infra.rollout.protocol import set_current_step
from infra.rollout.tokenlog import GroupSpec, TokenLog
from infra.weights.config import WeightsConfig
from infra.weights.publisher import WeightPublisher
from infra.weights.shared import share_config
from rl.config import LoraSettings
from rl.engine_spec import EngineSpec
from rl.lora import adapter_state, add_adapters, base_digest
from rl.models import load_policy
from tests.helpers import REPO_ROOT, save_tiny_model

pytestmark = pytest.mark.integration

LORA = LoraSettings(r=4, alpha=8)


def test_adapters_of_another_base_stop_the_worker_with_one_line(redis_url, tmp_path):
    trainer_base = save_tiny_model(tmp_path / "trainer-base", seed=0)
    instance_base = save_tiny_model(tmp_path / "instance-base", seed=1)  # same shapes, other weights
    run_id = f"adapter-base-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    settings = WeightsConfig()
    os.environ.setdefault(settings.secret_env, uuid.uuid4().hex)  # the worker inherits it
    share_config(client, run_id, settings, tmp_path)
    publisher = WeightPublisher(settings, client, run_id, run_dir=tmp_path, adapter_base=base_digest(trainer_base))
    try:
        publisher.publish(1, adapter_state(add_adapters(load_policy(trainer_base), LORA)))
        publisher.flush(timeout=30)
        log = TokenLog(client, run_id)
        assert log.enqueue_step(1, 1, [GroupSpec(0, [1, 5, 9, 7], 2, 8, seed=1, sampling={"temperature": 1.0})])
        assert set_current_step(client, run_id, 1, 1)
        engine = EngineSpec(lora=LORA).model_dump_json()
        command = [sys.executable, "-m", "infra.cli.app", "worker", "--run-id", run_id, "--redis-url", redis_url]
        command += ["--model", str(instance_base), "--engine", engine, "--instance-id", "i", "--pool", "spot"]
        command += ["--capacity-class", "spot", "--heartbeat-s", "0.5", "--ttl-s", "3", "--poll-ms", "20"]
        done = subprocess.run(
            command,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            capture_output=True,
            text=True,
            timeout=180,
        )
    finally:
        publisher.close()
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    errors = [line for line in output.splitlines() if " ERROR " in line]
    assert len(errors) == 1, output
    assert f"this instance's base model (--model) is {base_digest(instance_base)[:12]}" in errors[0]
    assert f"adapters of base model {base_digest(trainer_base)[:12]}" in errors[0]
    assert "Traceback" not in output
    status = log.step_status(1)
    assert status.tokens_logged == 0 and status.groups_done == 0  # nothing written
    print(json.dumps({"exit": done.returncode, "error": errors[0][-160:]}))
    client.close()
