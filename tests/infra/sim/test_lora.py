"""LoRA in the simulator (`model.lora`): the trainer skips the base weights' gradients, a version is
the adapters' bytes (a booted instance still pulls the base once), and without the section nothing
changes (the numbers pinned in test_async.py's `TODAY` run without it)."""

from __future__ import annotations

import pytest

from infra.run.config import ConfigError
from infra.sim.runner import measure
from infra.sim.scenario import LoraSection, load_scenario, parse_scenario
from infra.sim.simulator import cluster_train_seconds
from tests.helpers import REPO_ROOT
from tests.infra.sim.test_simulator import MEASURED, run, small

LORA = {"lora": {"trainable_fraction": 0.01}}
ONE_VERSION = 8.2e9 * 2 * 0.01
"""The adapters of the small scenario's model (Qwen3-8B's 8.2B parameters, bf16) at 1%."""


def test_the_default_fraction_is_r16_on_every_linear_layer_of_qwen3_8b():
    per_layer = 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 12288))  # q o, k v, gate up down
    assert LoraSection().trainable_fraction == pytest.approx(36 * per_layer / 8.19e9, rel=0.01)
    assert LoraSection().bytes(8.2, 2) == pytest.approx(0.0053 * 8.2e9 * 2)
    assert LoraSection(adapter_bytes=5e7).bytes(8.2, 2) == 5e7


@pytest.mark.parametrize("recompute", [True, False])
def test_lora_trains_at_the_documented_flops(recompute):
    """`flops_per_param - 2 (1 - f)`: 12 -> 10.02 with the old-log-prob forward, 10 -> 8.02 without."""
    full, lora = small(training={"flops_per_param": 12}), small(training={"flops_per_param": 12}, model=LORA)
    flops = 12 - (0 if recompute else 2)
    ratio = (flops - 2 * (1 - 0.01)) / flops
    assert lora.train_flops_per_param(recompute) == pytest.approx(flops - 1.98)
    full_s = cluster_train_seconds(full, 1e6, 8, recompute)
    assert cluster_train_seconds(lora, 1e6, 8, recompute) == pytest.approx(full_s * ratio)


def test_lora_lowers_each_steps_training_time_by_that_ratio_and_nothing_else():
    """On-demand alone: the same samples step by step (generated within the polls' timing),
    training at (8 - 1.98) / 8 of the time."""
    full, lora = run(small(), "ondemand"), run(small(model=LORA), "ondemand")
    assert len(lora.steps) > len(full.steps) > 5
    for a, b in zip(full.steps, lora.steps):
        assert b.trained_tokens == a.trained_tokens and b.rollout_s == pytest.approx(
            a.rollout_s, rel=0.01
        )  # polls fall elsewhere
        assert b.train_s == pytest.approx(a.train_s * (8 - 1.98) / 8)


def test_a_measured_profile_times_the_trainer_as_configured():
    with_lora, full = small(measured=MEASURED, model=LORA), small(measured=MEASURED)
    assert cluster_train_seconds(with_lora, 1e4, 2, False) == cluster_train_seconds(full, 1e4, 2, False)


def test_every_version_pulled_is_the_adapters_and_a_booted_instance_pulls_the_base_once():
    weights = small().model.shape().weight_bytes
    full, lora = run(small()), run(small(model=LORA))
    assert {nbytes for _, nbytes in full.pulls} == {weights}
    updates = [nbytes for _, nbytes in lora.pulls if nbytes < weights]
    firsts = [nbytes for _, nbytes in lora.pulls if nbytes >= weights]
    assert updates and updates == pytest.approx([ONE_VERSION] * len(updates))
    assert firsts and firsts == pytest.approx([weights + ONE_VERSION] * len(firsts))
    assert len(firsts) <= len(lora.spot_intervals)  # one base pull per instance booted
    given = run(small(model={"lora": {"trainable_fraction": 0.01, "adapter_bytes": 4e7}}))
    assert {nbytes for _, nbytes in given.pulls if nbytes < weights} == {4e7}


def test_the_egress_of_the_pulls_follows_the_adapter_bytes():
    network = {"egress_usd_per_gb": 0.02}
    full, lora = run(small(network=network)), run(small(network=network, model=LORA))
    cost = {name: measure(result, 0, None) for name, result in (("full", full), ("lora", lora))}
    for name, result in (("full", full), ("lora", lora)):
        assert cost[name].egress_usd == pytest.approx(sum(b for _, b in result.pulls) / 1e9 * 0.02)
    assert 0 < cost["lora"].egress_usd_per_step < cost["full"].egress_usd_per_step


def errors(text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_scenario(text, "s.yaml")
    return str(caught.value)


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5])
def test_a_fraction_outside_0_to_1_names_the_file_line_and_field(fraction):
    message = errors(f"availability:\n  source: constant\nmodel:\n  lora:\n    trainable_fraction: {fraction}\n")
    assert "s.yaml:5: model.lora.trainable_fraction: Input should be" in message
    assert f"(got {fraction})" in message and "Fix: give a value that satisfies this" in message
    assert "Adapter parameters over the model's parameters" in message  # the field's meaning


def test_other_bad_lora_input_names_the_field_and_the_fix():
    message = errors("availability:\n  source: constant\nmodel:\n  lora:\n    adapter_bytes: 2.0e+10\n")
    assert "s.yaml:5: model.lora.adapter_bytes: 20,000,000,000 bytes is not smaller than the model's" in message
    assert "Fix: give the adapter's bytes, or leave it out" in message
    message = errors("availability:\n  source: constant\nmodel:\n  lora: {r: 16}\n")
    assert "s.yaml:4: model.lora.r: unknown key" in message
    message = errors(
        "availability:\n  source: constant\nmodel:\n  lora: {}\ntraining:\n  flops_per_param: 4\n"
        "  weight_gradient_flops_per_param: 2\n"
    )
    assert "s.yaml:7: training.weight_gradient_flops_per_param: 2 plus training.old_logprob_flops_per_param" in message
    assert "Fix: lower it" in message
    # without LoRA the same split is never used, so it is not checked
    parse_scenario("availability:\n  source: constant\ntraining:\n  flops_per_param: 4\n")


def test_the_paper_lora_scenario_is_the_paper_scenario_with_lora():
    paper = load_scenario(REPO_ROOT / "deployments" / "sim" / "paper.yaml")
    lora = load_scenario(REPO_ROOT / "deployments" / "sim" / "paper-lora.yaml")
    assert lora.model.lora is not None and paper.model.lora is None
    assert lora.model_copy(update={"model": paper.model, "name": paper.name}) == paper
    assert lora.model.version_bytes() < 0.01 * paper.model.version_bytes()
