"""Re-running a crashed rl-train continues after its last checkpoint, and `extra_steps` (the
nightly deployment's parameter) trains that many more steps on prompts the run has not seen.

The crash is real: the first run is a separate process (reporting to the same Prefect server)
killed with SIGKILL once it has checkpointed step 1. Rollout is in process (`fabric.enabled:
false`): what is tested is the step loop's resumption, and a SIGKILLed trainer would leave its
rollout worker processes behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
from prefect.settings import PREFECT_API_URL

from flows.rl_train import rl_train
from rl.checkpoint import latest_checkpoint
from rl.rollout import read_samples
from tests.helpers import REPO_ROOT, save_tiny_model, tiny_run, tiny_shape

pytestmark = pytest.mark.integration

ROOT = REPO_ROOT
RUN = "resume-test"
CRASHING_RUN = """
import json, sys
from flows.rl_train import rl_train
rl_train(overrides=json.loads(sys.argv[1]))
"""


def _overrides(base: Path, tmp_path: Path, steps: int) -> dict:
    return tiny_run(base, tmp_path, RUN, steps, {"run.checkpoint_every": 1, "eval.every": 100, "fabric.enabled": False})


def _step_runs(flow_run_id) -> list[str]:
    async def read():
        async with get_client() as client:
            runs = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
            )
        return sorted((r.name for r in runs if r.name.startswith("step-")), key=lambda n: int(n.split("-")[1]))

    return asyncio.run(read())


def _prompts(run_dir: Path, step: int) -> set[tuple[int, ...]]:
    return {tuple(s.prompt_ids) for s in read_samples(run_dir / "steps" / f"{step:06d}" / "rollout.jsonl")}


def test_rerun_after_a_crash_continues_and_extra_steps_train_on_fresh_prompts(prefect_harness, tmp_path):
    base = tmp_path / "base"
    save_tiny_model(base, tiny_shape())
    run_dir = tmp_path / "runs" / RUN
    overrides = _overrides(base, tmp_path, steps=3)

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(ROOT)}
    crashing = subprocess.Popen(
        [sys.executable, "-c", CRASHING_RUN, json.dumps(overrides)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.time() + 300
        while latest_checkpoint(run_dir / "checkpoints") is None:
            assert crashing.poll() is None, crashing.stderr.read().decode()[-3000:]
            assert time.time() < deadline, "the first run never checkpointed step 1"
            time.sleep(0.2)
    finally:
        crashing.send_signal(signal.SIGKILL)
        crashing.wait()
    done = int(latest_checkpoint(run_dir / "checkpoints").name.split("_")[1])
    assert 1 <= done < 3, "the run must be killed before it finishes"

    state = rl_train(overrides=overrides, return_state=True)
    assert state.is_completed(), state
    assert _step_runs(state.state_details.flow_run_id) == [f"step-{s}" for s in range(done + 1, 4)]
    assert state.result()["steps"] == 3
    for step in range(1, 4):
        assert json.loads((run_dir / "steps" / f"{step:06d}" / "metrics.json").read_text())["step"] == step

    nightly = rl_train(overrides=overrides, extra_steps=1, return_state=True)
    assert nightly.is_completed(), nightly
    assert _step_runs(nightly.state_details.flow_run_id) == ["step-4"]
    assert nightly.result()["steps"] == 4
    seen = set().union(*(_prompts(run_dir, step) for step in range(1, 4)))
    assert not _prompts(run_dir, 4) & seen, "extra steps must draw prompts after the data cursor"


def test_extra_steps_must_be_positive(prefect_harness, tmp_path):
    with pytest.raises(ValueError, match="extra_steps must be at least 1"):
        rl_train(overrides={"run.output_dir": str(tmp_path)}, extra_steps=0)
