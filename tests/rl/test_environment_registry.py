"""The registry: built-in rewards and environments by name, a user's by import path from a package
outside the project, each checked in one line naming the key, what was found and the fix, and
carried into a real rollout worker process as an import path."""

from __future__ import annotations

import multiprocessing
import pickle
import textwrap
from pathlib import Path

import pytest

from rl.config import EnvironmentConfig, RewardConfig
from rl.environments.calculator import Calculator
from rl.environments.protocol import StepKey, Trajectory, Turn
from rl.environments.registry import (
    REWARD_KINDS,
    EnvironmentConfigError,
    EnvironmentFactory,
    Reward,
    builtin_reward,
    environment_args,
    environment_class,
    environment_path,
    reward_function,
)
from rl.environments.tool_calls import TextToolFormat
from rl.rewards import ADD_FORMAT

USER_PACKAGE = {
    "__init__.py": "",
    "rewards.py": """
        from rl.environments.protocol import Trajectory

        def score(response: str, answer: str) -> float:
            return 1.0 if response.strip() == answer else 0.0

        def turns(response, answer, trajectory: Trajectory | None = None) -> float:
            return float(len(trajectory.turns)) if trajectory is not None else -1.0

        def extra(response, answer, **kwargs) -> float:
            return 0.5 if "trajectory" in kwargs else 0.0

        def one(response) -> float:
            return 1.0

        def three(response, answer, weight) -> float:
            return weight

        NOT_A_FUNCTION = 3
    """,
    "envs.py": """
        from rl.environments.protocol import Environment, StepResult

        class Echo(Environment):
            replayable = False

            def __init__(self, times: int = 1) -> None:
                self.times = times

            def reset(self, prompt, answer, meta=None):
                self.answer = answer

            def step(self, turn_text, key):
                if turn_text == self.answer:
                    return StepResult(None, done=True, reward=1.0)
                return StepResult(turn_text * self.times, done=False)

        class Half(Environment):
            def reset(self, prompt, answer, meta=None):
                pass
    """,
    "broken.py": "raise RuntimeError('the module is broken')\n",
    "needs.py": "import not_installed_dependency_xyz\n",
}


