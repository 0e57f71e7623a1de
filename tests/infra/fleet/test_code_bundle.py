"""The run's code for its VMs: a wheel built offline from the checkout and cached by its sources'
content, a lock pinned to this environment, both uploaded content-addressed; and each pool's boot
plan (extras, GPU check)."""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from importlib import metadata

import pytest

from infra.fleet import code_bundle
from infra.fleet.cloud_boot import CloudBoot, pool_extras
from infra.providers.bootstrap import WorkerBootstrap
from infra.providers.pool import PoolSpec
from infra.providers.startup import FLOW_RUN_ENV, LOCK_ENV, WHEEL_ENV
from rl.engine_spec import EngineSpec
from tests.helpers import REPO_ROOT


def gcp_pool(**overrides: object) -> PoolSpec:
    fields = {
        "name": "l4-spot",
        "provider": "gcp",
        "capacity_class": "spot",
        "size": 2,
        "machine_type": "g2-standard-8",
        "price_per_hour": 0.3,
        "gcp": {"project": "rollout-proj", "zones": ["us-central1-a"], "image": "img"},
    }
    return PoolSpec.model_validate(fields | overrides)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return code_bundle.build_wheel(REPO_ROOT, tmp_path_factory.mktemp("wheels"))


def test_the_wheel_holds_the_projects_packages_and_data_and_nothing_else(wheel):
    assert wheel.name == "rlboost-0.1.0-py3-none-any.whl"
    names = zipfile.ZipFile(wheel).namelist()
    assert "infra/providers/startup.py" in names and "flows/rollout_instance.py" in names
    assert any(n.startswith("infra/data/traces/") for n in names), "package data travels"
    assert not any(n.startswith("tests/") or "__pycache__" in n for n in names)


def test_the_same_sources_reuse_their_wheel_and_changed_sources_build_a_new_one(tmp_path):
    tree = tmp_path / "src"
    for relative in code_bundle.source_files(REPO_ROOT):
        (tree / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / relative, tree / relative)
    cache = tmp_path / "cache"
    first = code_bundle.build_wheel(tree, cache)
    built_at = first.stat().st_mtime_ns
    again = code_bundle.build_wheel(tree, cache)
    assert again == first and again.stat().st_mtime_ns == built_at, "not rebuilt"
    (tree / "infra" / "providers" / "startup.py").write_text(
        (tree / "infra" / "providers" / "startup.py").read_text() + "\n# changed\n"
    )
    changed = code_bundle.build_wheel(tree, cache)
    assert changed.parent != first.parent and len(list(cache.iterdir())) == 2
    assert b"# changed" in zipfile.ZipFile(changed).read("infra/providers/startup.py")


def test_the_lock_pins_the_wheels_dependencies_to_this_environment_without_local_labels(wheel):
    lock = code_bundle.lock_requirements(wheel, {"gcp"})
    assert lock == code_bundle.lock_requirements(wheel, {"gcp"}), "deterministic"
    lines = [line for line in lock.splitlines() if not line.startswith("#")]
    torch = metadata.version("torch").split("+")[0]
    assert f"torch=={torch}" in lines and not any("+" in line for line in lines)
    assert f"google-cloud-compute=={metadata.version('google-cloud-compute')}" in lines
    assert f"prefect=={metadata.version('prefect')}" in lines
    assert any(line.startswith("hiredis==") for line in lines), "the dependencies' extras are followed"
    assert not any(line.startswith(("rlboost", "azure-mgmt-compute", "pytest")) for line in lines)
    assert all("==" in line for line in lines)
    azure = code_bundle.lock_requirements(wheel, {"azure"})
    assert "azure-mgmt-compute==" in azure and "google-cloud-compute" not in azure


def test_uploads_are_content_addressed_and_name_what_the_vm_fetches(tmp_path, wheel):
    store = (tmp_path / "store").as_uri()
    shipped = code_bundle.upload(wheel, store, None, env=WHEEL_ENV)
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert shipped.sha256 == sha and shipped.env == WHEEL_ENV and shipped.name == wheel.name
    assert shipped.url == f"{store}/code/{sha}/{wheel.name}"
    copy = tmp_path / "store" / "code" / sha / wheel.name
    written_at = copy.stat().st_mtime_ns
    assert code_bundle.upload(wheel, store, None, env=WHEEL_ENV) == shipped and copy.stat().st_mtime_ns == written_at
    blob = code_bundle.vm_url("az://rollout/code/x.whl", {"account_name": "rlbstore"})
    assert blob == "https://rlbstore.blob.core.windows.net/rollout/code/x.whl"
    with pytest.raises(code_bundle.CodeBundleError, match="account_name in weights.store_options"):
        code_bundle.vm_url("az://rollout/code/x.whl", {})


