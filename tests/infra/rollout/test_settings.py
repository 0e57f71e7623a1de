"""Tests for infra/rollout/settings.py: one `WorkerSettings` model, and every path that carries it
(the `rlboost worker` flags, the Prefect instance flow's parameters) keeps all of its fields."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from infra.fleet.instance_runs import InstanceRunSpec
from infra.providers.pool import PoolSpec
from infra.rollout.instance import InstanceSpec, default_instance_id
from infra.rollout.settings import WorkerSettings, add_worker_flags, settings_from_flags, worker_flags
from infra.rollout.worker import WorkerConfig
from infra.rollout.worker_config import instance_flags, parse_config
from rl import env_vars
from rl.engine_spec import EngineSpec

CUSTOM = WorkerSettings(slots=3, flush_tokens=7, flush_ms=42.5, heartbeat_s=0.25, ttl_s=1.5, restart_from_scratch=True)


def parse(argv: list[str]) -> WorkerSettings:
    parser = argparse.ArgumentParser()
    add_worker_flags(parser)
    return WorkerSettings(**settings_from_flags(parser.parse_args(argv)))


@pytest.mark.parametrize("settings", [WorkerSettings(), CUSTOM])
def test_the_worker_flags_reproduce_the_settings(settings):
    assert parse(worker_flags(settings)) == settings


def test_the_flags_default_to_the_run_configuration_defaults():
    assert parse([]) == WorkerSettings()
    config = WorkerConfig(
        redis_url="redis://x", run_id="r", instance=InstanceSpec(instance_id="i", pool="p"), model_path="m"
    )
    assert WorkerSettings(**{name: getattr(config, name) for name in WorkerSettings.model_fields}) == WorkerSettings()


def test_the_prefect_instance_flow_gets_every_setting_restart_from_scratch_included():
    from flows.rollout_instance import rollout_instance

    spec = InstanceRunSpec(run_id="r", redis_url="redis://x", model="/m", worker=CUSTOM, engine=EngineSpec())
    pool = PoolSpec(name="spot", capacity_class="spot", size=1, machine_type="local", price_per_hour=0.1)
    parameters = spec.parameters(pool, "spot-0")
    assert WorkerSettings(**parameters["settings"]) == CUSTOM
    validated = rollout_instance.validate_parameters(parameters)
    assert validated["settings"] == CUSTOM


def test_the_instance_flags_reproduce_the_instance_spec(monkeypatch):
    for name in (env_vars.INSTANCE_ID, env_vars.CAPACITY_CLASS):
        monkeypatch.delenv(name, raising=False)
    required = ["--model", "m", "--redis-url", "redis://x", "--run-id", "r"]
    spec = InstanceSpec(instance_id="spot-3", pool="spot", capacity_class="ondemand", price_per_hour=1.1)
    assert parse_config([*required, *instance_flags(spec)])[0].instance == spec
    config, _ = parse_config([*required, "--pool", "spot"])
    assert config.instance == InstanceSpec(instance_id=default_instance_id("spot"), pool="spot")


def test_a_heartbeat_must_fit_in_its_ttl():
    with pytest.raises(ValidationError, match="ttl_s"):
        WorkerSettings(heartbeat_s=2.0, ttl_s=1.0)


def test_the_engine_flag_takes_an_engine_spec_as_json(capsys):
    from infra.rollout.worker_config import _parser

    base = ["--model", "m", "--redis-url", "redis://x", "--run-id", "r", "--pool", "p"]
    spec = EngineSpec(kind="vllm", device="cpu", dtype="bf16")
    assert _parser().parse_args([*base, "--engine", spec.model_dump_json()]).engine == spec
    assert _parser().parse_args(base).engine == EngineSpec()
    with pytest.raises(SystemExit):
        _parser().parse_args([*base, "--engine", '{"kind": "tensorrt"}'])
    error = capsys.readouterr().err
    assert "--engine: not an engine spec" in error and "kind" in error
