"""The VM boot script installs the lock from the run's wheelhouse with no index, run for real with
bash up to its worker: the package index is unreachable (pip's configuration ignored, the index an
address that refuses connections), so only the wheelhouse can provide the wheels. An image's
unpacked copy with a corrupt wheel is fetched again from the store; a store copy that does not
match its sha256 is one boot-log line, then the index, whose failure fails the boot clearly. An
image baked with deployments/image/bake-wheelhouse.sh installs only the run's wheel at boot. The
lock is a two-package subset (tests/infra/fleet/test_wheelhouse.py), not torch."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from infra.fleet import code_bundle, wheelhouse
from infra.providers.bootstrap import WorkerBootstrap
from infra.providers.interface import BootFile, BootPlan
from infra.providers.startup import (
    FAILED_PREFIX,
    LOCK_ENV,
    LOCK_MARKER,
    WHEEL_ENV,
    WHEELHOUSE_ENV,
    render_startup_script,
)
from tests.helpers import REPO_ROOT
from tests.infra.fleet.test_code_bundle import gcp_pool
from tests.infra.fleet.test_wheelhouse import SMALL_LOCK

pytestmark = pytest.mark.integration

NO_INDEX = {
    "PATH": "/usr/bin:/bin",
    "PIP_CONFIG_FILE": os.devnull,  # not this machine's pip.conf (its local index and find-links)
    "PIP_INDEX_URL": "http://127.0.0.1:9/simple",  # the discard port: nothing answers
    "PIP_RETRIES": "0",
    "PIP_TIMEOUT": "2",
}


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The run's stand-in wheel, the small lock and its wheelhouse, uploaded to a file:// store."""
    root = tmp_path_factory.mktemp("ship")
    project = root / "standin"
    (project / "rlboost_standin").mkdir(parents=True)
    (project / "rlboost_standin" / "__init__.py").write_text("")
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "rlboost-standin"\nversion = "0.1.0"\n'
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(root),
            str(project),
        ],
        check=True,
    )
    [wheel] = root.glob("*.whl")
    lock = root / "requirements-gcp.txt"
    lock.write_text(SMALL_LOCK)
    archive = wheelhouse.pack(wheelhouse.build(lock, root / "cache"))
    store = (root / "store").as_uri()
    files = tuple(
        code_bundle.upload(path, store, None, env=env)
        for path, env in ((wheel, WHEEL_ENV), (lock, LOCK_ENV), (archive, WHEELHOUSE_ENV))
    )
    return files, root / "store"


def boot(files, tmp_path: Path, instance: str) -> subprocess.CompletedProcess:
    """Boot `instance` on an image with a bare venv (nothing preinstalled), up to its worker."""
    install_dir = tmp_path / "opt"
    if not (install_dir / "venv").exists():
        subprocess.run([sys._base_executable, "-m", "venv", str(install_dir / "venv")], check=True)
    script = render_startup_script(
        WorkerBootstrap(install_dir=str(install_dir)),
        pool=gcp_pool(),
        instance_id=instance,
        run_id="r",
        watcher="gce",
        plan=BootPlan(files=files),
    )
    script = script.split("rlboost_log 'starting the Prefect worker")[0] + "exit 0\n"
    env = {**NO_INDEX, "HOME": str(tmp_path)}
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=300)


