"""A run's own code outside the project: which modules it is, the `PYTHONPATH` of local instances,
the archive cloud VMs get (the same bytes for the same files), and the boot script's lines that
unpack it onto a VM's `PYTHONPATH`, run with bash."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.fleet.code_bundle import pack_user_code, sha256_of
from infra.providers.interface import BootFile, BootPlan
from infra.providers.startup import USER_CODE_ENV, _user_code_lines
from infra.run.config import parse_config
from infra.run.user_code import import_paths, modules_of, python_path, user_code


@pytest.fixture
def user_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A package `uc_envs_37` (with a subpackage and a stale .pyc) and a module `uc_rewards_37`."""
    source = tmp_path / "src"
    (source / "uc_envs_37" / "sub").mkdir(parents=True)
    (source / "uc_envs_37" / "__init__.py").write_text("from uc_envs_37.sub import VALUE\n")
    (source / "uc_envs_37" / "sub" / "__init__.py").write_text("VALUE = 37\n")
    (source / "uc_envs_37" / "__pycache__").mkdir()
    (source / "uc_envs_37" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"stale")
    (source / "uc_rewards_37.py").write_text("def score(response, answer):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(source))
    yield source
    for name in [n for n in sys.modules if n.startswith(("uc_envs_37", "uc_rewards_37"))]:
        del sys.modules[name]  # the next test imports its own copy


def test_the_runs_own_modules_are_those_outside_the_project_and_installed_packages(user_source: Path) -> None:
    paths = ["uc_envs_37.sub:VALUE", "uc_rewards_37:score", "rl.rewards:boxed_reward", "yaml:safe_load", "json:loads"]
    assert modules_of(paths) == {
        "uc_envs_37": user_source / "uc_envs_37",
        "uc_rewards_37": user_source / "uc_rewards_37.py",
    }
    config = parse_config(
        "reward:\n  function: uc_rewards_37:score\nenvironment:\n  class: rl.environments.calculator:Calculator\n"
        "fabric:\n  enabled: true\n"
    )
    assert import_paths(config) == ["uc_rewards_37:score", "rl.environments.calculator:Calculator"]
    assert user_code(config) == {"uc_rewards_37": user_source / "uc_rewards_37.py"}
    assert user_code(parse_config("")) == {}


def test_local_instances_get_the_modules_directories_first_on_their_pythonpath(user_source: Path) -> None:
    modules = modules_of(["uc_envs_37:VALUE", "uc_rewards_37:score"])
    assert python_path(modules, None) == str(user_source)
    assert python_path(modules, "/elsewhere") == os.pathsep.join([str(user_source), "/elsewhere"])
    assert python_path({}, "/elsewhere") is None


def test_the_archive_holds_each_module_under_its_name_and_is_the_same_bytes_each_time(
    user_source: Path, tmp_path: Path
) -> None:
    modules = modules_of(["uc_envs_37:VALUE", "uc_rewards_37:score"])
    first = pack_user_code(modules, tmp_path / "a")
    second = pack_user_code(modules, tmp_path / "b")
    assert sha256_of(first) == sha256_of(second)
    with tarfile.open(first) as archive:
        assert archive.getnames() == ["uc_envs_37/__init__.py", "uc_envs_37/sub/__init__.py", "uc_rewards_37.py"]


def test_the_boot_unpacks_the_modules_once_and_the_vms_python_imports_them(user_source: Path, tmp_path: Path) -> None:
    archive = pack_user_code(modules_of(["uc_envs_37:VALUE", "uc_rewards_37:score"]), tmp_path / "code")
    shipped = BootFile(archive.name, archive.as_uri(), sha256_of(archive), USER_CODE_ENV)
    root = tmp_path / "opt"
    lines = _user_code_lines(BootPlan(files=(shipped,)), str(root))
    check = f"{sys.executable} -c 'import uc_envs_37, uc_rewards_37; print(uc_envs_37.VALUE)'"
    script = "\n".join(["set -euo pipefail", 'rlboost_fail() { echo "$1" >&2; exit 1; }', *lines, check])
    environment = {"PATH": os.environ["PATH"], USER_CODE_ENV: str(archive)}  # no PYTHONPATH of the test's
    for _ in range(2):  # a second boot of the VM finds it unpacked
        done = subprocess.run(["bash", "-c", script], env=environment, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout.strip() == "37", done.stderr
    assert sorted(p.name for p in (root / "user-code").iterdir()) == [shipped.sha256]
    assert _user_code_lines(BootPlan(), str(root)) == []
