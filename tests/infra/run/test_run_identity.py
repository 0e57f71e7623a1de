"""A run keeps its identity across drivers: a real `rlboost train` on the fabric (a reserved worker
process, the token log in a Redis that outlives the driver) is SIGKILLed in the middle of step 2,
and the same command run again is the same run. The test asserts:

* the same run id: in `identity.json`, in the ledger, and in the token log's keyspace;
* the dead attempt's instances (its worker and the trainer's machine) closed at its last
  heartbeat, and `rlboost cost --run` of the killed run not growing while nothing runs;
* step 2 resumed from the logged tokens: the samples the dead attempt finished are not generated
  again, and every sample of the step is trained exactly once, with the tokens an uninterrupted
  in-process engine generates from the checkpoint's policy;
* the ledger counting each step once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC

import pytest
import redis
import yaml
from safetensors.torch import load_file
from sqlalchemy import select
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from infra.cli.app import app
from infra.ledger.models import Instance, Run
from infra.ledger.recorder import Ledger
from infra.rollout.tokenlog import TokenLog
from infra.run.config import load_config
from infra.services.redis_embedded import EmbeddedRedis
from rl.models import load_model
from rl.prompt_source import PromptSource
from rl.rollout import build_requests, read_samples
from tests.helpers import REPO_ROOT, hf_on_cpu, save_tiny_model, tiny_shape, wait_for

pytestmark = pytest.mark.integration

PROMPTS, GROUP = 6, 4


def _config(tmp_path, redis_url: str) -> dict:
    return {
        "run": {
            "name": "identity",
            "output_dir": str(tmp_path / "runs"),
            "steps": 3,
            "checkpoint_every": 1,
            "keep_checkpoints": 5,
        },
        "model": {"path": str(tmp_path / "base")},
        "rollout": {"prompts_per_step": PROMPTS, "group_size": GROUP, "max_new_tokens": 48},
        "eval": {"size": 4, "every": 100},
        "ledger": {"trainer": {"machine_type": "n2-standard-8", "price_per_hour": 0.4}},
        "fabric": {
            "enabled": True,
            "redis_url": redis_url,
            "pools": [
                {
                    "name": "reserved",
                    "capacity_class": "reserved",
                    "size": 1,
                    "machine_type": "a2-highgpu-1g",
                    "price_per_hour": 3.67,
                }
            ],
            "worker": {"slots": 2, "flush_tokens": 2, "flush_ms": 20, "heartbeat_s": 0.2, "ttl_s": 1.5},
            "controller": {"reap_timeout_s": 1.5},
        },
    }


def _cost(run_id: str, ledger_url: str) -> str:
    result = CliRunner().invoke(app, ["cost", "--run", run_id, "--db", ledger_url])
    assert result.exit_code == 0, result.output
    return result.output


def test_a_sigkilled_run_rerun_is_the_same_run_and_resumes_its_step(prefect_harness, tmp_path):
    from prefect.settings import PREFECT_API_URL

    save_tiny_model(tmp_path / "base", tiny_shape())
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    env = {**os.environ, "RLBOOST_LEDGER_URL": ledger_url, "PREFECT_API_URL": PREFECT_API_URL.value()}
    with EmbeddedRedis() as server:
        settings = _config(tmp_path, server.url)
        config_path = tmp_path / "run.yaml"
        config_path.write_text(yaml.safe_dump(settings))
        command = [sys.executable, "-m", "infra.cli", "train", "--config", str(config_path)]
        run_dir = tmp_path / "runs" / "identity"
        client = redis.Redis.from_url(server.url)
        with (tmp_path / "first.log").open("w") as out:
            first = subprocess.Popen(command, env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: (run_dir / "identity.json").exists(), "the run's identity", timeout_s=300)
            run_id = json.loads((run_dir / "identity.json").read_text())["run_id"]
            log = TokenLog(client, run_id)

            def step_2_half_done() -> bool:
                assert first.poll() is None, (tmp_path / "first.log").read_text()
                try:
                    status = log.step_status(2)
                except KeyError:
                    return False
                return status.done >= 1

            wait_for(step_2_half_done, "step 2 to be under way", timeout_s=400)
        finally:
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
        killed_status = log.step_status(2)
        print(f"killed with step 2 at {killed_status.done}/{PROMPTS * GROUP} samples done")

        # The killed attempt stops costing at its last heartbeat.
        with Ledger(ledger_url) as ledger, Session(ledger.engine) as session:
            last_heartbeat = session.get(Run, run_id).heartbeat_at
        assert last_heartbeat is not None
        before = _cost(run_id, ledger_url)
        time.sleep(2.5)
        assert _cost(run_id, ledger_url) == before, "the cost of a run whose driver is dead must not grow"

        second = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
        assert second.returncode == 0, second.stdout + second.stderr
        client.close()

    identity = json.loads((run_dir / "identity.json").read_text())
    assert identity == {"run_id": run_id, "attempt": 2}
    with Ledger(ledger_url) as ledger:
        report = ledger.report(run_id)
        with Session(ledger.engine) as session:
            instances = {i.instance_id: i for i in session.scalars(select(Instance).where(Instance.run_id == run_id))}
    assert [s.step for s in report.steps] == [1, 2, 3]
    dead = {name: i for name, i in instances.items() if not name.startswith("a2-")}
    assert set(dead) == {"reserved-0", "trainer"} and {"a2-reserved-0", "a2-trainer"} <= set(instances)
    for instance in dead.values():  # closed at the dead attempt's last heartbeat, not left open
        assert instance.state == "terminated" and instance.reason == "crashed", instance
        assert instance.terminated_at == last_heartbeat.astimezone(UTC), instance
    assert all(i.terminated_at is not None for i in instances.values())

    # Step 2 was resumed from its logged tokens, and trained on each sample exactly once.
    metrics = json.loads((run_dir / "steps" / "000002" / "metrics.json").read_text())
    assert metrics["resumed_samples_done"] >= 1, metrics
    samples = read_samples(run_dir / "steps" / "000002" / "rollout.jsonl")
    ids = [s.sample_id for s in samples]
    assert len(ids) == len(set(ids)) == PROMPTS * GROUP
    step_2 = next(s for s in report.steps if s.step == 2)
    assert step_2.tokens_trained == sum(len(s.response_ids) for s in samples)
    regenerated = step_2.tokens_generated
    assert regenerated < step_2.tokens_trained, "the samples the dead attempt finished were generated again"
    print(f"step 2: {regenerated} of {step_2.tokens_trained} tokens generated after the re-run")

    # The same tokens an uninterrupted engine draws from the checkpoint's policy (version 1).
    model, tokenizer = load_model(tmp_path / "base")
    model.load_state_dict(load_file(run_dir / "checkpoints" / "step_000001" / "model.safetensors"))
    config = load_config(config_path)
    records = PromptSource(config.data).take(PROMPTS, PROMPTS)
    requests = build_requests(tokenizer, records, 2, config.rollout, config.run.seed, config.prompt)
    engine = hf_on_cpu(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    expected = {r.sample_id: res.token_ids for r, res in zip(requests, engine.generate(requests))}
    got = {s.sample_id: s.response_ids for s in samples}
    positions = sum(max(len(expected[k]), len(got[k])) for k in expected)
    matching = sum(sum(a == b for a, b in zip(expected[k], got[k])) for k in expected)
    assert matching / positions >= 0.99, matching / positions
