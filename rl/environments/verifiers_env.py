"""A verifiers 0.4.0 taskset as an rlboost environment (`environment.name: verifiers`).

rlboost is the harness: it samples the model's turns token by token and plays verifiers' chat loop
(the `null` harness) around them. Each trajectory gets the task whose key its problem's `answer`
holds (`write_tasks` writes a taskset as a data file), the task's and taskset's `Toolset`s built in
process (their `@vf.tool` methods are the tools, named as verifiers advertises them), and a
`vf.Trace` of the conversation. A turn that calls a tool (in the run's tool-call format) gets its
result; after it the task's `@vf.stop`s run; a turn without a call, or a stop that fires, ends the
trajectory with the reward of the task's `@vf.reward`s (`Task.score` on the trace, weighted sum).
The verifiers coroutines run on the environment's own event loop, on the worker's step thread.
Replayable: a migrated trajectory's logged turns are appended again and their tool calls re-run
(to rebuild what the tools keep), their logged results kept. What a taskset may not use (a runtime,
a custom `Env.run`, request or response hooks, judges) is refused when the configuration loads.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from rl.environments.protocol import StepKey, StepResult, ToolCallError, ToolEnvironment, ToolError
from rl.environments.registry import EnvironmentConfigError, resolve

OPENENV_NOTE = "OpenEnv 0.10.0 needs fastmcp<4 (mcp<2) while vLLM needs mcp>=2"
"""Why the standard library adapted is verifiers, not OpenEnv (docs/environments.md)."""


try:  # imported with the module: a worker imports it before a step's timeout starts (seconds)
    import verifiers.v1 as _verifiers
except ModuleNotFoundError:  # the `verifiers` extra is not installed: refused when a run names it
    _verifiers = None


def _vf() -> Any:
    """`verifiers.v1`, or a one-line refusal when the `verifiers` extra is not installed."""
    if _verifiers is None:
        raise _refuse(
            "taskset",
            "the verifiers package is not installed",
            "pip install 'rlboost[verifiers]' here and in the rollout instances",
        )
    return _verifiers


def taskset_class(taskset: str) -> type:
    """The `vf.Taskset` subclass that `taskset` names: an import path ``pkg.module:Class``, or a
    verifiers taskset id (an installed package exporting one Taskset in `__all__`)."""
    vf = _vf()
    if ":" in taskset:
        try:
            cls = resolve(taskset, "environment.args")
        except EnvironmentConfigError as error:
            raise _refuse("taskset", error.found, error.fix) from None
    else:
        from verifiers.v1.utils.loaders import taskset_class as by_id

        try:
            cls = by_id(taskset)
        except ModuleNotFoundError:
            raise _refuse(
                "taskset", f"no taskset package {taskset!r} is installed", "install it, or give 'package.module:Class'"
            ) from None
        except (AttributeError, TypeError, ValueError) as error:
            raise _refuse(
                "taskset", str(error), "install the taskset's package, or give 'package.module:Class'"
            ) from None
    if not (isinstance(cls, type) and issubclass(cls, vf.Taskset)):
        raise _refuse("taskset", f"{taskset} is not a verifiers.v1.Taskset", "point at a Taskset subclass")
    return cls


def _config(cls: type, taskset: str, config: Mapping[str, Any]) -> Any:
    """The taskset's validated config (its own `TasksetConfig` subclass)."""
    vf = _vf()
    from pydantic import ValidationError
    from verifiers.v1.utils.generic import concrete_type

    config_cls = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
    try:
        return config_cls.model_validate({**config, "id": taskset})
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise _refuse(f"config.{where}", first["msg"], f"give the fields {config_cls.__name__} takes") from None


def _refuse(argument: str, what: str, fix: str) -> EnvironmentConfigError:
    """`environment.args.<argument>` refused: what was found, and the fix."""
    return EnvironmentConfigError("environment.args", f"{argument}: {what}", fix)


