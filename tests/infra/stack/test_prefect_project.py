"""prefect.yaml, the work-pool template and the zombie automation are consistent with the code:
every entrypoint loads, training parameters validate, every pool of the demo configuration has a
rollout-instance deployment on its own work pool, the nightly deployment is scheduled and resumes
with extra steps, and the automation is Prefect's documented heartbeat pattern."""

import json
from datetime import timedelta

import pytest
import yaml
from prefect.events.schemas.automations import AutomationCore, Posture
from prefect.flows import load_flow_from_entrypoint

from infra.fleet.instance_runs import UnknownPool
from infra.run.config import load_config
from infra.stack.stack import (
    EVAL_DEPLOYMENT,
    ROLLOUT_ENTRYPOINT,
    ROLLOUT_MODULE_ENTRYPOINT,
    WORK_POOL_TEMPLATE,
    ZOMBIE_AUTOMATION,
    ProjectDeployment,
    check_pools,
    eval_automation,
    read_project,
)
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT


def _deployments() -> dict[str, dict]:
    return {d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}


def test_deployment_entrypoints_load_and_training_parameters_match():
    flows = {}
    for name, deployment in _deployments().items():
        flow = load_flow_from_entrypoint(str(ROOT / deployment["entrypoint"]))
        flows[name] = flow.name
        if flow.name in ("rl-train", "rl-eval"):
            parameters = deployment.get("parameters", {})
            flow.validate_parameters(parameters | ({"run_name": "a-run"} if flow.name == "rl-eval" else {}))
            assert (ROOT / deployment["parameters"]["config_path"]).exists()
            load_config(ROOT / deployment["parameters"]["config_path"], deployment["parameters"].get("overrides"))
    assert flows == {
        "grpo": "rl-train",
        "grpo-nightly": "rl-train",
        "checkpoint": "rl-eval",
        "reserved": "rollout-instance",
        "spot": "rollout-instance",
    }


def test_every_demo_pool_has_a_rollout_instance_deployment_on_its_work_pool():
    pools = check_pools(None, read_project())
    assert pools == ["reserved", "spot"]
    for pool in pools:
        deployment = _deployments()[pool]
        assert deployment["entrypoint"] == ROLLOUT_ENTRYPOINT and deployment["work_pool"]["name"] == pool


def test_a_cloud_pool_needs_a_deployment_that_runs_from_the_installed_project(tmp_path):
    config = tmp_path / "cloud.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "fabric": {
                    "enabled": True,
                    "pools": [
                        {
                            "name": "reserved",
                            "capacity_class": "reserved",
                            "size": 1,
                            "machine_type": "a2-highgpu-1g",
                            "price_per_hour": 3.67,
                        },
                        {
                            "name": "l4-spot",
                            "provider": "gcp",
                            "capacity_class": "spot",
                            "size": 2,
                            "machine_type": "g2-standard-8",
                            "price_per_hour": 0.3,
                            "gcp": {"project": "rollout-proj", "zones": ["us-central1-a"], "image": "img"},
                        },
                    ],
                }
            }
        )
    )
    local = [d for d in read_project() if d.is_rollout_instance]
    with pytest.raises(
        UnknownPool, match=rf"unknown pool 'l4-spot'.*entrypoint: {ROLLOUT_MODULE_ENTRYPOINT}.*own `pull"
    ):
        check_pools(config, local)
    checkout = ProjectDeployment("l4-spot", ROLLOUT_ENTRYPOINT, "l4-spot", "default")
    with pytest.raises(
        UnknownPool, match="runs on gcp VMs, but its deployment rollout-instance/l4-spot would look for this checkout"
    ):
        check_pools(config, [*local, checkout])
    installed = ProjectDeployment("l4-spot", ROLLOUT_MODULE_ENTRYPOINT, "l4-spot", "default", own_pull=True)
    assert check_pools(config, [*local, installed]) == ["reserved", "l4-spot"]


def test_nightly_deployment_is_a_cron_schedule_that_resumes_with_extra_steps():
    nightly = _deployments()["grpo-nightly"]
    assert nightly["schedules"][0]["cron"] == "0 3 * * *"
    assert nightly["parameters"]["extra_steps"] >= 1
    assert nightly["work_pool"] == _deployments()["grpo"]["work_pool"]


def test_work_pool_template_keeps_flow_runs_in_the_worker_group_and_sends_heartbeats():
    template = json.loads(WORK_POOL_TEMPLATE.read_text())
    variables = template["variables"]["properties"]
    assert variables["command"]["default"] == "python -m prefect.engine"
    assert int(variables["env"]["default"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"]) == 30
    assert template["job_configuration"]["command"] == "{{ command }}"


def test_zombie_automation_is_the_documented_heartbeat_pattern():
    automation = AutomationCore.model_validate(yaml.safe_load(ZOMBIE_AUTOMATION.read_text()))
    trigger = automation.trigger
    assert trigger.posture == Posture.Proactive
    assert trigger.after == {"prefect.flow-run.heartbeat"}
    assert trigger.expect >= {"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Crashed"}
    assert trigger.for_each == {"prefect.resource.id"}
    assert trigger.within == timedelta(seconds=90)
    assert [a.type for a in automation.actions] == ["change-flow-run-state"]
    assert automation.actions[0].state.value == "CRASHED"


def test_the_eval_automation_runs_the_eval_deployment_on_each_checkpoint_event():
    automation = eval_automation("00000000-0000-0000-0000-000000000001")
    assert automation.trigger.posture == Posture.Reactive
    assert automation.trigger.expect == {"rlboost.checkpoint.saved"}
    (action,) = automation.actions
    assert action.type == "run-deployment" and str(action.deployment_id).endswith("1")
    assert action.parameters == {"run_name": "{{ event.payload.run }}", "checkpoint": "{{ event.payload.step }}"}
    assert _deployments()[EVAL_DEPLOYMENT.split("/")[1]]["entrypoint"] == "flows/rl_eval.py:rl_eval"
