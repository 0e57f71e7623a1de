"""The trainer's machine in the ledger, and a run against a measured reserved-only baseline run,
on a real database (SQLite; PostgreSQL when DATABASE_URL is set).

Two synthetic runs of the same workload (the demo configuration's, `run_workload`: 6000 trained
tokens in two steps), no training needed:

- baseline `base-1`: reserved only, the trainer's a2-highgpu-1g ($3.67/h) alone, two 1800 s steps,
  recorded through `RunAccounting` (the trainer is instance `trainer`, billed 0-3600 s);
- hybrid `hybrid-1`: the same trainer plus two spot instances ($1.10/h) for two 900 s steps.

By hand: baseline $3.67 for 6000 tokens, $611.67/M, 1.667 tokens/s; hybrid 1800 s of trainer
($1.835) + 2 x 1800 s of spot ($1.10) = $2.935, $489.17/M, 3.333 tokens/s; so 1.2504x tokens per
dollar and 2.00x throughput.
"""

from __future__ import annotations

import pytest

from infra.ledger.comparison import BaselineMismatch
from infra.ledger.config import TrainerMachine
from infra.ledger.recorder import Ledger
from infra.providers.interface import InstanceRecord
from infra.run.accounting import RunAccounting
from infra.run.config import load_config
from infra.run.workload import run_workload
from tests.infra.ledger.test_ledger import at

pytestmark = pytest.mark.integration

TRAINER = TrainerMachine(machine_type="a2-highgpu-1g", price_per_hour=3.67)
SPOT_PRICE = 1.10
SPOT_POOL = {
    "name": "spot",
    "capacity_class": "spot",
    "size": 2,
    "machine_type": "a2-highgpu-1g",
    "price_per_hour": 1.1,
}


def workload(spot: bool = False, **changes: object) -> dict:
    """The demo configuration's workload with the trainer's machine; `spot`: plus a spot pool of
    two; `changes`: dotted overrides of the configuration (another model, batch, ...)."""
    overrides = {"ledger.trainer": TRAINER.model_dump(mode="json"), "fabric.pools": [SPOT_POOL] if spot else []}
    return run_workload(load_config(None, {**overrides, **changes}), params=1_000_000)


class Clock:
    """Epoch seconds that a test sets."""

    def __init__(self) -> None:
        self.now = at(0)

    def __call__(self) -> float:
        return self.now


def record_baseline(ledger: Ledger, run_id: str = "base-1", recorded: dict | None = None) -> None:
    """A reserved-only run through `RunAccounting`: the trainer alone, two 1800 s steps of 3000
    tokens, running `recorded` (default: `workload()`)."""
    clock = Clock()
    accounting = RunAccounting(
        ledger, run_id, "grpo-demo", (), None, clock=clock, trainer=TRAINER, workload=recorded or workload()
    )
    for step in (1, 2):
        accounting.begin_step(step)
        clock.now += 1800
        accounting.end_step(step, tokens_trained=3000)
    accounting.finish()


def record_hybrid(ledger: Ledger, run_id: str = "hybrid-1", trainer: bool = True) -> None:
    """The same work with two spot instances beside the trainer: two 900 s steps, through the recorder API."""
    ledger.start_run(run_id, name="grpo-demo", started_at=at(0), workload=workload(spot=True))
    machines = [("spot-0", "spot", SPOT_PRICE, "rollout"), ("spot-1", "spot", SPOT_PRICE, "rollout")]
    if trainer:
        machines.append(("trainer", "reserved", TRAINER.price_per_hour, "trainer"))
    for instance_id, capacity_class, price, role in machines:
        record = InstanceRecord(
            instance_id, instance_id.split("-")[0], capacity_class, "a2-highgpu-1g", price, at(0),
            state="terminated", terminated_at=at(1800), reason="finished", exit_code=0,
        )  # fmt: skip
        ledger.record_instance(run_id, record, provider="local", role=role)
    for step in (1, 2):
        start = at(900 * (step - 1))
        ledger.record_step(run_id, step, started_at=start)
        for instance_id, *_ in machines:
            generated = 0 if instance_id == "trainer" else 1500
            ledger.record_usage(run_id, step, instance_id, seconds=900, tokens_generated=generated)
        ledger.record_step(run_id, step, started_at=start, ended_at=start + 900, tokens_trained=3000)
    ledger.finish_run(run_id, ended_at=at(1800))