def _check_task(task: Any, taskset: str) -> None:
    """Refuse a task that needs what rlboost does not run: a runtime, hooks at the model's
    request or response, judges."""
    vf = _vf()
    from verifiers.v1.session import hook_boundary
    from verifiers.v1.utils.decorators import discover_decorated

    name = type(task).__name__
    if task.NEEDS_CONTAINER:
        raise _refuse("taskset", f"{taskset}'s task {name} needs a container", "rlboost runs tasks without a runtime")
    for hook in ("setup", "finalize", "stage_verifier"):
        if getattr(type(task), hook) is not getattr(vf.Task, hook):
            raise _refuse(
                "taskset", f"{taskset}'s task {name} overrides {hook}()", "rlboost runs tasks without a runtime"
            )
    if discover_decorated(task, "intercept"):
        raise _refuse(
            "taskset", f"{taskset}'s task {name} has @vf.intercept hooks", "rlboost does not rewrite the model's turns"
        )
    for stop in task.hooks("stop"):
        if hook_boundary(stop, allow_trace=True) is not vf.Trace:
            raise _refuse(
                "taskset", f"{taskset}'s @vf.stop {stop.__name__} takes a Request or Response", "make it take the Trace"
            )
    if task.config.judges:
        raise _refuse("taskset", f"{taskset}'s task {name} has judges", "rlboost scores with @vf.reward functions only")
    for fn in (*task.hooks("reward"), *task.hooks("metric")):
        runtime = inspect.signature(fn).parameters.get("runtime")
        if runtime is not None and runtime.default is inspect.Parameter.empty:
            raise _refuse("taskset", f"{taskset}'s {fn.__name__} needs a runtime", "score from the task and the trace")


@functools.cache
def _tasks(taskset: str, config_json: str, limit: int | None) -> tuple[Any, dict[str, Any]]:
    """(the taskset, its first `limit` tasks by key), once per process."""
    cls = taskset_class(taskset)
    loaded = cls(_config(cls, taskset, json.loads(config_json)))
    if not loaded.bounded and limit is None:
        raise _refuse("taskset", f"{taskset} is infinite", "give environment.args.limit, the tasks it may serve")
    tasks = loaded if limit is None else loaded.take(limit)
    return loaded, {task.key: task for task in tasks}


def check(taskset: str, config: Mapping[str, Any] | None = None, limit: int | None = None) -> None:
    """Refuse, in one line naming the key, a taskset that does not load or that rlboost cannot run."""
    cls = taskset_class(taskset)
    if ":" not in taskset:
        from verifiers.v1.utils.loaders import default_harness_id, environment_class

        if environment_class(taskset) is not _vf().SingleAgentEnv:
            raise _refuse("taskset", f"{taskset} exports its own Env (a custom run())", "give a plain taskset")
        if default_harness_id(taskset) != "bash":
            raise _refuse("taskset", f"{taskset} exports its own Harness", "give a plain taskset")
    _config(cls, taskset, config or {})
    _, tasks = _tasks(taskset, json.dumps(config or {}, sort_keys=True), limit)
    if not tasks:
        raise _refuse("taskset", f"{taskset} has no tasks", "check its config")
    _check_task(next(iter(tasks.values())), taskset)


def write_tasks(taskset: str, path: Path, config: Mapping[str, Any] | None = None, limit: int | None = None) -> int:
    """Write the taskset's tasks as a JSONL data file (`data.source: file`): the prompt's text,
    and the task's key as the answer (the environment finds its task by it). The count written."""
    _, tasks = _tasks(taskset, json.dumps(config or {}, sort_keys=True), limit)
    with Path(path).open("w") as out:
        for key, task in tasks.items():
            out.write(json.dumps({"prompt": task.data.prompt_text, "answer": key}) + "\n")
    return len(tasks)


