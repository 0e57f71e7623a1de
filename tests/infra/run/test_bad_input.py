"""Bad input from the command line gets one line naming the field or argument and the fix, exit
status 2, before any work: an unsafe run name, a `--set` without `=`, a run directory on a disk
that is full from the start; and a disk that fills during the run ends it with one line, exit 2."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from infra.cli.app import app
from infra.run.config import ConfigError, load_config


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".hidden", "", "with space"])
def test_a_run_name_that_is_not_one_directory_name_is_refused(name):
    with pytest.raises(ConfigError, match=r"override run.name: run.name: .*letters, digits, '.', '_' and '-'"):
        load_config(None, {"run.name": name})


def test_a_safe_run_name_is_kept():
    assert load_config(None, {"run.name": "grpo_v2.1-b"}).run.directory.name == "grpo_v2.1-b"


@pytest.mark.parametrize("argument", ["run.steps", "=3"])
def test_set_without_key_equals_value_names_the_argument(argument):
    result = CliRunner().invoke(app, ["train", "--set", argument])
    assert result.exit_code == 2, result.output
    assert f"--set {argument!r}: expected key=value, e.g. --set run.steps=20" in result.output
    assert "Traceback" not in result.output


@pytest.mark.integration
def test_rlboost_train_on_a_full_disk_stops_with_one_line_and_exit_2(tmp_path):
    """The run directory lies on a small file system (a tmpfs in a private mount namespace): the
    run stops with one line naming what it was writing and the free space, exit status 2."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers import as_set_flags, on_a_small_disk, save_tiny_model, tiny_run

    model = save_tiny_model(tmp_path / "base")
    disk = tmp_path / "disk"
    overrides = {
        "run.output_dir": str(disk),
        "run.checkpoint_every": 1,
        "fabric.enabled": False,
        "rollout.group_size": 2,
        "eval.size": None,
        "eval.every": 100,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120")
    command = [
        sys.executable,
        "-m",
        "infra.cli",
        "train",
        *as_set_flags(tiny_run(model, tmp_path, "full", 3, overrides)),
    ]
    done = subprocess.run(
        on_a_small_disk(disk, "256k", command),
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).parents[3],
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-4000:]
    assert "no space left on the device" in done.stdout and "free of 256.0 kB" in done.stdout, done.stdout
    assert "Traceback" not in output, output[-4000:]


def test_rlboost_train_on_a_disk_full_from_the_start_is_refused_before_any_work(tmp_path):
    """The run directory lies on a file system with no space left before the run writes anything
    (a 2 MB tmpfs, filled): one line naming the path and its free space, exit status 2, in a second
    or two, and nothing written there."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers import as_set_flags, on_a_small_disk, tiny_run

    disk = tmp_path / "disk"
    overrides = {"run.output_dir": str(disk), "fabric.enabled": False}
    train = [
        sys.executable,
        "-m",
        "infra.cli",
        "train",
        *as_set_flags(tiny_run(tmp_path / "base", tmp_path, "full", 1, overrides)),
    ]
    fill_then_train = [
        "sh",
        "-c",
        'cat /dev/zero > "$0/filler" 2>/dev/null; "$@"; code=$?; ls -A "$0"; exit $code',
        str(disk),
    ]
    done = subprocess.run(
        on_a_small_disk(disk, "2m", [*fill_then_train, *train]),
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
        cwd=Path(__file__).parents[3],
    )
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    run = disk / "full"
    assert done.returncode == 2, lines
    assert lines == [
        "cannot start the run",
        f"run.output_dir: no space left on the device for the run directory {run}: 0 B free of 2.0 MB on the file "
        f"system of {run}. Free some space, or set run.output_dir on a larger disk",
        "filler",  # the disk holds nothing else: no run directory, no log
    ]
