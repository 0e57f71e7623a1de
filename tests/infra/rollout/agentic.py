"""What the trajectory tests share: a tiny model that has memorised two calculator trajectories
(one tool call, and two), and environments for tests that a worker imports by path: a calculator
whose tool calls wait for a gate file, and one that fails as the infrastructure does."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from infra.rollout.tokenlog import EnvironmentSpec, GroupSpec
from rl.environments.calculator import Calculator
from rl.environments.protocol import EnvironmentGone, StepKey, StepResult, ToolCall
from rl.environments.tool_calls import TextToolFormat
from rl.models import build_tiny_llama, save_model
from tests.helpers import tiny_shape

FORMAT = TextToolFormat()
ONE_CALL = ("417*36=", "15012", ['calc {"expr":"417*36"}'], ["15012"], "so the answer is 15012")
"""(prompt, answer, the calls' bodies, their results, the final turn) of a trajectory of 2 turns."""
TWO_CALLS = (
    "12+345+67+89=",
    "513",
    ['calc {"expr":"12+345"}', 'calc {"expr":"357+67+89"}'],
    ["357", "513"],
    "so the answer is 513",
)
"""A trajectory of 3 turns; its second turn is long (a preemption lands in it)."""
PREAMBLES = ["", "then I add the rest of the numbers to the first sum, one call for all of them "]
SAMPLING = {"temperature": 1.0, "stop": list(FORMAT.stop)}
CALCULATOR = "rl.environments.calculator:Calculator"


def model_turns(problem: tuple) -> list[str]:
    """The model's turns of a memorised trajectory."""
    _, _, calls, _, final = problem
    return [PREAMBLES[k] + f"<call>{body}</call>" for k, body in enumerate(calls)] + [final]


def transcript(problem: tuple) -> str:
    """The whole response: each model turn, then the rendered result of its call."""
    results = [FORMAT.render(result) for result in problem[3]] + [""]
    return "".join(turn + result for turn, result in zip(model_turns(problem), results))


def memorised_model(path: Path, steps: int = 300) -> Path:
    """The smallest tiny Llama trained until it writes `transcript` after each prompt (4 s on a core)."""
    model, tokenizer = build_tiny_llama(tiny_shape(smallest=True))
    sequences = [
        tokenizer.encode(problem[0]) + tokenizer.encode(transcript(problem), add_special_tokens=False)
        for problem in (ONE_CALL, TWO_CALLS)
    ]
    sequences = [s + [tokenizer.eos_token_id] for s in sequences]
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    save_model(model, tokenizer, path)
    return path


def environment(problem: tuple, path: str = CALCULATOR, **spec) -> EnvironmentSpec:
    return EnvironmentSpec(path, prompt=problem[0], answer=problem[1], **({"max_turns": 4} | spec))


def group(group_id: int, problem: tuple, n: int, tokenizer, env: EnvironmentSpec | None, **kwargs) -> GroupSpec:
    return GroupSpec(
        group_id, tokenizer.encode(problem[0]), n, 400, seed=5, sampling=SAMPLING, environment=env, **kwargs
    )


class GatedCalculator(Calculator):
    """The calculator whose k-th tool call of a trajectory waits until the file `gates[k]` exists
    (a test holds a tool call open); each call is appended to the file `calls` as ``waiting
    <sample> <turn>``, then ``called <sample> <turn>`` (its `StepKey`)."""

    def __init__(self, gates: list[str] = [], calls: str = "") -> None:  # noqa: B006 - never mutated
        super().__init__()
        self.gates, self.calls = [Path(g) for g in gates], calls
        self._key: StepKey | None = None

    def step(self, turn_text: str, key: StepKey) -> StepResult:
        self._key = key
        return super().step(turn_text, key)

    def call_tool(self, call: ToolCall) -> str:
        index = self._results
        self._note("waiting")
        if index < len(self.gates):
            while not self.gates[index].exists():
                time.sleep(0.005)
        self._note("called")
        return super().call_tool(call)

    def _note(self, what: str) -> None:
        if self.calls and self._key is not None:
            with open(self.calls, "a") as handle:
                handle.write(f"{what} {self._key.sample_id} {self._key.turn}\n")


RELEASE_HUNG = threading.Event()
"""Set at the end of a test: steps that hang (`FailingCalculator` kind `hang`) return."""
FAILURES: dict[tuple[str, int], int] = {}
"""Failures so far per (sample, turn), in this process."""


class FailingCalculator(Calculator):
    """The calculator whose tool calls fail `times` times per (sample, turn) first, as `kind` says:
    ``raise`` (an exception), ``gone`` (`EnvironmentGone`) or ``hang`` (past any timeout); only
    for the samples whose id ends with `only` if given, only at turn `turn` if given."""

    def __init__(self, kind: str = "raise", times: int = 1, only: str = "", turn: int = -1) -> None:
        super().__init__()
        self.kind, self.times, self.only, self.turn = kind, times, only, turn

    def step(self, turn_text: str, key: StepKey) -> StepResult:
        failing = key.sample_id.endswith(self.only) and self.turn in (-1, key.turn)
        failing = failing and FORMAT.parse(turn_text) is not None
        if failing and FAILURES.get((key.sample_id, key.turn), 0) < self.times:
            FAILURES[key.sample_id, key.turn] = FAILURES.get((key.sample_id, key.turn), 0) + 1
            if self.kind == "gone":
                raise EnvironmentGone("the session is gone")
            if self.kind == "hang":
                RELEASE_HUNG.wait(timeout=60)
            else:
                raise RuntimeError("the tool's backend broke")
        return super().step(turn_text, key)


class ForgetfulCalculator(FailingCalculator):
    """A `FailingCalculator` that cannot rebuild its state from the logged turns."""

    replayable = False
