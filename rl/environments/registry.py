"""Rewards and environments by name or import path, validated when the configuration loads.

`REWARDS` and `ENVIRONMENTS` name the built-ins, as ordinary entries: import paths. Any other is
given as ``"pkg.module:attr"``. `Reward` and `EnvironmentFactory` are picklable records that
carry the import path, not the object: a rollout worker process imports it again (its package is
installed there, as the project is), so a module-level lambda or callable object travels too; a
configuration makes them (`RewardConfig.load`, `EnvironmentConfig.load`).

A reward is ``fn(response, answer) -> float``, or ``fn(response, answer, **kwargs)``, or takes a
keyword ``trajectory`` (a `Trajectory`). An environment is a subclass of `Environment` whose
constructor takes `environment.args`. Validation (`reward_function`, `environment_class`,
`environment_args`) raises
`EnvironmentConfigError` naming the key, what was found and the fix, in one line: a missing module
or attribute, a wrong signature, an unknown name.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from rl.environments.protocol import Environment, ToolEnvironment, ToolFormat, Trajectory
from rl.rewards import format_reward

REWARDS: Mapping[str, str] = {"exact_match": "rl.rewards:exact_match_reward", "boxed": "rl.rewards:boxed_reward"}
"""Built-in rewards (`reward.kind`) by name: their import paths."""
REWARD_KINDS = tuple(REWARDS)
ENVIRONMENTS: Mapping[str, str] = {
    "calculator": "rl.environments.calculator:Calculator",
    "verifiers": "rl.environments.verifiers_env:VerifiersEnvironment",
}
"""Built-in environments (`environment.name`) by name: their import paths."""


class EnvironmentConfigError(ValueError):
    """A reward or environment that cannot be loaded: ``<key>: <what was found>; <the fix>``."""

    def __init__(self, key: str, found: str, fix: str) -> None:
        self.key, self.found, self.fix = key, " ".join(found.split()), fix
        super().__init__(f"{key}: {self.reason}")

    @property
    def reason(self) -> str:
        """The message without the key (a configuration error names the key itself)."""
        return f"{self.found}; {self.fix}"


@functools.cache
def _import(path: str) -> Any:
    module, _, attribute = path.partition(":")
    target: Any = importlib.import_module(module)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


def resolve(path: str, key: str) -> Any:
    """The object at import path ``"pkg.module:attr"`` (attr may be dotted), or
    `EnvironmentConfigError` for `key` saying what is missing."""
    module, colon, attribute = path.partition(":")
    if not colon or not module or not attribute:
        raise EnvironmentConfigError(key, f"{path!r} is not an import path", "write it as 'package.module:name'")
    if module == "__main__":
        raise EnvironmentConfigError(
            key, f"{path!r} is defined in __main__", "rollout workers cannot import it: move it into a module"
        )
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is not None and (module == error.name or module.startswith(error.name + ".")):
            raise EnvironmentConfigError(
                key,
                f"no module named {error.name!r} (in {path!r})",
                "install its package here and in the rollout instances, or fix the path",
            ) from None
        raise EnvironmentConfigError(key, f"importing {module} failed: {error}", "fix the module's imports") from None
    except Exception as error:  # the user's module raised while importing: say what, in one line
        raise EnvironmentConfigError(
            key, f"importing {module} failed: {type(error).__name__}: {error}", "fix the module"
        ) from None
    try:
        return _import(path)
    except AttributeError:
        raise EnvironmentConfigError(
            key, f"module {module} has no attribute {attribute!r}", "check the name after ':'"
        ) from None


def _signature(target: Any, path: str, key: str) -> inspect.Signature:
    try:  # shown in messages without its return annotation
        return inspect.signature(target).replace(return_annotation=inspect.Signature.empty)
    except (TypeError, ValueError):
        raise EnvironmentConfigError(
            key, f"{path} has no signature to check", "give a Python function or class"
        ) from None


def reward_function(path: str, key: str = "reward.function") -> bool:
    """Check the reward at `path`; whether it takes the keyword `trajectory` (or `**kwargs`)."""
    function = resolve(path, key)
    if not callable(function):
        raise EnvironmentConfigError(
            key, f"{path} is a {type(function).__name__}, not a function", "point at a function"
        )
    signature = _signature(function, path, key)
    try:
        signature.bind("response", "answer")
    except TypeError:
        raise EnvironmentConfigError(
            key,
            f"{path} takes {signature} but a reward is called as fn(response, answer)",
            "give it the parameters (response: str, answer: str), and optionally trajectory=None or **kwargs",
        ) from None
    try:
        signature.bind("response", "answer", trajectory=None)
    except TypeError:
        return False
    return True


def environment_class(path: str, key: str = "environment.class") -> type[Environment]:
    """Check that `path` imports as a concrete subclass of `Environment`; the class."""
    target = resolve(path, key)
    if not (isinstance(target, type) and issubclass(target, Environment)):
        raise EnvironmentConfigError(
            key, f"{path} is not a subclass of rl.environments.protocol.Environment", "subclass it (reset and step)"
        )
    if inspect.isabstract(target):
        missing = ", ".join(sorted(getattr(target, "__abstractmethods__", ())))
        raise EnvironmentConfigError(key, f"{path} does not implement {missing}", "define those methods")
    return target


def environment_args(cls: type[Environment], args: Mapping[str, Any], key: str = "environment.args") -> None:
    """Check that the constructor of `cls` takes the keyword arguments `args`, then the class's own
    `check_args`."""
    signature = _signature(cls, cls.__qualname__, key)
    try:
        signature.bind(**args)
    except TypeError as error:
        raise EnvironmentConfigError(
            key,
            f"{cls.__qualname__}{signature} does not take {dict(args)} ({error})",
            "give the arguments its constructor takes",
        ) from None
    cls.check_args(args)


def environment_path(name: str | None, class_path: str | None) -> str:
    """The import path of `environment.name` (a built-in) or `environment.class`."""
    if name is not None:
        if name not in ENVIRONMENTS:
            raise EnvironmentConfigError(
                "environment.name",
                f"unknown environment {name!r}",
                f"choose one of {', '.join(ENVIRONMENTS)}, or give class: 'package.module:Class'",
            )
        return ENVIRONMENTS[name]
    if class_path is None:
        raise EnvironmentConfigError("environment", "neither name nor class is set", "set one of them")
    return class_path


@dataclass(frozen=True)
class Reward:
    """A loaded reward: ``fn(response, answer) + format_weight * format``, picklable by its path."""

    path: str
    format_weight: float = 0.0
    format_pattern: str | None = None
    takes_trajectory: bool = False

    def __call__(self, response: str, answer: str, trajectory: Trajectory | None = None) -> float:
        function: Callable[..., float] = _import(self.path)
        if self.takes_trajectory:
            reward = function(response, answer, trajectory=trajectory)
        else:
            reward = function(response, answer)
        if self.format_weight and self.format_pattern is not None:
            reward += self.format_weight * format_reward(response, self.format_pattern)
        return float(reward)

    @property
    def correctness(self) -> Reward:
        """The same reward without its format term."""
        return replace(self, format_weight=0.0, format_pattern=None)


def builtin_reward(kind: str, format_weight: float = 0.0, format_pattern: str | None = None) -> Reward:
    """The built-in reward named `kind` (one of `REWARD_KINDS`), plus an optional weighted format term."""
    if kind not in REWARDS:
        raise ValueError(f"unknown reward kind {kind!r}; expected one of {REWARD_KINDS}")
    if format_weight < 0:
        raise ValueError(f"format_weight must be >= 0, got {format_weight}")
    if format_weight > 0 and format_pattern is None:
        raise ValueError("format_weight > 0 needs format_pattern (e.g. rewards.ADD_FORMAT)")
    if format_pattern is not None:
        try:
            re.compile(format_pattern)
        except re.error as error:
            raise ValueError(f"format_pattern {format_pattern!r} is not a regex: {error}") from None
    return Reward(REWARDS[kind], format_weight, format_pattern)


@dataclass(frozen=True)
class EnvironmentFactory:
    """Makes one fresh environment per trajectory; picklable (an import path and the arguments)."""

    path: str
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def cls(self) -> type[Environment]:
        return _import(self.path)

    @property
    def replayable(self) -> bool:
        return self.cls.replayable

    @property
    def uses_tools(self) -> bool:
        return issubclass(self.cls, ToolEnvironment)

    def create(self, tool_format: ToolFormat | None = None) -> Environment:
        """A new environment; a `ToolEnvironment` is bound to `tool_format` (required for one)."""
        environment = self.cls(**self.args)
        if isinstance(environment, ToolEnvironment):
            if tool_format is None:
                raise ValueError(f"{self.path} is a ToolEnvironment: create it with a tool_format")
            environment.use_format(tool_format)
        return environment
