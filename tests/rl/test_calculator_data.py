"""The calculator as a data source and a pretraining corpus: its problems through `data.family:
calculator` or `calculator_products` (a held-out split, written for an instruct model in a chat
run, refused without its environment), demonstrations whose tool results
are never trained, and a held-out evaluation that runs each problem as a trajectory in the
environment (the tiny model that memorised two calculator trajectories), leaving out one whose
environment fails."""

from __future__ import annotations

import random

import pytest

from infra.run.config import load_config
from rl.config import DataConfig, PretrainConfig
from rl.engine import HFEngine
from rl.environments.calculator import FAMILY, problem_stream
from rl.environments.registry import EnvironmentFactory
from rl.environments.tool_calls import RESULT_CLOSE, RESULT_OPEN
from rl.evaluation import evaluate_accuracy
from rl.families import FAMILIES, environment_of, eval_set
from rl.generation import SamplingParams
from rl.models import load_model
from rl.pretrain import _supervised_batch, target_segments
from rl.problems import Problem, take
from rl.prompt_source import PromptSource
from rl.stops import StopStrings
from rl.tokenizer import build_char_tokenizer
from tests.helpers import tiny_run
from tests.infra.rollout import agentic

CALCULATOR = "rl.environments.calculator:Calculator"


def test_the_calculator_is_a_data_family_with_a_held_out_split():
    assert FAMILY in FAMILIES and environment_of(FAMILY) == "calculator" and environment_of("add") is None
    source = PromptSource(DataConfig(family=FAMILY, seed=3))
    train = source.take(0, 200)
    assert source.take(100, 50) == train[100:150]  # addressed by the cursor, as the other families
    held_out = source.eval_records(100)
    assert not {r.prompt for r in train} & {r.prompt for r in held_out}
    assert all(r.prompt.endswith("=") and ("*" in r.prompt or "+" in r.prompt) for r in train)
    assert [r.prompt for r in held_out] == [p.prompt for p in eval_set(FAMILY, 100)]
    products = PromptSource(DataConfig(family="calculator_products", seed=3))
    assert environment_of("calculator_products") == "calculator"
    assert all(r.prompt.count("*") == 1 and len(r.prompt) == 7 for r in products.take(0, 100))
    assert not {r.prompt for r in products.take(0, 200)} & {r.prompt for r in products.eval_records(100)}
    assert all("+" in p.prompt for p in take(problem_stream(0, kinds=("sum",)), 50))
    with pytest.raises(ValueError, match="kinds must be a non-empty subset"):
        next(problem_stream(0, kinds=("div",)))


def test_a_chat_run_gets_the_same_problems_written_for_an_instruct_model():
    text, chat = (PromptSource(DataConfig(family="calculator_products", seed=3), chat=c) for c in (False, True))
    for plain, asked in zip(text.take(0, 50) + text.eval_records(20), chat.take(0, 50) + chat.eval_records(20)):
        assert asked.prompt == f"What is {plain.prompt[:-1]}? Use the calc tool, then answer with the number."
        assert asked.answer == plain.answer
    words = PromptSource(DataConfig(family="words", seed=3), chat=True)  # not a tool family: as written
    assert words.take(0, 5) == PromptSource(DataConfig(family="words", seed=3)).take(0, 5)


def test_a_calculator_run_needs_its_environment(tmp_path):
    overrides = {"data.family": FAMILY, "environment": None}
    with pytest.raises(Exception, match="data.family: calculator problems are solved with a tool"):
        load_config(None, tiny_run(tmp_path / "model", tmp_path, "no-env", None, overrides))
    config = load_config(
        None, tiny_run(tmp_path / "model", tmp_path, "env", None, {**overrides, "environment": {"name": FAMILY}})
    )
    assert config.data.family == FAMILY and PretrainConfig(families=("add", FAMILY)).families == ("add", FAMILY)


def _trained_text(tokenizer, labels) -> str:
    return tokenizer.decode([t for t in labels.tolist() if t != -100], skip_special_tokens=True)


def test_pretraining_trains_the_calls_and_answers_never_the_tool_results():
    tokenizer = build_char_tokenizer()
    problems = [*eval_set(FAMILY, 30), *eval_set("add", 10)]
    clean = _supervised_batch(tokenizer, problems, 0.0, random.Random(0))
    for i, problem in enumerate(problems):
        row = clean["input_ids"][i][clean["attention_mask"][i].bool()].tolist()
        assert tokenizer.decode(row, skip_special_tokens=True) == problem.prompt + problem.solution
        trained = _trained_text(tokenizer, clean["labels"][i])
        if problem.family == FAMILY:
            result = problem.solution[problem.solution.index(RESULT_OPEN) : problem.solution.index(RESULT_CLOSE) + 9]
            assert trained == problem.solution.replace(result, "") and RESULT_OPEN not in trained
        else:
            assert trained == problem.solution
    noisy = _supervised_batch(tokenizer, problems, 1.0, random.Random(0))
    wrong = [i for i in range(len(problems)) if not clean["labels"][i].equal(noisy["labels"][i])]
    assert wrong == list(range(len(problems)))  # every noisy solution has a wrong digit somewhere


def test_noisy_demonstrations_go_wrong_in_the_call_or_the_answer():
    rng = random.Random(1)
    kinds = set()
    for problem in eval_set(FAMILY, 200):
        segments = target_segments(problem, rng, 0.5)
        assert [trained for _, trained in segments] == [True, False, True]
        text = "".join(text for text, _ in segments)
        if text != problem.solution:
            call_ok = segments[0][0] == problem.solution[: len(segments[0][0])]
            kinds.add("answer" if call_ok else "call")
    assert kinds == {"call", "answer"}


def test_held_out_evaluation_runs_each_problem_as_a_trajectory(tmp_path):
    model, tokenizer = load_model(agentic.memorised_model(tmp_path / "model"))
    engine = StopStrings(
        HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_batch_size=8, device=model.device),
        tokenizer,
    )
    problems = [Problem(p[0], p[1], agentic.transcript(p), FAMILY) for p in (agentic.ONE_CALL, agentic.TWO_CALLS)]

    def accuracy(max_turns: int, max_new_tokens: int = 400, factory=EnvironmentFactory(CALCULATOR)) -> float:
        return evaluate_accuracy(
            engine,
            tokenizer,
            problems,
            max_new_tokens=max_new_tokens,
            sampling=SamplingParams(greedy=True),
            environment=factory,
            max_turns=max_turns,
        )

    assert accuracy(max_turns=4) == 1.0  # each tool result is appended, then the answer follows
    assert accuracy(max_turns=2) == 0.5  # the two-call trajectory is cut before its answer
    assert accuracy(max_turns=4, max_new_tokens=40) == 0.0  # the budget ends the turns
    agentic.FAILURES.clear()
    broken = EnvironmentFactory("tests.infra.rollout.agentic:FailingCalculator", {"times": 9, "only": "eval-1-0"})
    assert accuracy(max_turns=2, factory=broken) == 1.0  # the failed trajectory is left out, not wrong
