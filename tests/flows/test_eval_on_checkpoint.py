"""`eval.on_checkpoint` against a real Prefect server (the session's test harness): the checkpoint
event `rlboost.checkpoint.saved` reaches the server with its run resource and payload, and the
automation `rlboost up` creates from deployments/automations/eval-on-checkpoint.yaml, created on
that server, runs the `rl-eval/checkpoint` deployment with the event's run and step."""

from __future__ import annotations

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

from flows.rl_eval import rl_eval
from infra.stack.stack import EVAL_DEPLOYMENT, eval_automation
from tasks.checkpoint_event import CHECKPOINT_SAVED, emit_checkpoint_saved
from tests.helpers import wait_for

pytestmark = pytest.mark.integration


def test_a_checkpoint_event_runs_the_eval_deployment(prefect_harness, tmp_path):
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow(rl_eval)
        deployment_id = client.create_deployment(
            flow_id, EVAL_DEPLOYMENT.split("/")[1], entrypoint="flows/rl_eval.py:rl_eval"
        )
        automation = eval_automation(deployment_id)
        automation_id = client.create_automation(automation)
        stored = client.read_automation(automation_id)
        assert stored.trigger.expect == {CHECKPOINT_SAVED} and stored.actions[0].deployment_id == deployment_id

        event = emit_checkpoint_saved("evaluated", "evaluated-0a1b2c3d", 7, tmp_path / "step_000007")
        assert event is not None and event.resource.id == "rlboost.run.evaluated"
        assert event.payload == {
            "run": "evaluated",
            "run_id": "evaluated-0a1b2c3d",
            "step": 7,
            "checkpoint": str(tmp_path / "step_000007"),
        }

        def eval_runs():
            return client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
            )

        wait_for(eval_runs, "the automation's rl-eval flow run", timeout_s=30)
        (run,) = eval_runs()
        assert run.parameters == {"run_name": "evaluated", "checkpoint": 7}
        client.delete_automation(automation_id)
