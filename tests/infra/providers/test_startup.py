"""The VM boot script, run for real with bash: the files it fetches are checked against their
sha256, an image without Python 3.11+ or without a working GPU driver fails the boot, and every
failure is one boot-log line that also ends the instance's flow run Failed (through the Prefect
API, as a VM would report it)."""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.orchestration import SyncPrefectClient
from prefect.settings import PREFECT_API_URL

from infra.providers.bootstrap import WorkerBootstrap
from infra.providers.interface import BootFile, BootPlan
from infra.providers.startup import (
    FAILED_PREFIX,
    FLOW_RUN_ENV,
    LOCK_ENV,
    WHEEL_ENV,
    fetch_command,
    render_startup_script,
)
from tests.infra.fleet.test_code_bundle import gcp_pool  # g2-standard-8: one L4 built in

pytestmark = pytest.mark.integration


@flow(name="rollout-instance-stand-in")
def waiting_instance() -> None:
    """Only its flow runs are used: a run that the boot script reports on."""


def pending_flow_run() -> str:
    with SyncPrefectClient(PREFECT_API_URL.value()) as client:
        return str(client.create_flow_run(waiting_instance).id)


def flow_run_state(flow_run_id: str):
    with SyncPrefectClient(PREFECT_API_URL.value()) as client:
        return client.read_flow_run(flow_run_id).state


def boot(script: str, path: str = os.environ["PATH"]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", script], env={"PATH": path, "HOME": "/nonexistent"}, capture_output=True, text=True, timeout=60
    )


def published(tmp_path: Path, name: str, content: bytes, env: str | None) -> BootFile:
    path = tmp_path / "store" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return BootFile(name, path.as_uri(), hashlib.sha256(content).hexdigest(), env)


def test_a_file_that_does_not_match_its_sha256_fails_the_boot_and_its_flow_run(prefect_harness, tmp_path):
    run_id = pending_flow_run()
    wheel = published(tmp_path, "rlboost-0.1.0-py3-none-any.whl", b"the run's wheel", WHEEL_ENV)
    lock = published(tmp_path, "requirements.txt", b"torch==2.13.0\n", LOCK_ENV)
    (tmp_path / "store" / wheel.name).write_bytes(b"someone else's wheel")  # replaced after publication
    bootstrap = WorkerBootstrap(install_dir=str(tmp_path / "opt"), prefect_api_url=PREFECT_API_URL.value())
    plan = BootPlan(files=(wheel, lock), env={FLOW_RUN_ENV: run_id})
    done = boot(
        render_startup_script(bootstrap, pool=gcp_pool(), instance_id="l4-spot-1", run_id="r", watcher="gce", plan=plan)
    )

    assert done.returncode == 1
    [line] = [line for line in done.stderr.splitlines() if line.startswith(FAILED_PREFIX)]
    actual = hashlib.sha256(b"someone else's wheel").hexdigest()
    assert f"has sha256 {actual}, not the {wheel.sha256} the run published" in line and wheel.url in line
    assert list((tmp_path / "opt" / "boot").iterdir()) == [], "a file that failed its check is not kept"
    assert not (tmp_path / "opt" / "venv").exists(), "nothing was installed"
    state = flow_run_state(run_id)
    assert state.is_failed() and state.message == line


def test_an_image_without_python_3_11_fails_the_boot_with_what_it_found(prefect_harness, tmp_path):
    run_id = pending_flow_run()
    wheel = published(tmp_path, "rlboost-0.1.0-py3-none-any.whl", b"wheel", WHEEL_ENV)
    lock = published(tmp_path, "requirements.txt", b"\n", LOCK_ENV)
    bootstrap = WorkerBootstrap(
        install_dir=str(tmp_path / "opt"), python="python3.9", prefect_api_url=PREFECT_API_URL.value()
    )
    plan = BootPlan(files=(wheel, lock), env={FLOW_RUN_ENV: run_id})
    script = render_startup_script(
        bootstrap, pool=gcp_pool(), instance_id="l4-spot-2", run_id="r", watcher="gce", plan=plan
    )
    done = boot(script, path="/usr/bin:/bin")  # no uv on this PATH, and no python3.9

    assert done.returncode == 1, done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith(FAILED_PREFIX)]
    assert "no python3.9 on this image, and the project needs Python 3.11 or newer" in line
    assert (tmp_path / "opt" / "boot" / wheel.name).read_bytes() == b"wheel", "the files were fetched and verified"
    state = flow_run_state(run_id)
    assert state.is_failed() and state.message == line


