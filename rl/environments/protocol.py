"""The environment protocol: what a multi-turn environment implements, and what it returns.

An `Environment` is OpenEnv's reset/step (and TRL's `environment_factory` object) on text: `reset`
with the problem, then one `step` per model turn with that turn's decoded text, answered by a
`StepResult` (an observation to append, or done with a terminal reward). A `ToolEnvironment`
offers tools, named functions with JSON arguments, which its `ToolFormat` (rl.environments.
tool_calls) finds in a turn and whose results it renders. Every step carries a `StepKey` (sample,
turn): a call repeated after a preemption has the same key, so it need not act twice.

Outcomes of the policy (a wrong answer, a malformed call, a tool given bad input: `ToolError`)
are observations or rewards. Anything else a `step` raises, a step past `environment.
step_timeout_s`, or `EnvironmentGone` is an infrastructure failure (`INFRA_FAILURE_KINDS`): retried,
then masked out of the loss, never scored. A `replayable` environment rebuilds its state on another
instance by `replay` of the logged turns. Torch-free; the detail: docs/environments.md.
"""

from __future__ import annotations

import abc
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

INFRA_FAILURE_KINDS = ("env_error", "env_timeout", "env_gone")
"""How an environment call failed, as counted (`infra:<kind>`): `step` raised, `step` ran past
`environment.step_timeout_s`, or the environment's server is gone (`EnvironmentGone`)."""


