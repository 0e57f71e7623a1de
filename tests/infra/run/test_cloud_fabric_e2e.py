"""rl-train with a GCP spot pool, end to end against a fake Compute Engine whose VMs really boot.

The training run (a real Prefect server, the flow in this process) keeps a `gcp` pool of 2 Spot
VMs through `google-cloud-compute` against `tests.fakes.gce`, with credentials from
`GOOGLE_APPLICATION_CREDENTIALS` (a refresh token the fake's token endpoint honours). Every VM the
fake creates boots here (`tests.fakes.vm_host`): its startup script runs the GCE preemption
watcher and a Prefect worker on the VM's own work queue, which runs the VM's `rollout-instance`
flow run; the worker reads the Redis URL and the weights secret from the run's Secret block and
the base model from the copy under the weight store. Redis listens on a routable address (a VM
cannot reach the trainer's loopback). After step 1 the VMs are preempted through the metadata
server, both at once (a zone reclaiming its spot capacity): their flow runs end Crashed, the
capacity manager starts replacements, and step 2 finishes on them.
At the end the VMs drain (runs Completed) and are deleted, and the Secret block is removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL

from flows.rl_train import rl_train
from infra.ledger.reader import load_run
from infra.ledger.recorder import Ledger
from infra.run.fabric import environment_block_name
from infra.services.redis_embedded import EmbeddedRedis
from infra.weights.model_source import INDEX
from rl.models import save_model
from rl.rollout import read_samples
from tests.fakes.gce import FakeGce
from tests.fakes.support import serving
from tests.fakes.vm_host import FakeVmHost, bake_image_venv
from tests.helpers import REPO_ROOT, cloud_fabric_run, save_tiny_model, tiny_model, tiny_run, tiny_shape

pytestmark = pytest.mark.integration

ROOT = REPO_ROOT
POOL = "l4-spot"
STEPS = 4


def routable_ipv4() -> str | None:
    """An address of this machine that is not loopback (what a VM would dial), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def service_account_key(gce: FakeGce, path: Path) -> Path:
    """A service-account key file (what `GOOGLE_APPLICATION_CREDENTIALS` names) whose account the
    fake's token endpoint knows."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    email = "rollout@rollout-proj.iam.gserviceaccount.com"
    gce.service_accounts[email] = (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    path.write_text(
        json.dumps(
            {
                "type": "service_account",
                "project_id": gce.project,
                "private_key_id": "k1",
                "client_email": email,
                "client_id": "1",
                "token_uri": f"{gce.url}/token",
                "private_key": key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                ).decode(),
            }
        )
    )
    return path


def deploy_rollout_instance(api_url: str, install_dir: Path, pool: str = POOL) -> None:
    """The cloud pool's work pool and `rollout-instance/<pool>` deployment, as prefect.yaml declares
    one for a cloud pool: a module entrypoint (the VM has the project installed) and a pull step
    into the install directory."""
    template = json.loads((ROOT / "deployments" / "work-pools" / "local-process.json").read_text())
    with SyncPrefectClient(api_url) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process", base_job_template=template), overwrite=True)
        flow_id = client.create_flow_from_name("rollout-instance")
        client.create_deployment(
            flow_id=flow_id,
            name=pool,
            work_pool_name=pool,
            entrypoint="flows.rollout_instance.rollout_instance",
            pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(install_dir)}}],
        )


def test_training_keeps_a_gcp_spot_pool_through_a_preemption(prefect_harness, tmp_path, monkeypatch):
    address = routable_ipv4()
    if address is None:
        pytest.skip("this machine has no routable IPv4 address for the VMs to reach Redis at")
    api_url = PREFECT_API_URL.value()
    base = tmp_path / "base"
    model, tokenizer = tiny_model()
    save_model(model, tokenizer, base)
    # The image: a venv with the dependencies but not the project; the VMs install the run's wheel.
    install_dir = tmp_path / "opt"
    install_dir.mkdir()
    venv = bake_image_venv(install_dir)
    monkeypatch.setenv("RLBOOST_WHEEL_CACHE", str(tmp_path / "wheels"))
    deploy_rollout_instance(api_url, install_dir)

    with (
        EmbeddedRedis(host=address) as redis_server,
        serving(FakeGce(clock=time.time, token="ya29.fake", operation_polls=1)) as gce,
    ):
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(service_account_key(gce, tmp_path / "key.json")))
        vm_env = {
            "PATH": os.environ["PATH"],
            "DO_NOT_TRACK": "1",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "OMP_NUM_THREADS": "1",
            "PREFECT_LOGGING_LEVEL": "INFO",
        }
        pool = {
            "name": POOL,
            "provider": "gcp",
            "capacity_class": "spot",
            "size": 2,
            "min_size": 2,
            "machine_type": "g2-standard-8",
            "device": "cpu",  # the "VMs" are processes on this CPU-only machine; a g2 would get cuda
            "price_per_hour": 0.3,
            "notice_s": 30.0,
            "gcp": {
                "project": gce.project,
                "zones": ["us-central1-a", "us-central1-b"],
                "image": "projects/rlboost-images/global/images/family/rollout",
            },
        }
        overrides = tiny_run(
            base,
            tmp_path,
            "cloud-e2e",
            STEPS,
            cloud_fabric_run(pool, redis_server.url, install_dir, gcp_api_endpoint=gce.url),
        )
        run_dir = tmp_path / "runs" / "cloud-e2e"
        with FakeVmHost(gce, tmp_path / "vms", vm_env, grace_s=20.0) as host:
            preempted: list[str] = []

            def preempt_after_step_1() -> None:
                deadline = time.monotonic() + 600
                while not (run_dir / "steps" / "000001" / "metrics.json").exists():
                    if time.monotonic() > deadline:
                        return
                    time.sleep(0.1)
                # The zone reclaims both at once (neither is gone before both are drained): step 2
                # needs the replacements, and the capacity manager sees both go before either boots.
                preempted.extend(sorted(host.running()))
                host.reclaim_together(preempted)

            preempter = threading.Thread(target=preempt_after_step_1, daemon=True)
            preempter.start()
            state = rl_train(overrides=overrides, return_state=True)
            preempter.join(timeout=5)
            logs = {name: vm.log.read_text(errors="replace")[-3000:] for name, vm in host.booted.items()}
            assert state.is_completed(), f"{state}\n" + "\n".join(f"--- {n}\n{t}" for n, t in logs.items())
            deadline = time.monotonic() + 30
            while set(host.booted) - host.gone and time.monotonic() < deadline:
                time.sleep(0.2)

        # Every step trained on all of its samples.
        for step in range(1, STEPS + 1):
            metrics = json.loads((run_dir / "steps" / f"{step:06d}" / "metrics.json").read_text())
            ids = [s.sample_id for s in read_samples(run_dir / "steps" / f"{step:06d}" / "rollout.jsonl")]
            assert metrics["groups_dropped"] == 0 and len(ids) == len(set(ids)) == 16, metrics

        # The preempted VM was replaced; every VM is deleted at the end, and each of them served.
        assert len(preempted) == 2
        assert len(host.booted) == 4, f"expected 2 VMs and 2 replacements, booted {sorted(host.booted)}"
        assert gce.names() == [] and gce.names(status="STOPPING") == []
        assert host.gone == set(host.booted)
        assert all(gce.requests_to("POST", r"/instances$")), "inserts went through the SDK"
        for name, vm in host.booted.items():
            assert not vm.metadata.violations, vm.metadata.violations

        # Their flow runs: the preempted one Crashed with the notice, the others drained (Completed).
        with SyncPrefectClient(api_url) as client:
            runs = {
                r.name: r
                for r in client.read_flow_runs(
                    deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[POOL]))
                )
            }
            assert set(runs) == {f"{POOL}/{name}" for name in host.booted}, sorted(runs)
            states = {name.split("/", 1)[1]: run.state for name, run in runs.items()}
            # Crashed with the instance's own message, or Prefect's when the notice came while the
            # flow run was still starting (before the instance's handler was installed).
            assert all(
                states[n].is_crashed()
                and ("preempted: SIGTERM" in states[n].message or "termination signal" in states[n].message)
                for n in preempted
            ), states
            assert all(s.is_completed() for n, s in states.items() if n not in preempted), states
            ledger_run_id = state.result()["ledger_run_id"]
            with pytest.raises(ObjectNotFound):  # the instances' secrets are gone with the run
                client.read_block_document_by_name(environment_block_name(ledger_run_id), block_type_slug="secret")

        # The VMs ran the run's own wheel, fetched from the store and verified, installed once.
        [wheel] = (run_dir / "store" / "code").glob("*/rlboost-*.whl")
        assert wheel.parent.name == hashlib.sha256(wheel.read_bytes()).hexdigest()
        assert (venv / ".rlboost-wheel-sha256").read_text().strip() == wheel.parent.name
        assert list(venv.glob("lib/python*/site-packages/infra/__init__.py")), "the wheel is in the VMs' venv"
        installs = [name for name, vm in host.booted.items() if f"installing {wheel.name}" in vm.log.read_text()]
        assert len(installs) == 1, installs  # the others found it installed (same sha256)

        # The base model reached the VMs through the store; the ledger has each VM's life and cost.
        assert (run_dir / "store" / "base-model" / INDEX).exists()
        with Ledger() as ledger:
            report = ledger.report(ledger_run_id)
            records = load_run(ledger.engine, ledger_run_id)
        # Version 1 reached the replacements over HTTPS from the trainer's peer server (weights.tls);
        # the run beat in the ledger while it ran (the VM sweep's sign of life).
        assert "trainer" in {t.source for t in records.transfers}, records.transfers
        assert records.run.heartbeat_at is not None
        by_id = {i.instance_id: i for i in report.instances}
        assert set(by_id) == set(host.booted)
        assert all(by_id[n].reason == "preempted" for n in preempted)
        assert all(i.pool == POOL and i.capacity_class == "spot" and i.spend_usd > 0 for i in by_id.values())
        assert report.preemptions == 2 and report.tokens_generated > 0


def test_vms_that_cannot_boot_fail_the_run_with_their_boot_log_line(prefect_harness, tmp_path, monkeypatch):
    """An image without the configured Python: each VM's boot fails and sets its flow run Failed with
    the boot log's line; each such VM is deleted and replaced, and after `max_instance_failures`
    (3) the run stops with the last one's line (not at the ready timeout) and deletes its VMs."""
    address = routable_ipv4()
    if address is None:
        pytest.skip("this machine has no routable IPv4 address for the VMs to reach Redis at")
    api_url = PREFECT_API_URL.value()
    base = tmp_path / "base"
    save_tiny_model(base, tiny_shape(smallest=True))
    install_dir = tmp_path / "opt"  # no venv: the boot script must make one, with python3.9
    deploy_rollout_instance(api_url, install_dir)
    monkeypatch.setenv("RLBOOST_WHEEL_CACHE", str(tmp_path / "wheels"))
    with (
        EmbeddedRedis(host=address) as redis_server,
        serving(FakeGce(clock=time.time, token="ya29.fake", operation_polls=1)) as gce,
    ):
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(service_account_key(gce, tmp_path / "key.json")))
        pool = {
            "name": POOL,
            "provider": "gcp",
            "capacity_class": "spot",
            "size": 1,
            "min_size": 1,
            "machine_type": "n1-standard-4",
            "price_per_hour": 0.1,
            "gcp": {"project": gce.project, "zones": ["us-central1-a"], "image": "projects/x/global/images/old"},
        }
        overrides = tiny_run(
            base,
            tmp_path,
            "cannot-boot",
            overrides={
                "fabric.enabled": True,
                "fabric.pools": [pool],
                "fabric.redis_url": redis_server.url,
                "fabric.allow_plaintext": True,  # the fakes' network is this machine
                "fabric.ready_timeout_s": 600,
                "fabric.cloud": {
                    "bootstrap": {"install_dir": str(install_dir), "python": "python3.9", "wheelhouse": False},
                    "gcp_api_endpoint": gce.url,
                    "live_prices": False,
                    "reconcile_s": 0.5,
                },
            },
        )
        vm_env = {"PATH": "/usr/bin:/bin", "DO_NOT_TRACK": "1"}  # no python3.9, no uv
        with FakeVmHost(gce, tmp_path / "vms", vm_env, grace_s=5.0) as host:
            started = time.monotonic()
            state = rl_train(overrides=overrides, return_state=True)
            assert time.monotonic() - started < 600, "failed at the boot, not at the ready timeout"
            deadline = time.monotonic() + 30
            while set(host.booted) - host.gone and time.monotonic() < deadline:
                time.sleep(0.2)
        assert state.is_failed(), state
        assert "PoolFailure" in state.message and "3 instances in a row failed" in state.message
        assert "its worker's flow run ended FAILED: rlboost boot failed on l4-spot-" in state.message
        assert "no python3.9 on this image, and the project needs Python 3.11 or newer" in state.message
        assert len(host.booted) >= 3, f"each failed VM replaced until the pool gave up: {sorted(host.booted)}"
        assert gce.names() == [], "the run deleted its VMs"
