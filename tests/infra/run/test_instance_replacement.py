"""Failed rollout instances are replaced within the step (fabric.max_instance_failures).

The fault is real and comes through the environment (`tests/fakes/start_fault`): with its
directory on `PYTHONPATH`, each file in `START_FAULT_DIR` makes one rollout worker
process exit with status 1 at start, before it registers.

* A local pool whose first instance's worker fails so: the instance is replaced within the step,
  the step completes with every sample once, and the fabric counts one replaced instance (the
  step table's `replaced`).
* A pool whose every instance fails, in a real `rlboost train`: the run stops after
  `max_instance_failures` with the last instance's error on one line and exit status 3, no
  traceback, well before `fabric.ready_timeout_s`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from infra.run.fabric_config import FabricConfig
from rl.config import DataConfig, RolloutConfig
from rl.models import load_model
from rl.prompt_source import PromptSource
from tests.helpers import REPO_ROOT, rollout_fabric, save_tiny_model, spot_pool

pytestmark = pytest.mark.integration

FAULT = REPO_ROOT / "tests" / "fakes" / "start_fault"
WORKER = {"slots": 4, "flush_tokens": 4, "flush_ms": 20, "heartbeat_s": 0.2, "ttl_s": 5.0}


def arm(tmp_path: Path, starts: int) -> dict[str, str]:
    """The environment that fails the next `starts` rollout worker starts."""
    armed = tmp_path / "fail-starts"
    armed.mkdir()
    for n in range(starts):
        (armed / f"start-{n}").touch()
    return {
        "PYTHONPATH": os.pathsep.join([str(FAULT), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        "START_FAULT_DIR": str(armed),
    }


def test_an_instance_whose_worker_fails_at_start_is_replaced_and_the_step_completes(tmp_path, monkeypatch):
    for name, value in arm(tmp_path, 1).items():
        monkeypatch.setenv(name, value)  # the instances inherit this process's environment
    base = save_tiny_model(tmp_path / "base")
    model, tokenizer = load_model(base)
    config = FabricConfig.model_validate(
        {"enabled": True, "pools": [spot_pool(1)], "worker": WORKER, "ready_timeout_s": 600}
    )
    rollout = RolloutConfig(prompts_per_step=4, group_size=4, max_new_tokens=16)
    records = PromptSource(DataConfig(family="chain")).take(0, rollout.prompts_per_step)
    fabric = rollout_fabric(config, "replaced", tmp_path / "run", base)
    try:
        fabric.publish(0, model.state_dict())
        samples, report = fabric.rollout(tokenizer, records, 1, 0, rollout, run_seed=0)
        records_by_id = {r.instance_id: r for r in fabric.provider.instances()}
        replaced = fabric.replaced()
    finally:
        fabric.close()
    assert len({s.sample_id for s in samples}) == len(samples) == 16 and not report.groups_dropped
    first = records_by_id["spot-0"]
    assert (first.reason, first.exit_code) == ("crashed", 1)
    assert set(report.instance_tokens) == {"spot-1"}  # its replacement generated the step
    assert replaced == 1
    log = (tmp_path / "run" / "instances" / "spot-0.log").read_text()
    assert "worker cannot start: the injected instance_start fault start-0 failed it" in log


def test_a_pool_whose_every_instance_fails_stops_the_run_with_one_line(prefect_harness, tmp_path):
    from prefect.settings import PREFECT_API_URL

    base = save_tiny_model(tmp_path / "base")
    settings = {
        "run": {"name": "failing", "output_dir": str(tmp_path / "runs"), "steps": 2},
        "model": {"path": str(base)},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 16},
        "eval": {"size": 4, "every": 100},
        "fabric": {
            "enabled": True,
            "pools": [spot_pool(1)],
            "worker": WORKER,
            "max_instance_failures": 3,
            "ready_timeout_s": 600,
        },
    }
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(settings))
    env = {
        **os.environ,
        **arm(tmp_path, 100),
        "RLBOOST_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.sqlite'}",
        "PREFECT_API_URL": PREFECT_API_URL.value(),
    }
    command = [sys.executable, "-m", "infra.cli", "train", "--config", str(config_path)]
    started = time.monotonic()
    done = subprocess.run(
        command, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400
    )
    seconds = time.monotonic() - started
    output = done.stdout
    print(output)
    lines = [line for line in output.splitlines() if line.strip()]
    assert done.returncode == 3, output
    assert "Traceback" not in output
    assert seconds < 300, f"{seconds:.0f} s: it waited for the ready timeout"
    last = re.escape("instances in a row failed (fabric.max_instance_failures); the last, ")
    assert re.fullmatch(
        rf"the run stopped: pool spot: 3 {last}\S*spot-2, exited with status 1 \d+ s after its launch, before it "
        r"registered: worker cannot start: the injected instance_start fault start-\d+ failed it \(its log: \S+\); "
        rf"fix that, then resume with: rlboost train --config {re.escape(str(config_path))}",
        lines[-1],
    ), lines[-1]
