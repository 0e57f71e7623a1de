"""A user's environment package outside the project, on a cloud pool: the run ships it in its code
bundle and the VM's rollout worker imports it from there.

One step of the rl-train flow (the `grpo` deployment's flow function, in this process) whose one
pool is a GCP spot VM of `tests.fakes.gce` that really boots (`tests.fakes.vm_host`): its image
has the dependencies but neither the project nor the user's package, and its environment no
`PYTHONPATH`. The user's calculator (`my_cloud_envs_37:Env`) notes each step's process and
`PYTHONPATH`; the VM's worker must step it, from the unpacked bundle."""

from __future__ import annotations

import json
import os
import textwrap
import time

import pytest
from prefect.settings import PREFECT_API_URL

from flows.rl_train import rl_train
from infra.services.redis_embedded import EmbeddedRedis
from rl.rollout import read_samples
from tests.fakes.gce import FakeGce
from tests.fakes.support import serving
from tests.fakes.vm_host import FakeVmHost, bake_image_venv
from tests.flows.test_user_package_run import ENVS
from tests.helpers import cloud_fabric_run, tiny_run
from tests.infra.rollout import agentic
from tests.infra.run.test_cloud_fabric_e2e import deploy_rollout_instance, routable_ipv4, service_account_key

pytestmark = pytest.mark.integration

POOL = "l4-spot"


def test_a_users_environment_package_reaches_a_cloud_vm_in_the_code_bundle(prefect_harness, tmp_path, monkeypatch):
    address = routable_ipv4()
    if address is None:
        pytest.skip("this machine has no routable IPv4 address for the VMs to reach Redis at")
    source, notes = tmp_path / "src", tmp_path / "notes"
    (source / "my_cloud_envs_37").mkdir(parents=True)
    notes.mkdir()
    (source / "my_cloud_envs_37" / "__init__.py").write_text(textwrap.dedent(ENVS))
    monkeypatch.syspath_prepend(str(source))  # the training process's only way to it
    model = agentic.memorised_model(tmp_path / "model")
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps({"prompt": p[0], "answer": p[1]}) + "\n" for p in (agentic.ONE_CALL,)))
    install_dir = tmp_path / "opt"
    install_dir.mkdir()
    bake_image_venv(install_dir)
    monkeypatch.setenv("RLBOOST_WHEEL_CACHE", str(tmp_path / "wheels"))
    deploy_rollout_instance(PREFECT_API_URL.value(), install_dir)
    with (
        EmbeddedRedis(host=address) as redis_server,
        serving(FakeGce(clock=time.time, token="ya29.fake", operation_polls=1)) as gce,
    ):
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(service_account_key(gce, tmp_path / "key.json")))
        vm_env = {"PATH": os.environ["PATH"], "DO_NOT_TRACK": "1", "OMP_NUM_THREADS": "1"}
        pool = {
            "name": POOL,
            "provider": "gcp",
            "capacity_class": "spot",
            "size": 1,
            "min_size": 1,
            "machine_type": "g2-standard-8",
            "device": "cpu",
            "price_per_hour": 0.3,
            "notice_s": 30.0,
            "gcp": {
                "project": gce.project,
                "zones": ["us-central1-a"],
                "image": "projects/rlboost-images/global/images/family/rollout",
            },
        }
        cloud = cloud_fabric_run(pool, redis_server.url, install_dir, gcp_api_endpoint=gce.url)
        settings = {
            **cloud,
            "rollout.max_new_tokens": 400,
            "rollout.temperature": 0.25,
            "rollout.prompts_per_step": 1,
            "data.source": "file",
            "data.path": str(problems),
            "data.eval_path": str(problems),
            "eval.size": 1,
            "environment": {"class": "my_cloud_envs_37:Env", "args": {"notes": str(notes)}, "max_turns": 3},
        }
        overrides = tiny_run(model, tmp_path, "cloud-user-code", 1, settings)
        with FakeVmHost(gce, tmp_path / "vms", vm_env, grace_s=20.0) as host:
            state = rl_train(overrides=overrides, return_state=True)
            logs = {name: vm.log.read_text(errors="replace")[-3000:] for name, vm in host.booted.items()}
            assert state.is_completed(), f"{state}\n" + "\n".join(f"--- {n}\n{t}" for n, t in logs.items())

    run_dir = tmp_path / "runs" / "cloud-user-code"
    samples = read_samples(run_dir / "steps" / "000001" / "rollout.jsonl")
    assert len(samples) == 4 and all(len(s.turns) >= 1 and 0 in s.loss_mask for s in samples)
    [archive] = (run_dir / "store" / "code").glob("*/user-code.tar.gz")
    unpacked = install_dir / "user-code" / archive.parent.name
    assert (unpacked / "my_cloud_envs_37" / "__init__.py").read_text() == textwrap.dedent(ENVS)
    stepped = [json.loads(path.read_text()) for path in notes.glob("*.json")]
    on_the_vm = [note for note in stepped if note["pid"] != os.getpid()]
    assert len(on_the_vm) >= len(samples), stepped
    assert all(note["python_path"].split(os.pathsep)[0] == str(unpacked) for note in on_the_vm)
