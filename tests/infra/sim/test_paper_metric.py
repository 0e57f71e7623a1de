"""The paper-table check compares like with like: the simulator's trained tokens/s is the RLBoost
artifact's `perf/throughput_all_gpus` as docs/CALIBRATION.md defines it (the step's prompt and
response tokens over the step's wall time), and the paper scenario's sequences are as long, on
average, as the artifact's MINIMUM.md run counted."""

from __future__ import annotations

import math
import re
from statistics import NormalDist

import pytest

from infra.sim.runner import measure, throughput_between
from infra.sim.scenario import load_scenario
from tests.helpers import REPO_ROOT
from tests.infra.sim.test_simulator import run, small

CALIBRATION = (REPO_ROOT / "docs" / "CALIBRATION.md").read_text()


def test_tokens_per_second_is_prompt_plus_response_tokens_over_step_time():
    result = run(small(run={"max_steps": 3, "duration_s": 10_000}), "ondemand")
    metrics = measure(result, 0, None)
    wall = result.steps[-1].ended_at - result.steps[0].started_at
    prompt_and_response = 64 * result.samples_total + result.trained_response_tokens
    assert len(result.steps) == 3
    assert metrics.tokens_per_s == pytest.approx(prompt_and_response / wall)
    responses_only = run(small(run={"max_steps": 3, "duration_s": 10_000}, training={"count_prompt_tokens": False}))
    assert measure(responses_only, 0, None).trained_tokens == pytest.approx(responses_only.trained_response_tokens)


def test_a_window_of_a_run_counts_the_steps_inside_it():
    result = run(small(run={"max_steps": 4, "duration_s": 10_000}), "ondemand")
    a, b = result.steps[1], result.steps[2]
    inside = (a.trained_tokens + b.trained_tokens) / ((a.ended_at - a.started_at) + (b.ended_at - b.started_at))
    assert throughput_between(result, a.started_at, b.ended_at) == pytest.approx(inside)
    assert throughput_between(result, a.started_at - 0.1, b.ended_at + 0.1) == pytest.approx(inside)
    with pytest.raises(ValueError, match="no step ran entirely within"):
        throughput_between(result, a.started_at + 0.1, a.ended_at)


def test_the_docs_define_the_artifacts_figure_as_prompt_plus_response():
    assert "sum of the step's attention masks (every prompt token" in CALIBRATION
    assert "perf/throughput_all_gpus = perf/throughput x 8" in CALIBRATION
    for name in ("paper.yaml", "skynomad.yaml"):
        assert load_scenario(REPO_ROOT / "deployments" / "sim" / name).training.count_prompt_tokens, name


def truncated_lognormal_mean(mean: float, cv: float, cap: float) -> float:
    """E[min(X, cap)] for a log-normal X of this mean and coefficient of variation."""
    sigma = math.sqrt(math.log(1 + cv * cv))
    z = (math.log(cap) - (math.log(mean) - sigma * sigma / 2)) / sigma
    normal = NormalDist()
    return mean * normal.cdf(z - sigma) + cap * (1 - normal.cdf(z))


def test_paper_scenario_sequences_are_as_long_as_the_artifact_counted():
    found = re.search(r"`perf/total_num_tokens` ([\d,]+)", CALIBRATION)
    shape = re.search(r"MINIMUM\.md \(Qwen3-1\.7B, (\d+) prompts x (\d+) responses", CALIBRATION)
    assert found and shape
    per_sequence = int(found.group(1).replace(",", "")) / (int(shape.group(1)) * int(shape.group(2)))
    workload = load_scenario(REPO_ROOT / "deployments" / "sim" / "paper.yaml").workload
    response = truncated_lognormal_mean(
        workload.mean_response_tokens, workload.response_cv, workload.max_response_tokens
    )
    assert workload.prompt_tokens <= 512  # the artifact's data.max_prompt_length
    assert workload.prompt_tokens + response == pytest.approx(per_sequence, rel=0.01)
