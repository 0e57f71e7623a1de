"""The boot script writes the run's Redis CA on the VM and names it to the worker: the script's
lines that set its environment (before the install) run for real in bash, into a temporary install
directory."""

from __future__ import annotations

import subprocess

from infra.providers.bootstrap import WorkerBootstrap
from infra.providers.startup import render_startup_script
from infra.services.redis_embedded import REDIS_CA_FILE_ENV
from tests.infra.providers.test_gcp import gcp_pool

PEM = "-----BEGIN CERTIFICATE-----\nMIIB'quoted'$HOME`x`\n-----END CERTIFICATE-----\n"
POOL = gcp_pool()


def _boot_until_the_worker(bootstrap: WorkerBootstrap) -> str:
    script = render_startup_script(bootstrap, pool=POOL, instance_id="spot-1", run_id="r", watcher="gce")
    before_install = script.split("\nexport PATH=", 1)[0] + f'\necho "${{{REDIS_CA_FILE_ENV}:-}}"\n'
    return subprocess.run(["bash", "-c", before_install], capture_output=True, text=True, check=True).stdout.strip()


def test_the_ca_is_written_byte_for_byte_and_named_in_the_environment(tmp_path):
    install_dir = tmp_path / "opt rlboost"
    named = _boot_until_the_worker(WorkerBootstrap(install="image", install_dir=str(install_dir), redis_ca_pem=PEM))
    assert named == str(install_dir / "redis-ca.pem")
    assert (install_dir / "redis-ca.pem").read_text() == PEM


def test_without_a_ca_the_script_names_none(tmp_path):
    assert _boot_until_the_worker(WorkerBootstrap(install="image", install_dir=str(tmp_path))) == ""
