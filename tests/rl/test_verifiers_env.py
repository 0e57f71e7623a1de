"""The verifiers adapter's mapping (`rl.environments.verifiers_env`) on a real verifiers taskset
(tests.rl.verifiers_calc, written with verifiers' classes): tasks by key, tools by verifiers'
names, the rubric's reward, `@vf.stop`s, replay after a migration, and the configuration's one-line
refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.run.config import parse_config
from rl.environments.protocol import StepKey, StepResult
from rl.environments.tool_calls import TextToolFormat
from rl.environments.verifiers_env import VerifiersEnvironment, write_tasks

TASKSET = "tests.rl.verifiers_calc:CalcTaskset"
TURNS = ('<call>calc {"expr":"12+345"}</call>', 'then <call>calc {"expr":"357+67+89"}</call>', "so 513")


def _rows(tmp_path: Path, **config) -> list[dict]:
    assert write_tasks(TASKSET, tmp_path / "tasks.jsonl", config) == 2
    return [json.loads(line) for line in (tmp_path / "tasks.jsonl").read_text().splitlines()]


def _env(row: dict, **config) -> VerifiersEnvironment:
    env = VerifiersEnvironment(TASKSET, config)
    env.use_format(TextToolFormat())
    env.reset(row["prompt"], row["answer"])
    return env


def test_a_trajectory_runs_the_taskset_tools_and_is_scored_by_its_rewards(tmp_path):
    rows = _rows(tmp_path)
    assert [row["prompt"] for row in rows] == ["417*36=", "12+345+67+89="]
    env = _env(rows[1])
    try:
        assert [s["function"]["name"] for s in env.tool_schemas()] == ["calc"]
        results = [env.step(text, StepKey("1/0/0", turn)) for turn, text in enumerate(TURNS)]
        assert results[:2] == [StepResult("357", done=False), StepResult("513", done=False)]
        assert results[2] == StepResult(None, done=True, reward=1.0 + 0.25 * 2)  # correct + 0.25 per call
        roles = [message.role for message in env.trace.messages]
        assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
        assert env.trace.stop_condition == "agent_completed" and env.trace.last_reply == "so 513"
    finally:
        env.close()


def test_a_tool_refusing_its_input_is_an_observation_and_a_wrong_answer_scores_by_the_rubric(tmp_path):
    env = _env(_rows(tmp_path)[0])
    try:
        refused = env.step('<call>calc {"expr":"1/2"}</call>', StepKey("s", 0))
        assert refused.observation is not None and refused.observation.startswith("error: ValueError: calc takes")
        assert env.step("15013", StepKey("s", 1)) == StepResult(None, done=True, reward=0.25)
    finally:
        env.close()


def test_a_vf_stop_ends_the_trajectory_with_the_rubrics_reward(tmp_path):
    config = {"task": {"max_calls": 1}}
    env = _env(_rows(tmp_path, **config)[1], **config)
    try:
        assert env.step(TURNS[0], StepKey("s", 0)) == StepResult(None, done=True, reward=0.25)
        assert env.trace.stop_condition == "enough_calls"
    finally:
        env.close()


def test_replay_rebuilds_the_trace_and_reruns_the_tools_keeping_the_logged_results(tmp_path):
    calls = tmp_path / "calls.txt"
    config = {"task": {"calls": str(calls)}}
    row = _rows(tmp_path, **config)[1]
    env = _env(row, **config)
    try:
        env.replay(TURNS[0], "357 (as logged)", StepKey("s", 0))
        assert calls.read_text().splitlines() == ["waiting 12+345", "called 12+345"]
        assert env.step(TURNS[1], StepKey("s", 1)).observation == "513"
        assert env.trace.tool_messages[0].content == "357 (as logged)"
        assert env.step(TURNS[2], StepKey("s", 2)).reward == 1.5
    finally:
        env.close()


def test_an_unknown_task_key_is_an_infrastructure_failure_not_a_score(tmp_path):
    env = VerifiersEnvironment(TASKSET)
    with pytest.raises(ValueError, match="no task of tests.rl.verifiers_calc:CalcTaskset has the key 'nope'"):
        env.reset("417*36=", "nope")
    env.close()


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            {"taskset": "tests.rl.verifiers_calc:Nope"},
            "taskset: module tests.rl.verifiers_calc has no attribute 'Nope'; check the name after ':'",
        ),
        (
            {"taskset": "no_such_taskset_37"},
            "taskset: no taskset package 'no_such_taskset_37' is installed; install it, or give 'package.module:Class'",
        ),
        (
            {"taskset": "rl.rewards:boxed_reward"},
            "taskset: rl.rewards:boxed_reward is not a verifiers.v1.Taskset; point at a Taskset subclass",
        ),
        (
            {"taskset": "tests.rl.verifiers_calc:RuntimeTaskset"},
            "taskset: tests.rl.verifiers_calc:RuntimeTaskset's task RuntimeTask overrides setup(); "
            "rlboost runs tasks without a runtime",
        ),
        (
            {"taskset": TASKSET, "config": {"task": {"max_calls": "many"}}},
            "config.task.max_calls: Input should be a valid integer",
        ),
    ],
)
def test_the_configuration_refuses_a_taskset_it_cannot_run_in_one_line(args, line):
    environment = json.dumps({"name": "verifiers", "args": args})
    with pytest.raises(ValueError) as refused:
        parse_config(f"environment: {environment}\nfabric:\n  enabled: true\n")
    assert f"environment.args: Value error, {line}" in str(refused.value)
    assert len(str(refused.value).strip().splitlines()) <= 2


def test_a_run_configuration_names_a_verifiers_taskset():
    config = parse_config(
        f"environment:\n  name: verifiers\n  args: {{taskset: '{TASKSET}'}}\nfabric:\n  enabled: true\n"
    )
    assert config.environment is not None and config.environment.args == {"taskset": TASKSET}
