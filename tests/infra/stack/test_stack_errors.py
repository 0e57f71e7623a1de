"""Bad input to the Prefect side fails at once with what, where and how to fix it: an unknown pool,
an unreachable Prefect API, an unsupported database URL, a port in use; `down` with nothing up."""

from __future__ import annotations

import socket

import pytest
from typer.testing import CliRunner

from infra.cli.app import app
from infra.fleet.prefect_local import InstanceRunSpec, PrefectLocalProvider
from infra.rollout.settings import WorkerSettings
from infra.services.ports import free_port
from infra.services.prefect_api import PrefectApiUnreachable, check_api
from rl.engine_spec import EngineSpec

runner = CliRunner()


def test_up_with_a_pool_prefect_yaml_cannot_run_fails_before_starting_anything(tmp_path):
    config = tmp_path / "gpu.yaml"
    config.write_text(
        "fabric:\n  enabled: true\n  pools:\n"
        "    - {name: gpu, capacity_class: spot, size: 1, machine_type: g2-standard-8, price_per_hour: 0.5}\n"
    )
    result = runner.invoke(app, ["up", "--config", str(config), "--state-dir", str(tmp_path / "stack")])
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "unknown pool 'gpu'" in text and str(config) in text
    assert "prefect.yaml has no rollout-instance deployment on work pool 'gpu'" in text
    assert "entrypoint: flows/rollout_instance.py:rollout_instance" in text
    assert "(it has: reserved, spot)" in text
    assert not (tmp_path / "stack" / "stack.json").exists()


def test_up_rejects_a_database_url_it_cannot_use_without_showing_the_password(tmp_path):
    result = runner.invoke(
        app, ["up", "--database-url", "mysql://me:secret@db:3306/prefect", "--state-dir", str(tmp_path)]
    )
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "unsupported scheme 'mysql'" in text and "postgresql://user:password@host:5432/database" in text
    assert "secret" not in text and "mysql://me:***@db:3306/prefect" in text


def test_up_on_a_port_in_use_says_so(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = runner.invoke(app, ["up", "--port", str(port), "--state-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert f"port {port} on 127.0.0.1 is in use" in " ".join(result.output.split())


def test_down_with_no_stack_says_there_is_nothing_to_stop(tmp_path):
    result = runner.invoke(app, ["down", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0
    assert "no stack is up" in result.output and "nothing to stop" in result.output


def test_unreachable_prefect_api_names_the_url_and_the_fix():
    url = f"http://127.0.0.1:{free_port()}/api"
    with pytest.raises(PrefectApiUnreachable) as caught:
        check_api(url, purpose="the test")
    message = str(caught.value)
    assert f"cannot reach the Prefect API at {url} (PREFECT_API_URL) for the test" in message
    assert "rlboost up" in message and "ConnectError" in message


def test_prefect_instances_without_a_reachable_api_fail_before_starting_anything(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/api"
    spec = InstanceRunSpec(
        run_id="r", redis_url="redis://127.0.0.1:1/0", model="m", worker=WorkerSettings(), engine=EngineSpec()
    )
    with pytest.raises(PrefectApiUnreachable, match=r"for fabric.instances: prefect: .*rlboost up"):
        PrefectLocalProvider(spec, api_url=url, log_dir=tmp_path)
    assert not list(tmp_path.iterdir())