def test_the_trainers_machine_is_recorded_with_its_seconds_and_cost(ledger):
    record_baseline(ledger)
    report = ledger.report("base-1")
    (trainer,) = report.instances
    assert (trainer.instance_id, trainer.role, trainer.capacity_class) == ("trainer", "trainer", "reserved")
    assert (trainer.billed_seconds, trainer.reason) == (3600, "finished")
    assert trainer.spend_usd == pytest.approx(3.67)
    assert [(s.instance_seconds, s.tokens_trained) for s in report.steps] == [(1800, 3000), (1800, 3000)]
    assert [s.trainer_usd for s in report.steps] == pytest.approx([3.67 / 2, 3.67 / 2])
    assert report.trainer_recorded and report.trainer_usd == pytest.approx(report.total_usd)
    assert report.spend("reserved") == pytest.approx(3.67) and report.unattributed_usd == pytest.approx(0)
    assert report.trained_tokens_per_s == pytest.approx(6000 / 3600)


def test_a_hybrid_run_against_its_measured_baseline(ledger):
    record_baseline(ledger)
    record_hybrid(ledger)
    comparison = ledger.compare("hybrid-1", "base-1")
    assert comparison.basis == "measured baseline run base-1 (grpo-demo)"
    assert (comparison.total_usd, comparison.baseline_total_usd) == (pytest.approx(2.935), pytest.approx(3.67))
    assert comparison.usd_per_million_trained == pytest.approx(2.935 / 6000 * 1e6)
    assert comparison.baseline_usd_per_million_trained == pytest.approx(3.67 / 6000 * 1e6)
    assert comparison.cost_efficiency == pytest.approx(3.67 / 2.935)  # 1.2504x trained tokens per dollar
    assert comparison.throughput_ratio == pytest.approx(2.0)


def test_a_baseline_that_is_not_reserved_only_or_a_run_without_its_trainer_is_refused(ledger):
    record_baseline(ledger)
    record_hybrid(ledger)
    record_hybrid(ledger, "hybrid-2", trainer=False)
    with pytest.raises(BaselineMismatch, match="baseline run hybrid-1 ran 2 spot instance.*reserved-only"):
        ledger.compare("hybrid-2", "hybrid-1")
    with pytest.raises(BaselineMismatch, match="run hybrid-2 did not record the trainer's machine.*ledger.trainer"):
        ledger.compare("hybrid-2", "base-1")
    with pytest.raises(BaselineMismatch, match="its own baseline"):
        ledger.compare("base-1", "base-1")


def test_the_run_summary_names_its_baseline_or_why_it_was_not_compared(ledger):
    record_baseline(ledger)
    clock = Clock()
    accounting = RunAccounting(
        ledger, "hybrid-3", "grpo-demo", (), None, clock=clock, trainer=TRAINER, workload=workload(spot=True)
    )
    accounting.begin_step(1)
    clock.now += 900
    accounting.end_step(1, tokens_trained=3000)
    accounting.finish()  # (its heartbeat thread would outlive the test's database)
    summary = accounting.baseline_summary("base-1")
    assert summary == {
        "vs_baseline": "measured baseline run base-1 (grpo-demo)",
        "cost_efficiency_vs_baseline": pytest.approx((3.67 / 6000) / (3.67 / 4 / 3000)),  # 2.0
        "throughput_vs_baseline": pytest.approx(2.0),
    }
    assert accounting.baseline_summary("nope")["vs_baseline"].startswith("not compared: no run 'nope'")


def test_a_baseline_of_another_workload_is_refused_naming_each_differing_field(ledger):
    record_hybrid(ledger)
    record_baseline(ledger, "other-1", workload(**{"model.path": "models/other", "rollout.group_size": 4}))
    with pytest.raises(BaselineMismatch) as refused:
        ledger.compare("hybrid-1", "other-1")
    message = str(refused.value)
    assert "\n" not in message and "baseline run other-1 did not run run hybrid-1's workload" in message
    assert "model.path (run: '.rlboost/base-model', baseline: 'models/other')" in message
    assert "batch.group_size (run: 8, baseline: 4)" in message
    assert "batch.prompts_per_step" not in message and "pools.spot" not in message


def test_a_lora_baseline_is_refused_for_a_full_run_and_an_older_full_one_is_not(ledger):
    """Training adapters is another workload than training every weight; a baseline recorded before
    workloads named LoRA (no `lora` section) trained every weight, so it still compares."""
    record_hybrid(ledger)
    older = workload()
    del older["lora"]
    record_baseline(ledger, "base-1", older)
    assert ledger.compare("hybrid-1", "base-1").cost_efficiency > 0
    record_baseline(ledger, "lora-1", workload(**{"model.lora": {"r": 8, "target_modules": ["q_proj"]}}))
    with pytest.raises(BaselineMismatch) as refused:
        ledger.compare("hybrid-1", "lora-1")
    assert "lora.r (run: 'absent', baseline: 8)" in str(refused.value)
    assert "lora.target_modules (run: 'absent', baseline: ['q_proj'])" in str(refused.value)


