"""Bad multi-node trainer settings (`trainer.nodes`, `trainer.rendezvous`, the channel's) are refused
before any work with one line naming the field and the fix; `rlboost trainer-node` refuses a bad
`--rendezvous` (exit 2) and, with no trainer group to join, ends within its join timeout (exit 3),
in one line each; torchrun's arguments for each side of the rendezvous; preflight refuses a
rendezvous or channel this machine cannot listen at."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infra.cli.app import app
from infra.run.config import ConfigError, load_config
from infra.run.preflight import PreflightError, preflight
from infra.services.ports import free_port
from rl.distributed.group import RankGroup
from rl.distributed.node import agent_command
from tests.helpers import save_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[3]
DEEPSPEED = {"trainer.backend": "deepspeed", "trainer.world_size": 2}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"trainer.nodes": 0}, r"trainer.nodes: Input should be greater than or equal to 1"),
        ({**DEEPSPEED, "trainer.nodes": 2}, r"trainer.nodes=2 needs trainer.rendezvous: host:port"),
        ({"trainer.nodes": 2, "trainer.rendezvous": "h:29400"}, r"trainer.nodes=2 needs trainer.backend: deepspeed"),
        (
            {**DEEPSPEED, "trainer.rendezvous": "10.0.0.5:29400"},
            r"trainer.rendezvous is only used when trainer.nodes > 1",
        ),
        ({**DEEPSPEED, "trainer.channel_port": 29500}, r"trainer.channel_port is only used when trainer.nodes > 1"),
        (
            {**DEEPSPEED, "trainer.nodes": 2, "trainer.rendezvous": "10.0.0.5"},
            r"trainer.rendezvous='10.0.0.5' is not host:port",
        ),
        (
            {**DEEPSPEED, "trainer.nodes": 2, "trainer.rendezvous": ":29400"},
            r"trainer.rendezvous=':29400' is not host:port",
        ),
        (
            {**DEEPSPEED, "trainer.nodes": 4, "trainer.rendezvous": "h:1"},
            r"trainer.world_size=2 is not a multiple of trainer.nodes=4",
        ),
        ({**DEEPSPEED, "trainer.nodes": 2, "trainer.rendezvous": "h:1", "trainer.channel_port": 0}, r"channel_port"),
    ],
)
def test_bad_node_settings_name_the_field_and_the_fix(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, overrides)


def test_good_node_settings_and_the_ranks_of_each_node():
    trainer = load_config(
        None,
        {
            "trainer.backend": "deepspeed",
            "trainer.world_size": 4,
            "trainer.nodes": 2,
            "trainer.rendezvous": "[::1]:29400",
        },
    ).trainer
    assert trainer.ranks_per_node == 2 and trainer.channel_host is None
    group = RankGroup(4, Path("ranks.log"), 60.0, {}, nodes=2, rendezvous=trainer.rendezvous, rendezvous_id="run-a")
    assert group.channel_host == "::1"  # the rendezvous host, by default
    driver = group._launch_arguments()
    node = agent_command("[::1]:29400", "run-a", 2, 2, 30.0, None)
    shared = [
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=[::1]:29400",
        "--rdzv-id=run-a",
    ]
    for arguments in (driver, node):
        assert all(argument in arguments for argument in [*shared, "--max-restarts=0"])
    assert "--rdzv-conf=is_host=true,join_timeout=60" in driver  # the driver's node hosts the store
    assert "--rdzv-conf=is_host=false,join_timeout=30" in node
    assert RankGroup(1, Path("ranks.log"), 60.0, {})._launch_arguments()[0] == "--standalone"


def test_trainer_node_refuses_a_bad_rendezvous_in_one_line():
    result = CliRunner().invoke(app, ["trainer-node", "--rendezvous", "nohost", "--run-id", "r"])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == "--rendezvous='nohost' is not host:port (e.g. 10.0.0.5:29400)"


@pytest.mark.integration
def test_trainer_node_without_a_group_to_join_ends_in_one_line_within_its_join_timeout(tmp_path):
    rendezvous = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "infra.cli", "trainer-node", "--rendezvous", rendezvous, "--run-id", "r",
         "--join-timeout", "5", "--log-file", str(tmp_path / "node.log")],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
    )  # fmt: skip
    seconds = time.monotonic() - started
    print(f"trainer-node gave up after {seconds:.1f} s")
    assert done.returncode == 3, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith(f"no trainer group of run 'r' at {rendezvous} within 5 s (--join-timeout)")
    assert "Traceback" not in done.stdout + done.stderr
    assert seconds < 40


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("nodes-preflight") / "base")


def test_preflight_refuses_a_rendezvous_or_channel_this_machine_cannot_host(tiny_model, tmp_path):
    def checked(**trainer) -> None:
        overrides = {"model.path": str(tiny_model), "run.output_dir": str(tmp_path), **DEEPSPEED, "trainer.nodes": 2}
        preflight(load_config(None, overrides | {f"trainer.{key}": value for key, value in trainer.items()}))

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(
            PreflightError, match=rf"trainer.rendezvous: this machine cannot listen at 127.0.0.1:{busy} "
        ):
            checked(rendezvous=f"127.0.0.1:{busy}")
        with pytest.raises(PreflightError, match=rf"trainer.channel_port: .* at 127.0.0.1 port {busy} "):
            checked(rendezvous=f"127.0.0.1:{free_port()}", channel_port=busy)
    with pytest.raises(PreflightError, match=r"trainer.rendezvous: this machine cannot listen at 192.0.2.1:29400 \("):
        checked(rendezvous="192.0.2.1:29400")  # TEST-NET-1: no machine's address
    with pytest.raises(PreflightError, match=r"trainer.channel_host: .* at 192.0.2.1 port any"):
        checked(rendezvous=f"127.0.0.1:{free_port()}", channel_host="192.0.2.1")
    checked(rendezvous=f"127.0.0.1:{free_port()}")