@pytest.fixture
def user_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    package = tmp_path / "user_pkg_37"
    package.mkdir()
    for name, text in USER_PACKAGE.items():
        (package / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def reason_of(call) -> EnvironmentConfigError:
    with pytest.raises(EnvironmentConfigError) as refused:
        call()
    assert "\n" not in str(refused.value)
    return refused.value


def test_builtin_rewards_are_ordinary_entries() -> None:
    assert REWARD_KINDS == ("exact_match", "boxed")
    reward = builtin_reward("exact_match", 0.5, ADD_FORMAT)
    assert reward.path == "rl.rewards:exact_match_reward"
    assert reward("168", "168") == 1.5 and reward.correctness("168", "168") == 1.0
    assert RewardConfig(kind="boxed").load() == Reward("rl.rewards:boxed_reward")
    assert RewardConfig(format_weight=0.5).load(family="add") == Reward(
        "rl.rewards:exact_match_reward", 0.5, ADD_FORMAT
    )


def test_a_user_reward_by_import_path(user_package: Path) -> None:
    reward = RewardConfig(function="user_pkg_37.rewards:score").load()
    assert reward == Reward("user_pkg_37.rewards:score") and reward(" 7", "7") == 1.0
    trajectory = Trajectory("p", "7", (Turn("<call>x</call>", "1"), Turn("7")))
    by_trajectory = RewardConfig(function="user_pkg_37.rewards:turns").load()
    assert by_trajectory.takes_trajectory and by_trajectory("7", "7", trajectory) == 2.0
    assert reward_function("user_pkg_37.rewards:extra") is True
    assert Reward("user_pkg_37.rewards:extra", takes_trajectory=True)("7", "7", trajectory) == 0.5
    assert reward_function("user_pkg_37.rewards:score") is False


@pytest.mark.parametrize(
    ("path", "found", "fix"),
    [
        ("user_pkg_37.rewards:one", "takes (response) but a reward is called as fn(response, answer)", "give it"),
        ("user_pkg_37.rewards:three", "takes (response, answer, weight)", "(response: str, answer: str)"),
        ("user_pkg_37.rewards:NOT_A_FUNCTION", "is a int, not a function", "point at a function"),
        ("user_pkg_37.rewards:nothing", "module user_pkg_37.rewards has no attribute 'nothing'", "check the name"),
        ("user_pkg_37.missing:score", "no module named 'user_pkg_37.missing'", "install its package"),
        ("nowhere_pkg_37.rewards:score", "no module named 'nowhere_pkg_37'", "or fix the path"),
        ("user_pkg_37.broken:score", "importing user_pkg_37.broken failed: RuntimeError: the module is broken", "fix"),
        ("user_pkg_37.needs:score", "No module named 'not_installed_dependency_xyz'", "fix the module's imports"),
        ("user_pkg_37.rewards.score", "is not an import path", "'package.module:name'"),
        ("__main__:score", "is defined in __main__", "move it into a module"),
    ],
)
def test_a_bad_reward_is_one_line_naming_the_key_what_and_the_fix(
    user_package: Path, path: str, found: str, fix: str
) -> None:
    error = reason_of(lambda: reward_function(path))
    assert error.key == "reward.function" and found in error.found and fix in error.fix, str(error)
    assert str(error).startswith("reward.function: ")


def test_environments_by_name_or_class_with_arguments(user_package: Path) -> None:
    calculator = EnvironmentConfig(name="calculator").load()
    assert calculator == EnvironmentFactory("rl.environments.calculator:Calculator", {})
    assert calculator.replayable and calculator.uses_tools
    made = calculator.create(TextToolFormat())
    assert isinstance(made, Calculator) and isinstance(made.format, TextToolFormat)
    with pytest.raises(ValueError, match="create it with a tool_format"):
        calculator.create()
    echo = EnvironmentConfig.model_validate({"class": "user_pkg_37.envs:Echo", "args": {"times": 2}}).load()
    assert not echo.replayable and not echo.uses_tools
    environment = echo.create()
    environment.reset("p", "ok")
    assert environment.step("ab", StepKey("s", 0)).observation == "abab"


@pytest.mark.parametrize(
    ("check", "key", "found"),
    [
        (lambda: environment_path("calculater", None), "environment.name", "unknown environment 'calculater'"),
        (lambda: environment_path(None, None), "environment", "neither name nor class is set"),
        (lambda: environment_class("user_pkg_37.rewards:score"), "environment.class", "is not a subclass of"),
        (lambda: environment_class("user_pkg_37.envs:Half"), "environment.class", "does not implement step"),
        (lambda: environment_class("user_pkg_37.envs:Gone"), "environment.class", "has no attribute 'Gone'"),
        (lambda: environment_args(Calculator, {"digits": 3}), "environment.args", "Calculator() does not take"),
    ],
)
def test_a_bad_environment_is_one_line_naming_the_key(user_package: Path, check, key: str, found: str) -> None:
    error = reason_of(check)
    assert error.key == key and found in error.found, str(error)


def _in_a_worker(reward: bytes, factory: bytes, queue) -> None:
    """A rollout worker's view: unpickle, import by path, score and step."""
    env = pickle.loads(factory).create()
    env.reset("p", "ok")
    queue.put((pickle.loads(reward)("7", "7"), env.step("x", StepKey("s", 0)).observation))


def test_rewards_and_environments_travel_to_a_worker_process_as_import_paths(user_package: Path) -> None:
    reward = pickle.dumps(RewardConfig(function="user_pkg_37.rewards:score").load())
    factory = pickle.dumps(EnvironmentConfig.model_validate({"class": "user_pkg_37.envs:Echo"}).load())
    assert b"user_pkg_37.rewards:score" in reward and b"user_pkg_37.envs:Echo" in factory
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing inherited but sys.path
    queue = context.Queue()
    worker = context.Process(target=_in_a_worker, args=(reward, factory, queue))
    worker.start()
    try:
        assert queue.get(timeout=120) == (1.0, "x")
    finally:
        worker.join(timeout=60)
    assert worker.exitcode == 0