def test_pools_must_match_apart_from_spot_and_the_workload_must_be_recorded(ledger):
    record_hybrid(ledger)
    other_spot = {**SPOT_POOL, "size": 5, "price_per_hour": 0.9}
    recorded = workload(**{"fabric.pools": [other_spot]})  # its spot pool is not compared, nor the measured
    recorded["data"]["mean_prompt_tokens"] = 12.5  # prompt length (it depends on how many prompts it evaluates)
    record_baseline(ledger, "base-1", recorded)
    assert ledger.compare("hybrid-1", "base-1").cost_efficiency > 0
    ondemand = {
        "name": "od",
        "capacity_class": "ondemand",
        "size": 1,
        "machine_type": "a2-highgpu-1g",
        "price_per_hour": 3.67,
    }
    record_baseline(ledger, "base-2", workload(**{"fabric.pools": [ondemand], "ledger.trainer.price_per_hour": 2.0}))
    with pytest.raises(BaselineMismatch) as refused:
        ledger.compare("hybrid-1", "base-2")
    assert "trainer.machine.price_per_hour (run: 3.67, baseline: 2.0)" in str(refused.value)
    assert "pools.od.capacity_class (run: 'absent', baseline: 'ondemand')" in str(refused.value)
    ledger.start_run("unrecorded", name="grpo-demo", started_at=at(0))
    with pytest.raises(BaselineMismatch, match="baseline run unrecorded recorded no workload.*migration 0004"):
        ledger.compare("hybrid-1", "unrecorded")


def test_a_deepspeed_baseline_of_a_torch_trainer_run_is_refused_naming_each_trainer_field(ledger):
    record_hybrid(ledger)  # the demo's trainer: torch, one process
    deepspeed = {"trainer.backend": "deepspeed", "trainer.world_size": 2, "trainer.zero_stage": 3}
    record_baseline(ledger, "ds-1", workload(**deepspeed))
    with pytest.raises(BaselineMismatch) as refused:
        ledger.compare("hybrid-1", "ds-1")
    message = str(refused.value)
    assert "\n" not in message and "baseline run ds-1 did not run run hybrid-1's workload" in message
    assert "trainer.backend (run: 'torch', baseline: 'deepspeed')" in message
    assert "trainer.world_size (run: 1, baseline: 2)" in message
    assert "trainer.zero_stage (run: None, baseline: 3)" in message
    assert "trainer.nodes" not in message and "optim." not in message


def test_optimizer_and_grpo_settings_must_match_and_an_identical_trainer_compares(ledger):
    record_hybrid(ledger)
    record_baseline(ledger, "tuned-1", workload(**{"optim.lr": 1e-5, "grpo.kl_coef": 0.05, "optim.betas": [0.9, 0.95]}))
    with pytest.raises(BaselineMismatch) as refused:
        ledger.compare("hybrid-1", "tuned-1")
    message = str(refused.value)
    assert "optim.lr (run: 0.00025, baseline: 1e-05)" in message
    assert "optim.betas (run: [0.9, 0.99], baseline: [0.9, 0.95])" in message
    assert "grpo.kl_coef (run: 0.0, baseline: 0.05)" in message
    record_baseline(ledger, "same-1", workload(**{"trainer.zero_stage": 3}))  # no effect on the torch trainer
    assert ledger.compare("hybrid-1", "same-1").cost_efficiency == pytest.approx(3.67 / 2.935)


def test_a_baseline_recorded_before_the_trainers_configuration_is_refused_in_one_line(ledger):
    """A workload recorded before `trainer`, `optim` and `grpo` said how the run trained (its
    `trainer` section was the machine alone) cannot show that both runs trained alike."""
    record_hybrid(ledger)
    older = workload()
    older["trainer"] = older["trainer"]["machine"]
    del older["optim"], older["grpo"]
    record_baseline(ledger, "old-1", older)
    with pytest.raises(BaselineMismatch) as refused:
        ledger.compare("hybrid-1", "old-1")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("baseline run old-1 recorded its workload before the trainer's configuration")
    assert ledger.report("old-1").workload == older  # still readable as recorded
