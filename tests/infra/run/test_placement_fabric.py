"""GPU placement through the run: the paper's reserved side (four tensor-parallel-2 engines
beside the trainer on a declared 8-GPU node) as real instance processes of a `RolloutFabric`,
each started with its own pair of GPUs and a TP-2 engine spec; and an over-subscribed node
refused by `rlboost train` with one line and exit 2 before anything starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infra.cli.app import app
from infra.run.config import load_config
from infra.run.fabric_config import FabricConfig
from infra.run.preflight import PreflightError, preflight
from rl.engine_spec import EngineSpec
from tests.helpers import as_set_flags, rollout_fabric, save_tiny_model, spot_pool, wait_for

RESERVED_TP2 = {
    "name": "reserved",
    "capacity_class": "reserved",
    "size": 4,
    "machine_type": "a3-highgpu-8g",
    "price_per_hour": 12.0,
    "gpus_per_instance": 2,
}


def instance_processes() -> dict[str, tuple[dict[str, str], list[str]]]:
    """This process's children that are rollout instances: (environment, command line) by instance id."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != os.getpid():
                continue
            pairs = (entry / "environ").read_bytes().split(b"\0")
            argv = [arg.decode() for arg in (entry / "cmdline").read_bytes().split(b"\0") if arg]
        except (FileNotFoundError, ProcessLookupError):
            continue
        env = dict(pair.decode().split("=", 1) for pair in pairs if b"=" in pair)
        if "RLBOOST_INSTANCE_ID" in env:
            found[env["RLBOOST_INSTANCE_ID"]] = (env, argv)
    return found


@pytest.mark.integration
def test_four_tp2_engines_start_on_disjoint_gpus_of_an_8_gpu_node(tmp_path):
    model = save_tiny_model(tmp_path / "model")
    config = FabricConfig.model_validate({"enabled": True, "node_gpus": 8, "pools": [RESERVED_TP2]})
    engine = EngineSpec(kind="vllm", device="auto", dtype="bf16")
    fabric = rollout_fabric(config, "placed", tmp_path / "run", model, engine)
    started: dict[str, tuple[dict[str, str], list[str]]] = {}

    def all_four_seen() -> bool:  # (a child's environment is readable from its exec until it exits)
        started.update(instance_processes())
        return len(started) == 4

    try:
        wait_for(all_four_seen, "the four instances' processes", timeout_s=60)
    finally:
        fabric.close()
    assert sorted(started) == [f"reserved-{n}" for n in range(4)]
    devices = {name: env["CUDA_VISIBLE_DEVICES"] for name, (env, _) in started.items()}
    assert devices == {"reserved-0": "0,1", "reserved-1": "2,3", "reserved-2": "4,5", "reserved-3": "6,7"}
    for _, argv in started.values():
        spec = EngineSpec.model_validate_json(argv[argv.index("--engine") + 1])
        assert (spec.kind, spec.vllm.tensor_parallel_size) == ("vllm", 2)
    assert not instance_processes(), "closing the fabric stops every instance"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_an_oversubscribed_node_stops_rlboost_train_with_one_line_and_exit_2(model_dir, tmp_path):
    spot = spot_pool(1, gpus_per_instance=0.5)
    overrides = {
        "model.path": str(model_dir),
        "run.output_dir": str(tmp_path / "runs"),
        "fabric.enabled": True,
        "fabric.node_gpus": 8,
        "fabric.pools": [{**RESERVED_TP2, "engine": "vllm"}, spot],
    }
    result = CliRunner().invoke(app, ["train", *as_set_flags(overrides)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines[0] == "cannot start the run" and len(lines) == 2, result.output
    assert lines[1].startswith("fabric.pools[1] (spot).gpus_per_instance: 1 instances of 0.5 GPUs each do not fit")
    assert "Traceback" not in result.output
    assert not (tmp_path / "runs").exists(), "nothing started"


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        (
            {**RESERVED_TP2, "engine": "hf"},
            r"fabric.pools\[0\] \(reserved\).gpus_per_instance: the hf engine runs on one",
        ),
        (
            {**RESERVED_TP2, "gpus_per_instance": 1, "device": "cuda:1"},
            r"fabric.pools\[0\] \(reserved\).device: cuda:1 names a GPU, .* set the device to cuda or auto",
        ),
    ],
)
def test_a_placed_pool_whose_engine_would_ignore_its_gpus_is_refused(model_dir, pool, message):
    overrides = {"model.path": str(model_dir), "fabric.enabled": True, "fabric.node_gpus": 8, "fabric.pools": [pool]}
    with pytest.raises(PreflightError, match=message):
        preflight(load_config(None, overrides))
