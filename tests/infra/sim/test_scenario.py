"""Scenario files: the shipped ones load; bad ones fail naming the file, the line, the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.rollout.worker import STEAL_HOLDOFF_S
from infra.run.config import ConfigError
from infra.sim.scenario import RunSection, load_scenario, parse_scenario, prices_per_hour
from tests.helpers import REPO_ROOT

SHIPPED = sorted((REPO_ROOT / "deployments" / "sim").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_scenarios_load_and_are_priced(path: Path):
    scenario = load_scenario(path)
    reserved, spot, spot_ondemand = prices_per_hour(scenario)
    assert reserved > 0 and 0 < spot < spot_ondemand


def test_paper_scenario_uses_the_artifacts_prices():
    assert prices_per_hour(load_scenario(REPO_ROOT / "deployments" / "sim" / "paper.yaml"))[:2] == (83.79, 5.32)


def test_catalog_prices_follow_the_date():
    late_2025 = parse_scenario("run:\n  prices_at: 2025-10-10T00:00:00Z\navailability:\n  source: constant\n")
    mid_2026 = parse_scenario("run:\n  prices_at: 2026-07-20T00:00:00Z\navailability:\n  source: constant\n")
    assert prices_per_hour(late_2025)[1] < prices_per_hour(mid_2026)[1]  # GCP H100 spot climbed in 2026


def errors(text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_scenario(text, "s.yaml")
    return str(caught.value)


def test_unknown_gpu_type_names_file_line_field_and_fix():
    message = errors("availability:\n  source: constant\nspot:\n  gpus: 2\n  gpu: H200\n")
    assert "s.yaml:5: spot.gpu: unknown GPU type 'H200'" in message and "Fix: use one of those" in message
    assert "H100" in message


def test_missing_trace_names_the_field_and_the_fix():
    message = errors("availability:\n  source: trace\n  trace: skynomad/h100/mars-1a\n")
    assert "s.yaml:3: availability.trace:" in message and "no rows for zone 'mars-1a'" in message
    assert "Fix: name a shipped trace" in message
    message = errors("availability:\n  trace: nowhere/at-all\n")
    assert "s.yaml:2: availability.trace: unknown trace 'nowhere/at-all'" in message
    assert "s.yaml: availability.trace: source is trace but no trace is named" in errors("name: x\n")


def test_negative_rates_and_unknown_keys_are_refused_with_the_fields_meaning():
    message = errors("workload:\n  mean_response_tokens: -3\nnetwork:\n  trainer_gbps: 0\n  bogus: 1\n")
    assert "s.yaml:2: workload.mean_response_tokens: Input should be greater than 0 (got -3)" in message
    assert "Fix: give a value that satisfies this; the field: Mean of the log-normal" in message
    assert "s.yaml:4: network.trainer_gbps" in message
    assert "s.yaml:5: network.bogus: unknown key" in message


def test_bad_tensor_parallel_and_artifact_budget_fields_name_the_field():
    text = errors(
        "decode:\n  allreduce_latency_us: -1\n  allreduce_efficiency: 1.5\n"
        "paper_offload:\n  budgets_s: {0: 100, 2: -5}\n"
    )
    assert "s.yaml:2: decode.allreduce_latency_us" in text and "greater than or equal to 0" in text
    assert "s.yaml:3: decode.allreduce_efficiency" in text and "NVLink" in text  # the field's meaning
    assert "paper_offload.budgets_s.0.[key]" in text and "paper_offload.budgets_s.2" in text


def test_unpriced_machine_type_says_to_set_a_price():
    message = errors("availability:\n  source: constant\nspot:\n  provider: aws\n  machine_type: p5.48xlarge\n")
    assert "spot.price_per_hour: no spot price for machine type 'p5.48xlarge'" in message
    assert "(or set spot.price_per_hour)" in message


def test_engine_split_and_yaml_syntax():
    assert "reserved.engine_gpus" in errors(
        "availability:\n  source: constant\nreserved:\n  gpus: 8\n  engine_gpus: 3\n"
    )
    assert "s.yaml:3: not valid YAML" in errors("a: [\nb: 1\n")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: cannot read"):
        load_scenario(tmp_path / "nope.yaml")


def test_steal_holdoff_is_the_workers():
    assert RunSection().steal_holdoff_s == STEAL_HOLDOFF_S


def test_engines_too_small_for_the_model_or_one_sample_name_the_field_and_the_fix():
    message = errors("availability:\n  source: constant\nmodel:\n  params_b: 70\nspot:\n  gpus: 1\n")
    assert "s.yaml:6: spot.gpus: 1 x H100 at memory_utilization 0.85 hold 68.0 GB" in message
    assert "less than the model's 140.0 GB of weights. Fix: raise spot.gpus" in message
    assert "s.yaml: reserved.engine_gpus: 1 x H100" in message
    message = errors(
        "availability:\n  source: constant\nworkload:\n  max_response_tokens: 40000\nspot:\n  gpu: L4\n  gpus: 1\n"
    )
    assert "s.yaml:7: spot.gpus: the KV cache of 1 x L4 holds 27,127 tokens, fewer than one sample's 40,512" in message
    assert "lower workload.max_response_tokens" in message and "reserved" not in message