@dataclass(frozen=True)
class StepKey:
    """Idempotency key of one environment call: the same on a retry or after a migration."""

    sample_id: str
    turn: int
    """0-based model turn that this call answers."""


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one model turn."""

    observation: str | None
    """Text to append as an environment segment before the model's next turn (None: nothing). A
    `ToolEnvironment`'s is the tool's result; its `ToolFormat` renders it."""
    done: bool
    """The trajectory ends after this turn."""
    reward: float | None = None
    """Terminal reward when done (None: the run's reward function scores the trajectory)."""
    truncated: bool = False
    """Ended by a limit (turns, budget) rather than by an answer: an outcome of the policy, scored."""


@dataclass(frozen=True)
class Turn:
    """One model turn of a trajectory and the environment's answer to it."""

    text: str
    """The model's decoded turn."""
    observation: str | None = None
    """The observation that followed it (None for the last turn, or when the step returned none)."""


@dataclass(frozen=True)
class Trajectory:
    """A whole multi-turn episode, as a reward function with a `trajectory` keyword receives it."""

    prompt: str
    answer: str
    turns: tuple[Turn, ...]
    truncated: bool = False

    @property
    def response(self) -> str:
        """The last model turn's text (what a single-turn reward would score)."""
        return self.turns[-1].text if self.turns else ""


@dataclass(frozen=True)
class ToolCall:
    """A tool call found in a model turn: the tool's name and its JSON object of arguments."""

    name: str
    arguments: Mapping[str, Any]


class ToolError(Exception):
    """A tool refusing its input (the model's fault): its message becomes the observation."""


class ToolCallError(ValueError):
    """A turn ending in a tool call that does not parse; the message says why (it is the observation)."""


class EnvironmentGone(Exception):
    """Raised by an environment whose server or session no longer exists (`env_gone`)."""


class ToolFormat(abc.ABC):
    """How a model writes a tool call in its turn, and how a tool's result is written back."""

    stop: tuple[str, ...] = ()
    """Stop strings that end a model turn holding a tool call (added to the run's stop strings)."""

    @abc.abstractmethod
    def parse(self, turn_text: str) -> ToolCall | None:
        """The tool call that ends `turn_text`; None when the turn calls no tool (it is an answer).
        Raises `ToolCallError` when the turn ends in a call that does not parse."""

    @abc.abstractmethod
    def render(self, result: str) -> str:
        """The text of the environment segment carrying `result`: everything appended after the
        model's turn up to where its next turn starts."""

    def encode(self, result: str, tokenizer: Any) -> list[int]:
        """`render(result)` as token ids, encoded once when appended (no special tokens added)."""
        return list(tokenizer.encode(self.render(result), add_special_tokens=False))


class Environment(abc.ABC):
    """A multi-turn environment (one instance per trajectory): `reset`, then `step` per model turn.

    `step` is called with each model turn's decoded text, after the turn ends (a stop string, the
    end-of-sequence token or the budget). It may block (a thread pool runs it while the engine
    decodes other samples); one instance is only ever used by one trajectory at a time.
    """

    replayable: ClassVar[bool] = True
    """Its state can be rebuilt by replaying the logged turns (`replay`): a trajectory migrates
    with it. False: a fresh environment restarts the trajectory, or `session` names server state."""

    @abc.abstractmethod
    def reset(self, prompt: str, answer: str, meta: Mapping[str, Any] | None = None) -> None:
        """Start a trajectory on the problem `prompt` whose reference answer is `answer`."""

    @abc.abstractmethod
    def step(self, turn_text: str, key: StepKey) -> StepResult:
        """Answer the model's turn `turn_text` (turn `key.turn`, 0-based)."""

    @classmethod
    def check_args(cls, args: Mapping[str, Any]) -> None:
        """Refuse `environment.args` when the configuration loads, after the constructor's signature
        took them (default: nothing more to check): raise `rl.environments.registry.
        EnvironmentConfigError` for the key `environment.args`, saying what was found and the fix."""

    def replay(self, turn_text: str, observation: str | None, key: StepKey) -> None:
        """Restore the state after a logged turn and its logged observation, without acting twice.
        The default (a pure environment) steps again and ignores the result."""
        self.step(turn_text, key)

    def session(self) -> str | None:
        """A handle of state kept outside this process (a server's session id), logged with the
        trajectory; None for an environment that lives in the rollout instance."""
        return None

    def close(self) -> None:
        """Release what the environment holds (connections, processes); called once, at the end."""


class ToolEnvironment(Environment):
    """An environment of tools: a turn ending in a tool call gets the tool's result as its
    observation; a turn without one is an answer, judged by `answer`.

    A subclass sets `tools` (name -> function of JSON-typed keyword arguments, returning text, as
    TRL's tool methods) and implements `reset` and `answer`. A tool raises `ToolError` for input it
    refuses; any other exception is an infrastructure failure. The `format` is bound by the loader
    (`use_format`) from the model's tool-call convention.
    """

    tools: Mapping[str, Callable[..., str]] = {}
    _format: ToolFormat | None = None

    def use_format(self, format: ToolFormat) -> None:
        """Write and read tool calls in `format` (the loader binds it: text or chat template)."""
        self._format = format

    @property
    def format(self) -> ToolFormat:
        if self._format is None:
            raise RuntimeError(f"{type(self).__name__} has no ToolFormat: bind one with use_format()")
        return self._format

    @abc.abstractmethod
    def answer(self, turn_text: str, key: StepKey) -> StepResult:
        """Judge a turn that calls no tool (usually done, with the terminal reward)."""

    def step(self, turn_text: str, key: StepKey) -> StepResult:
        try:
            call = self.format.parse(turn_text)
        except ToolCallError as error:
            return StepResult(observation=f"error: {error}", done=False)
        if call is None:
            return self.answer(turn_text, key)
        return StepResult(observation=self.call_tool(call), done=False)

    def call_tool(self, call: ToolCall) -> str:
        """The result of `call`, or `error: ...` for an unknown tool, arguments it does not take,
        or input it refuses (`ToolError`)."""
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r} (tools: {', '.join(self.tools)})"
        try:
            bound = inspect.signature(tool).bind(**call.arguments)
        except TypeError as error:
            return f"error: {call.name}: {error}"
        try:
            return str(tool(*bound.args, **bound.kwargs))
        except ToolError as error:
            return f"error: {error}"

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools as OpenAI-style function schemas (for a chat template's `tools=`, or a prompt
        that describes them): name, the docstring's first line, and the parameters' JSON types."""
        return [_schema(name, tool) for name, tool in self.tools.items()]


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def _schema(name: str, tool: Callable[..., str]) -> dict[str, Any]:
    hints = typing.get_type_hints(tool)
    properties, required = {}, []
    for parameter in inspect.signature(tool).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        properties[parameter.name] = {"type": _JSON_TYPES.get(hints.get(parameter.name, str), "string")}
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    description = (inspect.getdoc(tool) or name).splitlines()[0]
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
