"""A small verifiers 0.4.0 taskset written with verifiers' own classes, for the adapter's tests
(`rl.environments.verifiers_env`): arithmetic tasks, a `calc` tool in a `vf.Toolset` (whose calls
may wait for a gate file, each noted in a file), two `@vf.reward`s and a `@vf.stop`. Written as
verifiers' own tasksets are; pyright cannot follow verifiers' invariant generic configs."""

# pyright: reportInvalidTypeArguments=false, reportAttributeAccessIssue=false, reportCallIssue=false

from __future__ import annotations

import time
from pathlib import Path

import verifiers.v1 as vf

from rl.environments.calculator import calc as evaluate
from rl.environments.protocol import ToolError
from rl.rewards import extract_final_number

PROBLEMS = (("417*36=", "15012"), ("12+345+67+89=", "513"))
"""The problems the memorised tiny model solves (tests.infra.rollout.agentic)."""


class CalcToolsetConfig(vf.ToolsetConfig):
    gate: str = ""
    """A file each call waits for (empty: none)."""
    calls: str = ""
    """A file each call is noted in, ``waiting <expr>`` then ``called <expr>`` (empty: none)."""


class CalcToolset(vf.Toolset[CalcToolsetConfig]):
    TOOL_PREFIX = None  # advertised as `calc`, the name the memorised model calls

    @vf.tool
    def calc(self, expr: str) -> str:
        """Evaluate an integer expression of + - * and parentheses, e.g. 417*36."""
        self._note("waiting", expr)
        while self.config.gate and not Path(self.config.gate).exists():
            time.sleep(0.005)
        self._note("called", expr)
        try:
            return evaluate(expr)
        except ToolError as error:
            raise ValueError(str(error)) from None

    def _note(self, what: str, expr: str) -> None:
        if self.config.calls:
            with open(self.config.calls, "a") as handle:
                handle.write(f"{what} {expr}\n")


class CalcData(vf.TaskData):
    answer: str


class CalcTaskConfig(vf.TaskConfig):
    max_calls: int = 5
    gate: str = ""
    calls: str = ""


class CalcTask(vf.Task[CalcData, vf.State, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(CalcToolsetConfig(gate=config.gate, calls=config.calls))]

    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages) and extract_final_number(trace.last_reply) == self.data.answer)

    @vf.reward(weight=0.25)
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))

    @vf.stop
    def enough_calls(self, trace: vf.Trace) -> bool:
        return len(trace.tool_messages) >= self.config.max_calls


class CalcTasksetConfig(vf.TasksetConfig):
    task: CalcTaskConfig = CalcTaskConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcTasksetConfig]):
    def load(self):
        for prompt, answer in PROBLEMS:
            yield CalcTask(CalcData(prompt=prompt, answer=answer), self.config.task)


class RuntimeTask(CalcTask):
    async def setup(self, trace, runtime) -> None:
        return None


class RuntimeTaskset(vf.Taskset[RuntimeTask, CalcTasksetConfig]):
    def load(self):
        yield RuntimeTask(CalcData(prompt="1+1=", answer="2"), self.config.task)