def installed(tmp_path: Path) -> dict[str, str]:
    """Distribution -> version in the VM's venv."""
    python = tmp_path / "opt" / "venv" / "bin" / "python"
    listing = subprocess.run(
        [
            str(python),
            "-c",
            "import json; from importlib import metadata as m; print(json.dumps({d.name: d.version for d in m.distributions()}))",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(listing)


def test_a_boot_installs_the_lock_from_the_wheelhouse_with_no_index_and_once(shipped, tmp_path):
    files, _ = shipped
    done = boot(files, tmp_path, "l4-spot-1")

    assert done.returncode == 0, done.stderr
    wheelhouse_home = tmp_path / "opt" / "wheelhouse" / files[2].sha256
    assert f"installing the locked dependencies from the wheelhouse {wheelhouse_home}, with no index" in done.stderr
    versions = installed(tmp_path)
    assert versions["cachetools"] == "7.3.3" and versions["mdurl"] == "0.1.2" and "rlboost-standin" in versions
    lock_sha = hashlib.sha256(SMALL_LOCK.encode()).hexdigest()
    assert (tmp_path / "opt" / "venv" / LOCK_MARKER).read_text().strip() == lock_sha
    assert not (tmp_path / "opt" / "boot" / files[2].name).exists(), "the archive is deleted once unpacked"

    again = boot(files, tmp_path, "l4-spot-1")  # GCE reruns the startup script at every boot
    assert again.returncode == 0, again.stderr
    assert "installing" not in again.stderr, "the venv holds the lock and the wheel already"


def test_an_images_wheelhouse_with_a_corrupt_wheel_is_fetched_again_from_the_store(shipped, tmp_path):
    files, store = shipped
    baked = tmp_path / "opt" / "wheelhouse" / files[2].sha256  # as the image recipe unpacks it
    baked.mkdir(parents=True)
    with tarfile.open(store / "code" / files[2].sha256 / files[2].name) as tar:
        tar.extractall(baked)
    [victim] = baked.glob("cachetools-*.whl")
    victim.write_bytes(b"not a wheel")
    done = boot(files, tmp_path, "l4-spot-2")

    assert done.returncode == 0, done.stderr
    [line] = [line for line in done.stderr.splitlines() if "fails its SHA256SUMS" in line]
    assert (
        line
        == f"rlboost boot: the wheelhouse in {baked} fails its SHA256SUMS ({victim.name}: FAILED): fetching it again from the store"
    )
    assert installed(tmp_path)["cachetools"] == "7.3.3"


def test_a_store_wheelhouse_that_fails_its_sha256_falls_back_to_the_index_and_says_so(shipped, tmp_path):
    files, store = shipped
    corrupt = tmp_path / "store" / files[2].name
    corrupt.parent.mkdir()
    corrupt.write_bytes(b"someone else's archive")
    replaced = (
        files[0],
        files[1],
        BootFile(files[2].name, corrupt.as_uri(), files[2].sha256, WHEELHOUSE_ENV),
    )
    done = boot(replaced, tmp_path, "l4-spot-3")

    assert done.returncode == 1
    actual = hashlib.sha256(b"someone else's archive").hexdigest()
    assert (
        f"rlboost boot: the wheelhouse {corrupt.as_uri()} has sha256 {actual}, not the {files[2].sha256} the run "
        "published: installing the locked dependencies from the package index instead"
    ) in done.stderr.splitlines()
    [failed] = [line for line in done.stderr.splitlines() if line.startswith(FAILED_PREFIX)]
    assert "pip could not install the locked dependencies (requirements-gcp.txt)" in failed, "the index is unreachable"
    assert "cachetools" not in installed(tmp_path)


def test_an_image_baked_with_the_recipe_installs_only_the_runs_wheel_at_boot(shipped, tmp_path):
    files, store = shipped
    install_dir = tmp_path / "opt"
    baked = subprocess.run(
        [
            str(REPO_ROOT / "deployments" / "image" / "bake-wheelhouse.sh"),
            str(store / "code" / files[2].sha256 / files[2].name),
            str(store / "code" / files[1].sha256 / files[1].name),
            str(install_dir),
            sys._base_executable,
        ],
        env=NO_INDEX,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert baked.returncode == 0, baked.stderr
    done = boot(files, tmp_path, "l4-spot-4")

    assert done.returncode == 0, done.stderr
    assert "installing the locked dependencies" not in done.stderr, "the image's venv holds the lock"
    assert "installing rlboost_standin-0.1.0-py3-none-any.whl" in done.stderr
    assert installed(tmp_path)["cachetools"] == "7.3.3"


def test_a_plan_without_a_wheelhouse_says_the_boot_installs_from_the_index(shipped, tmp_path):
    files, _ = shipped
    script = render_startup_script(
        WorkerBootstrap(install_dir=str(tmp_path)),
        pool=gcp_pool(),
        instance_id="i",
        run_id="r",
        watcher="gce",
        plan=BootPlan(files=files[:2]),
    )
    assert "no wheelhouse in this boot plan: installing the locked dependencies from the package index" in script
    assert "--no-index" not in script