def test_a_gpu_vm_without_a_working_driver_fails_its_boot_instead_of_decoding_on_its_cpu(prefect_harness, tmp_path):
    run_id = pending_flow_run()
    (tmp_path / "opt").mkdir()
    (tmp_path / "opt" / "venv").symlink_to(Path(sys.prefix))  # an image with the project baked in
    bootstrap = WorkerBootstrap(
        install="image", install_dir=str(tmp_path / "opt"), prefect_api_url=PREFECT_API_URL.value()
    )
    plan = BootPlan(env={FLOW_RUN_ENV: run_id}, require_gpu=True)
    script = render_startup_script(
        bootstrap, pool=gcp_pool(), instance_id="l4-spot-3", run_id="r", watcher="gce", plan=plan
    )
    done = boot(script, path="/usr/bin:/bin")  # this machine has no nvidia-smi

    assert done.returncode == 1, done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith(FAILED_PREFIX)]
    assert "pool l4-spot runs its engine on cuda, but nvidia-smi fails" in line
    state = flow_run_state(run_id)
    assert state.is_failed() and state.message == line


def test_the_script_quotes_every_value_and_runs_the_instances_worker_under_its_clouds_watcher(tmp_path):
    pool = gcp_pool()
    bootstrap = WorkerBootstrap(
        install="image", install_dir=str(tmp_path / "it's opt"), prefect_api_url="http://p:4200/api"
    )
    script = render_startup_script(bootstrap, pool=pool, instance_id="l4-spot-0a1b2c3d", run_id="run 1", watcher="gce")
    python = f"{tmp_path}/it's opt/venv/bin/python"
    worker = [
        python,
        "-m",
        "infra.watchers",
        "gce",
        "--grace-s",
        "25.0",
        "--",
        python,
        "-m",
        "infra.services.prefect_worker",
    ]
    worker += ["--pool", "l4-spot", "--work-queue", "run 1-l4-spot-0a1b2c3d", "--name", "l4-spot-0a1b2c3d"]
    assert shlex.split(script.splitlines()[-1]) == ["exec", *worker, "--limit", "1", "--run-once"]
    assert "export RLBOOST_RUN_ID='run 1'" in script and "export PREFECT_API_URL=http://p:4200/api" in script
    azure = render_startup_script(bootstrap, pool=pool, instance_id="vm-a", run_id="r", watcher="azure")
    assert "-m infra.watchers azure --instance vm-a --grace-s 25.0 --" in azure
    with pytest.raises(ValueError, match=r"`install: wheel` boots need the run's wheel and lock"):
        render_startup_script(WorkerBootstrap(), pool=pool, instance_id="vm-b", run_id="r", watcher="gce")


def test_each_store_scheme_has_a_fetch_command_a_vm_image_provides():
    assert fetch_command("file:///srv/my%20store/w.whl", "/opt/b/w") == "cp '/srv/my store/w.whl' /opt/b/w"
    assert fetch_command("gs://bucket/code/w.whl", "/d").startswith("gcloud storage cp --quiet gs://bucket/code/w.whl")
    assert fetch_command("s3://bucket/w.whl", "/d").startswith("aws s3 cp")
    blob = fetch_command("https://acct.blob.core.windows.net/c/code/w.whl", "/d")
    assert "az login --identity" in blob and "--blob-url https://acct.blob.core.windows.net/c/code/w.whl" in blob
    assert fetch_command("https://mirror.example/w.whl", "/d").startswith("curl -fsSL")
    with pytest.raises(ValueError, match="a VM cannot fetch 'memory://x'"):
        fetch_command("memory://x", "/d")