def test_each_pool_gets_the_extras_and_gpu_check_of_its_machine_and_engine(tmp_path, wheel):
    run_engine = EngineSpec()  # device auto
    vllm = EngineSpec(kind="vllm")
    assert pool_extras(gcp_pool(), run_engine, "file:///s") == {"gcp"}
    assert pool_extras(gcp_pool(), vllm, "az://c/s") == {"gcp", "azure", "vllm-cuda"}
    assert pool_extras(gcp_pool(machine_type="n2-standard-8"), vllm, "gs://b/s") == {"gcp", "vllm"}

    boot = CloudBoot(runs=None, engine=run_engine)  # type: ignore[arg-type]  # `plan` never asks Prefect
    cpu_pool = gcp_pool(name="cpu-spot", machine_type="n2-standard-8")
    bootstrap = WorkerBootstrap(wheel=str(wheel), wheelhouse=False)  # tests/infra/fleet/test_wheelhouse.py
    boot.ship([gcp_pool(), cpu_pool], bootstrap, (tmp_path / "store").as_uri(), None, tmp_path / "code")
    plan = boot.plan(gcp_pool(), "flow-run-1")
    assert plan.require_gpu and plan.env == {FLOW_RUN_ENV: "flow-run-1"}
    assert [f.env for f in plan.files] == [WHEEL_ENV, LOCK_ENV]
    assert not boot.plan(cpu_pool, "flow-run-2").require_gpu
    assert not boot.plan(gcp_pool(device="cpu"), "flow-run-3").require_gpu
    with pytest.raises(code_bundle.CodeBundleError, match="cloud pools: a VM cannot fetch 'memory://store'"):
        boot.ship([cpu_pool], bootstrap, "memory://store", None, tmp_path / "code")
    with pytest.raises(code_bundle.CodeBundleError, match="fabric.cloud.bootstrap.wheel: no wheel at"):
        boot.ship([cpu_pool], WorkerBootstrap(wheel=str(tmp_path / "nope.whl")), "file:///s", None, tmp_path)


def test_a_gpu_pools_flow_runs_get_cuda_and_the_runs_engine_kind_dtype_and_vllm_options():
    from infra.fleet.instance_runs import InstanceRunSpec
    from infra.rollout.settings import WorkerSettings
    from rl.config import VLLMOptions

    engine = EngineSpec(kind="vllm", dtype="bf16", vllm=VLLMOptions(max_num_seqs=128, kv_cache_bytes=8 << 30))
    spec = InstanceRunSpec(
        run_id="r", redis_url="redis://10.0.0.5/0", model="gs://b/m", worker=WorkerSettings(), engine=engine
    )
    azure_nc = PoolSpec.model_validate(
        {
            "name": "nc-spot",
            "provider": "azure",
            "capacity_class": "spot",
            "size": 1,
            "machine_type": "Standard_NC24ads_A100_v4",
            "price_per_hour": 1.0,
            "azure": {
                "subscription_id": "00000000-0000-4000-8000-000000000001",
                "resource_group": "rg",
                "zones": ["eastus-1"],
                "image": "microsoft-dsvm:ubuntu-hpc:2204:latest",
                "subnet_id": "/subscriptions/x/resourceGroups/n/providers/Microsoft.Network/virtualNetworks/v/subnets/s",
                "ssh_public_key": "ssh-ed25519 AAAA",
            },
        }
    )
    attached = gcp_pool(
        machine_type="n1-standard-8", gcp={**gcp_pool().gcp.model_dump(), "accelerator_type": "nvidia-tesla-t4"}
    )
    for pool in (gcp_pool(), azure_nc, attached):
        sent = spec.parameters(pool, f"{pool.name}-1")["engine"]
        assert sent == {**engine.model_dump(), "device": "cuda"}, pool.name
        assert pool_extras(pool, engine, "file:///s") >= {"vllm-cuda"}
    cpu = spec.parameters(gcp_pool(machine_type="n1-standard-8"), "cpu-1")["engine"]
    assert cpu["device"] == "auto" and cpu["kind"] == "vllm"
