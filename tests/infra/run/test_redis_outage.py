"""The token log's Redis keeps what it promises, against a real redis-server:

* restarted in the middle of a step (SIGKILL, then started again on the same port and append-only
  file, `appendfsync everysec`), the step completes with every sample exactly once and the tokens
  an uninterrupted in-process engine generates;
* restarted from an append-only file that lost its last writes, the step completes all the same
  (the workers hand back what the log remembers as theirs and they no longer hold);
* SIGKILLed for good in the middle of a real `rlboost train`, the run stops after
  `fabric.redis_outage_timeout_s` with one line naming the Redis (without its password), the
  checkpoint it kept and the command that resumes it, and exit status 3: no traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
import yaml

from infra.rollout.tokenlog import TokenLog
from infra.run.fabric_config import FabricConfig
from infra.run.redis_outage import public_url
from infra.services.ports import free_port
from infra.services.redis_embedded import EmbeddedRedis
from rl.config import DataConfig, RolloutConfig
from rl.models import load_model
from rl.prompt_source import PromptSource
from rl.rollout import build_requests
from tests.helpers import REPO_ROOT, hf_on_cpu, rollout_fabric, save_tiny_model, tiny_shape, wait_for

pytestmark = pytest.mark.integration

SHAPE = tiny_shape()
POOL = {"name": "reserved", "capacity_class": "reserved", "size": 2, "machine_type": "cpu", "price_per_hour": 1.0}
WORKER = {"slots": 2, "flush_tokens": 2, "flush_ms": 20, "heartbeat_s": 0.2, "ttl_s": 5.0}


def _done(log: TokenLog) -> int:
    """Samples of step 1 done (0 before the step exists)."""
    try:
        return log.step_status(1).done
    except KeyError:
        return 0


def _step_through(tmp_path, name: str, appendfsync: str, interrupt: Callable[[TokenLog, EmbeddedRedis], None]):
    """Roll out step 1 (24 samples) on a fabric whose Redis keeps an append-only file, calling
    `interrupt(log, server)` from the test's thread meanwhile; checks that the step completed with
    every sample once and the tokens an uninterrupted in-process engine generates."""
    save_tiny_model(tmp_path / "base", SHAPE)
    model, tokenizer = load_model(tmp_path / "base")
    server = EmbeddedRedis(appendfsync=appendfsync, directory=tmp_path / "redis", port=free_port())
    server.start()
    config = FabricConfig.model_validate(
        {
            "enabled": True,
            "redis_url": server.url,
            "pools": [POOL],
            "worker": WORKER,
            "controller": {"reap_timeout_s": 5.0},
            "redis_outage_timeout_s": 60,
        }
    )
    rollout = RolloutConfig(prompts_per_step=6, group_size=4, max_new_tokens=64)
    records = PromptSource(DataConfig(family="chain")).take(0, rollout.prompts_per_step)
    fabric = rollout_fabric(config, name, tmp_path / "run", tmp_path / "base")
    try:
        fabric.publish(0, model.state_dict())
        result: dict = {}

        def roll() -> None:
            try:
                result["samples"], result["report"] = fabric.rollout(tokenizer, records, 1, 0, rollout, run_seed=3)
            except BaseException as error:
                result["error"] = error

        thread = threading.Thread(target=roll)
        thread.start()
        interrupt(TokenLog(fabric.redis, name), server)
        thread.join(timeout=300)
        assert not thread.is_alive() and "error" not in result, result
    finally:
        fabric.close()
        server.stop()
    samples = result["samples"]
    ids = [s.sample_id for s in samples]
    assert len(ids) == len(set(ids)) == 24 and not result["report"].groups_dropped
    engine = hf_on_cpu(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    requests = build_requests(tokenizer, records, 1, rollout, run_seed=3)
    expected = {r.sample_id: res.token_ids for r, res in zip(requests, engine.generate(requests))}
    positions = sum(max(len(expected[s.sample_id]), len(s.response_ids)) for s in samples)
    matching = sum(sum(a == b for a, b in zip(expected[s.sample_id], s.response_ids)) for s in samples)
    assert matching / positions >= 0.99, matching / positions


def test_a_redis_restarted_mid_step_loses_no_sample_and_changes_no_token(tmp_path):
    seen: dict[str, int] = {}

    def restart(log: TokenLog, server: EmbeddedRedis) -> None:
        wait_for(lambda: _done(log) >= 2, "step 1 to be under way", timeout_s=180)
        seen["done"] = _done(log)
        os.kill(server.pid, signal.SIGKILL)
        time.sleep(1.5)  # the controller and the workers see Redis gone
        server.stop()
        server.start()  # the same port, password and append-only file

    _step_through(tmp_path, "restart", "everysec", restart)
    print(f"Redis restarted with {seen['done']}/24 samples done; the step completed")
    assert seen["done"] < 24, "the restart should have come in the middle of the step"


def test_a_redis_that_lost_its_last_writes_still_completes_the_step(tmp_path):
    """Redis restarted from an append-only file cut back to an earlier length (what `everysec`
    loses when its machine crashes): finishes and flushes the workers had acknowledged are gone,
    so samples they no longer hold show as running on them. They hand those back
    (`TokenLog.disown`) and the step completes, every sample exactly once, tokens unchanged."""
    seen: dict[str, int] = {}

    def lose_the_last_writes(log: TokenLog, server: EmbeddedRedis) -> None:
        wait_for(lambda: _done(log) >= 2, "step 1 to be under way", timeout_s=180)
        (aof,) = (tmp_path / "redis").glob("appendonlydir/*.incr.aof")
        cut, done_at_cut = aof.stat().st_size, _done(log)
        wait_for(lambda: _done(log) >= done_at_cut + 3, "three more samples to finish", timeout_s=120)
        seen["before"] = _done(log)
        assert seen["before"] < 24, "the cut should come in the middle of the step"
        os.kill(server.pid, signal.SIGKILL)
        server.stop()
        with aof.open("r+b") as handle:
            handle.truncate(cut)  # the writes since `cut` are lost
        server.start()
        seen["after"] = _done(log)

    _step_through(tmp_path, "lost", "always", lose_the_last_writes)
    print(f"{seen['before']} samples were done, {seen['after']} after the restart; the step completed")
    assert seen["after"] < seen["before"], "the restart should have lost finishes"
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "run").rglob("*.log"))
    assert "the token log had as running here" in logs, "a worker should have handed samples back"


def test_a_redis_gone_for_good_stops_the_run_with_one_line(prefect_harness, tmp_path):
    from prefect.settings import PREFECT_API_URL

    save_tiny_model(tmp_path / "base", SHAPE)
    server = EmbeddedRedis()
    server.start()
    settings = {
        "run": {"name": "outage", "output_dir": str(tmp_path / "runs"), "steps": 4, "checkpoint_every": 1},
        "model": {"path": str(tmp_path / "base")},
        "rollout": {"prompts_per_step": 6, "group_size": 4, "max_new_tokens": 48},
        "eval": {"size": 4, "every": 100},
        "fabric": {
            "enabled": True,
            "redis_url": server.url,
            "redis_outage_timeout_s": 3,
            "pools": [{**POOL, "size": 1}],
            "worker": WORKER,
        },
    }
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(settings))
    env = {
        **os.environ,
        "RLBOOST_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.sqlite'}",
        "PREFECT_API_URL": PREFECT_API_URL.value(),
    }
    command = [sys.executable, "-m", "infra.cli", "train", "--config", str(config_path)]
    driver = subprocess.Popen(
        command, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        checkpoint = tmp_path / "runs" / "outage" / "checkpoints" / "step_000001"
        wait_for(lambda: checkpoint.exists() or driver.poll() is not None, "the first checkpoint", timeout_s=400)
        assert driver.poll() is None, driver.stdout.read()
        where = public_url(server.url)
        os.kill(server.pid, signal.SIGKILL)
        output, _ = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
        server.stop()
    print(output)
    lines = [line for line in output.splitlines() if line.strip()]
    assert driver.returncode == 3, output
    assert "Traceback" not in output and server.password not in output
    assert lines[-1].startswith(f"the run stopped: the token log's Redis at {where} has not answered for 3 s"), lines
    assert "kept: the checkpoint of step " in lines[-1] and str(checkpoint.parent) in lines[-1], lines[-1]
    assert lines[-1].endswith(f"resume with: rlboost train --config {config_path}"), lines[-1]
