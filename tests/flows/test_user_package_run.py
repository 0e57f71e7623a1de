"""A user's reward function and a user's environment, each in its own package outside the project,
through a real `rlboost train` (the console script, in a subprocess) on local pools: the packages
sit in the directory the command runs from, not installed and not on `PYTHONPATH`; the driver finds
them there, and the rollout worker processes (two local pools, none co-located) get their
directory on `PYTHONPATH` from the fabric. The environment, a calculator of the user's, records in
which process and with which `PYTHONPATH` it stepped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from infra.cli.app import CALCULATOR_CONFIG
from infra.run.step_record import StepRecord
from rl.rollout import read_samples
from tests.helpers import RESERVED_POOL, spot_pool, tiny_run
from tests.infra.rollout import agentic

pytestmark = pytest.mark.integration

REWARDS = """
    def score(response: str, answer: str) -> float:
        return 1.0 if response.rstrip().endswith(answer) else 0.25
"""
ENVS = """
    import json
    import os
    from pathlib import Path

    from rl.environments.calculator import Calculator


    class Env(Calculator):
        '''The calculator, noting each step's process and PYTHONPATH in `notes`.'''

        def __init__(self, notes: str) -> None:
            super().__init__()
            self.notes = Path(notes)

        def step(self, turn_text, key):
            note = {"pid": os.getpid(), "python_path": os.environ.get("PYTHONPATH", "")}
            (self.notes / f"{os.getpid()}-{key.sample_id.replace('/', '_')}-{key.turn}.json").write_text(json.dumps(note))
            return super().step(turn_text, key)
"""


def test_a_users_reward_and_environment_packages_run_through_rlboost_train_on_local_pools(prefect_harness, tmp_path):
    from prefect.settings import PREFECT_API_URL

    project, notes = tmp_path / "project", tmp_path / "notes"
    (project / "my_envs_37").mkdir(parents=True)
    notes.mkdir()
    (project / "my_rewards_37.py").write_text(textwrap.dedent(REWARDS))
    (project / "my_envs_37" / "__init__.py").write_text(textwrap.dedent(ENVS))
    model = agentic.memorised_model(tmp_path / "model")
    problems = "".join(
        json.dumps({"prompt": p[0], "answer": p[1]}) + "\n" for p in (agentic.ONE_CALL, agentic.TWO_CALLS)
    )
    (tmp_path / "problems.jsonl").write_text(problems)
    settings = tiny_run(
        model,
        tmp_path,
        "user-package",
        1,
        {
            "data.source": "file",
            "data.path": str(tmp_path / "problems.jsonl"),
            "data.eval_path": str(tmp_path / "problems.jsonl"),
            "eval.size": 2,
            "rollout.prompts_per_step": 2,
            "rollout.max_new_tokens": 400,
            "rollout.temperature": 0.25,
            "environment.name": None,
            "fabric.pools": [RESERVED_POOL, spot_pool(1)],
        },
    )
    config = yaml.safe_load(CALCULATOR_CONFIG.read_text())
    config["environment"] = {"class": "my_envs_37:Env", "args": {"notes": str(notes)}, "max_turns": 3}
    config["reward"] = {"function": "my_rewards_37:score"}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    command = [str(Path(sys.executable).parent / "rlboost"), "train", "--config", str(tmp_path / "run.yaml")]
    command += [arg for key, value in settings.items() for arg in ("--set", f"{key}={json.dumps(value)}")]
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    driver = subprocess.Popen(
        command, env=env, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output, _ = driver.communicate(timeout=600)
    assert driver.returncode == 0, output[-5000:]

    step = tmp_path / "runs" / "user-package" / "steps" / "000001"
    record = StepRecord.from_json(json.loads((step / "metrics.json").read_text()))
    samples = read_samples(step / "rollout.jsonl")
    assert len(samples) == 8 and record.turns_mean is not None and record.turns_mean >= 2
    assert all(0 in s.loss_mask for s in samples)  # the user environment's results, loss mask 0
    assert record.reward >= 0.25  # the user's reward scored them: 0.25 at least, never 0
    stepped = [json.loads(path.read_text()) for path in notes.glob("*.json")]
    in_workers = [note for note in stepped if note["pid"] != driver.pid]  # the driver's: its evaluation
    assert len({note["pid"] for note in in_workers}) >= 1 and len(in_workers) >= len(samples)
    assert all(note["python_path"].split(os.pathsep)[0] == str(project) for note in in_workers)
