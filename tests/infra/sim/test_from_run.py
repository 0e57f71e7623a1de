"""`rlboost cost --predict`: a recorded run mapped to a simulator scenario (`infra.sim.from_run`),
run, and shown beside what the ledger measured; runs that cannot be mapped exit 2 with one line.

The run (a real SQLite ledger, its workload from `run_workload` on a configuration): a Qwen3-8B
shape (its `config.json`) in bf16 trained on an a3-highgpu-8g ($88/h) with a spot pool of four
a3-highgpu-2g ($7/h), 32 prompts x 8 samples, 4096-token budget; three 300 s steps of 384,000
trained tokens each (a mean response of 1500 tokens), two spot instances up.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from infra.cli.app import app
from infra.ledger.recorder import Ledger
from infra.providers.interface import InstanceRecord
from infra.run.config import load_config
from infra.run.workload import run_workload
from infra.sim.from_run import Unmappable, scenario_of
from tests.infra.ledger.test_ledger import RUN_ID, at, record_small_run

QWEN3_8B = {
    "model_type": "qwen3",
    "num_hidden_layers": 36,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
SPOT_POOL = {
    "name": "spot",
    "capacity_class": "spot",
    "size": 4,
    "machine_type": "a3-highgpu-2g",
    "price_per_hour": 7.0,
}
WIDE = {"COLUMNS": "200"}


def workload(model_dir, prompt_tokens: float | None = None, **changes) -> dict:
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(QWEN3_8B))
    overrides = {
        "model.path": str(model_dir),
        "model.dtype": "bf16",
        "rollout.prompts_per_step": 32,
        "rollout.group_size": 8,
        "rollout.max_new_tokens": 4096,
        "ledger.trainer": {"machine_type": "a3-highgpu-8g", "price_per_hour": 88.0},
        "fabric.pools": [SPOT_POOL],
    }
    return run_workload(load_config(None, {**overrides, **changes}), 8_190_735_360, prompt_tokens)


def record_run(
    ledger: Ledger,
    recorded: dict,
    run_id: str = "qwen-1",
    trainer_type: str = "a3-highgpu-8g",
    spot_ready: tuple[float, ...] = (),
) -> None:
    ledger.start_run(run_id, name="qwen", started_at=at(0), workload=recorded)
    machines = [("trainer", "reserved", 88.0, "trainer", trainer_type)]
    machines += [(f"spot-{i}", "spot", 7.0, "rollout", "a3-highgpu-2g") for i in range(2)]
    ready_at = {f"spot-{i}": at(seconds) for i, seconds in enumerate(spot_ready)}
    for instance_id, capacity_class, price, role, machine_type in machines:
        record = InstanceRecord(instance_id, instance_id.split("-")[0], capacity_class, machine_type, price, at(0))
        ended = replace(record, state="terminated", terminated_at=at(1000), reason="finished")
        ledger.record_instance(run_id, ended, provider="local", role=role, ready_at=ready_at.get(instance_id))
    for step in (1, 2, 3):
        start = 100 + 300 * (step - 1)
        ledger.record_step(run_id, step, started_at=at(start))
        for instance_id, *_ in machines:
            ledger.record_usage(run_id, step, instance_id, seconds=300, tokens_generated=128_000)
        ledger.record_step(run_id, step, started_at=at(start), ended_at=at(start + 300), tokens_trained=384_000)
    ledger.finish_run(run_id, ended_at=at(1000))


@pytest.fixture
def url(tmp_path):
    return f"sqlite:///{tmp_path / 'ledger.sqlite'}"


def test_predicts_the_recorded_run_beside_its_measured_figures(url, tmp_path):
    with Ledger(url) as ledger:
        record_run(ledger, workload(tmp_path / "qwen", prompt_tokens=300.4))
    json_path = tmp_path / "cost.json"
    result = CliRunner().invoke(
        app, ["cost", "--run", "qwen-1", "--db", url, "--predict", "--json", str(json_path)], env=WIDE
    )
    assert result.exit_code == 0, result.output
    assert "measured by the ledger vs predicted by the simulator" in result.output
    rows = {line.split("│")[1].strip(): line for line in result.output.splitlines() if line.count("│") >= 4}
    # measured: 3 steps of (300 s x $88/h + 2 x 300 s x $7/h) = $8.50 each
    assert "8.5000" in rows["cost per step $"] and "25.5000" in rows["total $ of the steps"]
    assert "not simulated" in rows["total $ of the run (with what no step holds)"]
    prediction = json.loads(json_path.read_text())["prediction"]
    figures = {f["what"]: f for f in prediction["figures"]}
    assert figures["steps"] == {"what": "steps", "measured": 3, "predicted": 3}
    assert figures["cost per step $"]["measured"] == pytest.approx(8.5)
    predicted_total = figures["total $ of the steps"]["predicted"]
    assert predicted_total > 0 and figures["cost per step $"]["predicted"] == pytest.approx(predicted_total / 3)
    assert 0 < figures["spot share of the steps' $"]["predicted"] < 1
    assert figures["trained tokens per $ (steps)"]["measured"] == pytest.approx(3 * 384_000 / 25.5)
    scenario = prediction["scenario"]
    assert scenario["workload"]["mean_response_tokens"] == pytest.approx(1500)
    assert scenario["workload"]["prompt_tokens"] == 300
    assert (scenario["reserved"]["gpu"], scenario["reserved"]["gpus"], scenario["reserved"]["price_per_hour"]) == (
        "H100",
        8,
        88.0,
    )
    assert (scenario["spot"]["max_instances"], scenario["spot"]["gpus"], scenario["spot"]["price_per_hour"]) == (
        4,
        2,
        7.0,
    )
    assert scenario["model"]["params_b"] == pytest.approx(8.19073536) and scenario["model"]["kv_heads"] == 8
    origins = {s["figure"]: s["origin"] for s in prediction["sources"]}
    assert origins["mean response"] == "measured" and origins["batch"] == origins["prompt tokens"] == "recorded"
    assert origins["speeds"] == origins["spot capacity"] == origins["response spread"] == "assumed"
    assert origins["spot boot"] == "assumed" and scenario["spot"]["boot_s"] == 180  # no ready times recorded
    assert "recorded" in result.output and "assumed" in result.output


def test_a_workload_recorded_before_the_trainers_configuration_maps_alike(url, tmp_path):
    """An older row's `trainer` section is the trainer's machine itself (no backend, no `optim` or
    `grpo`): it stays readable, and maps to the same scenario."""
    recorded = workload(tmp_path / "qwen", prompt_tokens=300.4)
    older = {**recorded, "trainer": recorded["trainer"]["machine"]}
    del older["optim"], older["grpo"]
    with Ledger(url) as ledger:
        record_run(ledger, recorded)
        record_run(ledger, older, "qwen-old")
        new, old = (scenario_of(ledger.report(run_id))[0] for run_id in ("qwen-1", "qwen-old"))
    assert old.reserved.price_per_hour == 88.0
    assert old.model_dump(exclude={"name"}) == new.model_dump(exclude={"name"})


def test_a_pools_own_availability_drives_the_spot_capacity(url, tmp_path):
    poisson = {**SPOT_POOL, "availability": {"poisson": {"mean_life_s": 60.0, "mean_gap_s": 5.0, "seed": 1}}}
    with Ledger(url) as ledger:
        record_run(ledger, workload(tmp_path / "qwen", **{"fabric.pools": [poisson]}))
        report = ledger.report("qwen-1")
    scenario, schedule, sources = scenario_of(report)
    assert any(s.figure == "spot capacity" and "poisson" in s.value and s.origin == "recorded" for s in sources)
    assert schedule.events_between(0.0, 600.0)  # the Poisson lifetimes preempt, unlike the constant default
    assert any(s.figure == "prompt tokens" and s.origin == "assumed" for s in sources)  # none recorded: 512
    assert scenario.workload.prompt_tokens == 512
    assert scenario.run.max_steps == 3


def test_the_runs_measured_spot_boot_replaces_the_assumed_one(url, tmp_path):
    with Ledger(url) as ledger:
        record_run(ledger, workload(tmp_path / "qwen"), spot_ready=(40.0, 80.0))
        report = ledger.report("qwen-1")
    scenario, _, sources = scenario_of(report)
    assert scenario.spot.boot_s == pytest.approx(60.0)
    boot = next(s for s in sources if s.figure == "spot boot")
    assert boot.origin == "measured" and "60.0 s" in boot.value and "2 boots" in boot.value


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("no workload", f"cannot predict run {RUN_ID}: run {RUN_ID} recorded no workload"),
        ("unknown machine", "the trainer's machine is machine type 'cpu-laptop', which the simulator cannot model"),
        ("reserved rollout pool", "pool(s) extra generate on reserved or on-demand machines apart from the trainer's"),
    ],
)
def test_a_run_that_cannot_be_mapped_exits_2_with_one_line(url, tmp_path, case, expected):
    with Ledger(url) as ledger:
        record_small_run(ledger)
        if case == "unknown machine":
            trainer = {"machine_type": "cpu-laptop", "price_per_hour": 88.0}
            record_run(ledger, workload(tmp_path / "qwen", **{"ledger.trainer": trainer}), RUN_ID + "-x", "cpu-laptop")
        if case == "reserved rollout pool":
            extra = {
                "name": "extra",
                "capacity_class": "reserved",
                "size": 1,
                "machine_type": "a3-highgpu-1g",
                "price_per_hour": 11.0,
            }
            record_run(ledger, workload(tmp_path / "qwen", **{"fabric.pools": [SPOT_POOL, extra]}), RUN_ID + "-x")
    run = RUN_ID if case == "no workload" else RUN_ID + "-x"
    result = CliRunner().invoke(app, ["cost", "--run", run, "--db", url, "--predict"], env=WIDE)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "cost per step of run" not in result.output
    (line,) = [line for line in result.output.splitlines() if "cannot predict" in line]
    assert expected in line
    with Ledger(url) as ledger, pytest.raises(Unmappable):
        scenario_of(ledger.report(run))


def test_a_lora_run_is_predicted_with_its_recorded_adapters(url, tmp_path):
    from infra.run.workload import AdapterSize

    model_dir = tmp_path / "qwen"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(QWEN3_8B))
    overrides = {
        "model.path": str(model_dir),
        "model.lora": {"r": 16},
        "rollout.max_new_tokens": 4096,
        "ledger.trainer": {"machine_type": "a3-highgpu-8g", "price_per_hour": 88.0},
        "fabric.pools": [SPOT_POOL],
    }
    adapter = AdapterSize(parameters=43_646_976, nbytes=87_293_952)
    recorded = run_workload(load_config(None, overrides), 8_190_735_360, 300.0, adapter)
    with Ledger(url) as ledger:
        record_run(ledger, recorded)
        scenario, _, sources = scenario_of(ledger.report("qwen-1"))
    assert scenario.model.lora is not None
    assert scenario.model.lora.trainable_fraction == pytest.approx(43_646_976 / 8_190_735_360)
    assert scenario.model.lora.adapter_bytes == 87_293_952
    assert any(s.figure == "LoRA adapters" and s.origin == "recorded" for s in sources)
