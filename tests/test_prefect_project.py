"""prefect.yaml names real flows: every deployment entrypoint loads, and its parameters validate."""

from pathlib import Path

import yaml
from prefect.flows import load_flow_from_entrypoint

ROOT = Path(__file__).resolve().parent.parent


def test_deployment_entrypoints_load_and_parameters_match():
    project = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    names = {}
    for deployment in project["deployments"]:
        flow = load_flow_from_entrypoint(str(ROOT / deployment["entrypoint"]))
        names[deployment["name"]] = flow.name
        flow.validate_parameters(deployment.get("parameters", {}))
        config = deployment.get("parameters", {}).get("config_path")
        if config:
            assert (ROOT / config).exists(), config
    assert names["grpo"] == "rl-train"