def _result_text(result: Any) -> str:
    """A tool's return value as MCP would carry it: text as it is, other values as JSON."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except TypeError:
        return str(result)


class VerifiersEnvironment(ToolEnvironment):
    """One trajectory of a verifiers task; `taskset` as `taskset_class` takes it, `config` its
    `TasksetConfig` fields, `limit` the tasks served of an infinite taskset."""

    replayable: ClassVar[bool] = True

    def __init__(self, taskset: str, config: Mapping[str, Any] | None = None, limit: int | None = None) -> None:
        self.taskset_id, self.limit = taskset, limit
        self.config_json = json.dumps(dict(config or {}), sort_keys=True)
        self._loop = asyncio.new_event_loop()
        self._toolsets: list[Any] = []
        self.tools: dict[str, Callable[..., str]] = {}
        self.task: Any = None
        self.trace: Any = None

    @classmethod
    def check_args(cls, args: Mapping[str, Any]) -> None:
        check(args["taskset"], args.get("config"), args.get("limit"))

    def _run(self, coroutine: Any) -> Any:
        return self._loop.run_until_complete(coroutine)

    def reset(self, prompt: str, answer: str, meta: Mapping[str, Any] | None = None) -> None:
        vf = _vf()
        from verifiers.v1.state import state_cls

        loaded, tasks = _tasks(self.taskset_id, self.config_json, self.limit)
        if answer not in tasks:
            raise ValueError(f"no task of {self.taskset_id} has the key {answer!r} (write the data with write_tasks)")
        task = self.task = tasks[answer]
        self.trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            state=state_cls(type(task))(),
            agent=vf.AgentInfo(config=vf.AgentConfig()),
        )
        opening = [vf.SystemMessage(content=task.data.system_prompt)] if task.data.system_prompt else []
        opening += task.data.prompt if isinstance(task.data.prompt, list) else [vf.UserMessage(content=prompt)]
        for message in opening:
            self._append(message, sampled=False)
        self._toolsets = [*task.toolsets(task.config), *type(loaded).toolsets(loaded.config)]
        self.tools = {}
        for toolset in self._toolsets:
            self._run(toolset.setup())
            self._run(toolset.setup_task(task))
            prefix = f"{toolset.server_name}_" if toolset.server_name else ""
            for fn in _tools(toolset):
                self.tools[prefix + (getattr(fn, "tool_name", None) or fn.__name__)] = self._tool(fn)

    def _tool(self, fn: Callable[..., Any]) -> Callable[..., str]:
        """`fn` as a synchronous tool sharing the trace's state (what verifiers' state channel
        gives a tool server); input it refuses (`ValueError`) is the model's fault."""
        from verifiers.v1.mcp.server import _call_state  # the state a tool's `self.state` reads

        def call(*args: Any, **kwargs: Any) -> str:
            async def run() -> Any:
                token = _call_state.set(self.trace.state)
                try:
                    result = fn(*args, **kwargs)
                    return await result if inspect.isawaitable(result) else result
                finally:
                    _call_state.reset(token)

            try:
                return _result_text(self._run(run()))
            except ValueError as error:
                raise ToolError(f"{type(error).__name__}: {error}") from None

        call.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
        call.__doc__ = fn.__doc__
        return call

    def _append(self, message: Any, sampled: bool) -> None:
        from verifiers.v1.graph import MessageNode

        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(MessageNode(parent=parent, message=message, sampled=sampled))

    def _turn(self, turn_text: str, key: StepKey, observation: str | None = None) -> str | None:
        """Append the model's turn and the answer to it: its tool's result (the tool runs, also
        when replaying, to rebuild what it keeps), or `observation` when replaying a logged one.
        The observation (None: a turn that calls no tool)."""
        vf = _vf()
        try:
            call = self.format.parse(turn_text)
        except ToolCallError as error:
            self._append(vf.AssistantMessage(content=turn_text), sampled=True)
            result = observation if observation is not None else f"error: {error}"
            self._append(vf.UserMessage(content=result), sampled=False)
            return result
        if call is None:
            self._append(vf.AssistantMessage(content=turn_text), sampled=True)
            return None
        call_id = f"call_{key.turn}"
        arguments = json.dumps(dict(call.arguments))
        tool_call = vf.ToolCall(id=call_id, name=call.name, arguments=arguments)
        self._append(vf.AssistantMessage(content=turn_text, tool_calls=[tool_call]), sampled=True)
        result = self.call_tool(call)
        result = observation if observation is not None else result
        self._append(vf.ToolMessage(tool_call_id=call_id, content=result, name=call.name), sampled=False)
        return result

    def step(self, turn_text: str, key: StepKey) -> StepResult:
        observation = self._turn(turn_text, key)
        if observation is None:
            return self.answer(turn_text, key)
        stopped = self._run(self._stopped())
        if stopped is not None:
            return StepResult(None, done=True, reward=self._run(self._score()))
        return StepResult(observation, done=False)

    def replay(self, turn_text: str, observation: str | None, key: StepKey) -> None:
        self._turn(turn_text, key, observation)

    def answer(self, turn_text: str, key: StepKey) -> StepResult:
        self.trace.stop("agent_completed")
        return StepResult(None, done=True, reward=self._run(self._score()))

    async def _stopped(self) -> str | None:
        """The first `@vf.stop` that fires on the trace (it stops it), as verifiers runs them
        before each model call."""
        vf = _vf()
        from verifiers.v1.session import call_hook

        for stop in self.task.hooks("stop"):
            if await call_hook(stop, {vf.Trace: self.trace}):
                self.trace.stop(stop.__name__)
                return stop.__name__
        return None

    async def _score(self) -> float:
        """The task's weighted reward of the trace (`Task.score`)."""
        await self.task.score(self.trace)
        return float(self.trace.reward)

    def close(self) -> None:
        try:
            for toolset in self._toolsets:
                self._run(toolset._exit_stack.aclose())
        finally:
            self._loop.close()


def _tools(toolset: Any) -> list[Callable[..., Any]]:
    from verifiers.v1.utils.decorators import discover_decorated

    return discover_decorated(toolset, "tool")
