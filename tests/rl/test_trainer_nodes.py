"""The DeepSpeed trainer over two "nodes" on loopback: the training process's RankGroup (node 0)
and a real `rlboost trainer-node` process (node 1), one rank each, gloo. One step matches the
torch trainer's; closing the trainer ends the node command with 0; a node's agent SIGKILLed
mid-step fails the step naming node 1, leaves no rank or agent behind, and the same trainer-node
joins the re-run, which resumes from the checkpoint exactly; a node with another number of ranks is
refused naming the option; the driver's agent ends with the driver while it waits for the nodes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.services.ports import free_port
from rl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from rl.config import TrainerConfig
from rl.distributed.group import RankFailure, child_pids
from rl.distributed.protocol import TrainSpec
from rl.distributed.trainer import DistributedTrainer
from rl.models import load_model
from tests.helpers import cmdline, save_tiny_model, tiny_shape, wait_for
from tests.rl.test_distributed_trainer import GRPO, OPTIM, alive, max_difference, random_batch, torch_trainer

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "two-node-test"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("nodes") / "base", tiny_shape())


@pytest.fixture
def rendezvous() -> str:
    return f"127.0.0.1:{free_port()}"


def start_node(rendezvous: str, log: Path, nproc_per_node: int = 1) -> subprocess.Popen:
    """`rlboost trainer-node` as an operator starts it on the second machine."""
    return subprocess.Popen(
        [sys.executable, "-m", "infra.cli", "trainer-node", "--rendezvous", rendezvous, "--run-id", RUN_ID,
         "--nproc-per-node", str(nproc_per_node), "--join-timeout", "120", "--log-file", str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip


def two_nodes(model_dir: Path, tmp_path: Path, rendezvous: str) -> DistributedTrainer:
    trainer = TrainerConfig(
        backend="deepspeed", world_size=2, nodes=2, rendezvous=rendezvous, threads_per_rank=1, start_timeout_s=180
    )
    spec = TrainSpec(
        model_path=model_dir,
        device="cpu",
        pad_token_id=load_model(model_dir)[1].pad_token_id,
        temperature=1.0,
        grpo=GRPO,
        optim=OPTIM,
        trainer=trainer,
    )
    return DistributedTrainer(spec, tmp_path / "ranks.log", rendezvous_id=RUN_ID)


def test_a_node_of_another_size_is_refused_naming_the_option_to_give(model_dir, tmp_path, rendezvous):
    node = start_node(rendezvous, tmp_path / "node1.log", nproc_per_node=2)  # the run has 1 rank per node
    try:
        with pytest.raises(RankFailure, match=r"node 1 \(host \S+\) joined a group of 3 ranks.*--nproc-per-node 1"):
            two_nodes(model_dir, tmp_path, rendezvous)
    finally:
        node.terminate()
        code, out = finish(node)
    assert code == 128 + signal.SIGTERM and "Traceback" not in out


def test_the_drivers_agent_ends_with_the_driver_while_it_waits_for_the_other_nodes(tmp_path, rendezvous):
    """No rank has started yet (node 1 never comes), so no rank's watchdog can end the agent: it ends by itself."""
    code = (
        "import time; from pathlib import Path; from rl.distributed.group import RankGroup; "
        f"group = RankGroup(2, Path({str(tmp_path / 'ranks.log')!r}), 300.0, {{'DS_ACCELERATOR': 'cpu'}}, "
        f"nodes=2, rendezvous={rendezvous!r}); group.start({{}})"
    )
    driver = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    )
    try:
        agents: list[int] = []

        def agent_started() -> bool:
            agents[:] = [pid for pid in child_pids(driver.pid) if b"rl.distributed.agent" in cmdline(pid)]
            return bool(agents)

        wait_for(agent_started, "the driver's torchrun agent", timeout_s=30)
        time.sleep(3)  # in the rendezvous, waiting for node 1
        driver.kill()
        driver.wait()
        wait_for(lambda: not alive(agents[0]), "the agent to end with its driver", timeout_s=10)
    finally:
        driver.kill()


def finish(node: subprocess.Popen, timeout_s: float = 60) -> tuple[int, str]:
    try:
        out, _ = node.communicate(timeout=timeout_s)
    finally:
        node.kill()
    return node.returncode, out


def test_two_nodes_take_the_torch_trainers_step_and_the_node_ends_with_the_trainer(model_dir, tmp_path, rendezvous):
    reference = torch_trainer(model_dir)
    want = reference.train_step(random_batch(seed=0))
    node = start_node(rendezvous, tmp_path / "node1.log")
    try:
        distributed = two_nodes(model_dir, tmp_path, rendezvous)
        try:
            places = distributed.group.places
            assert sorted(place.node for place in places.values()) == [0, 1]
            assert sum(place.local for place in places.values()) == 1
            got = distributed.train_step(random_batch(seed=0))
            assert max_difference(distributed.policy_state(), reference.policy_state()) <= 1e-5
            for key in ("loss", "kl", "grad_norm", "response_tokens"):
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
        finally:
            distributed.close()
        code, out = finish(node)
        assert code == 0, out
        assert "the training process closed the trainer; done" in out and "Traceback" not in out
    finally:
        node.kill()


def test_a_killed_node_fails_the_step_naming_it_and_the_rerun_resumes_with_the_same_node(
    model_dir, tmp_path, rendezvous
):
    root = tmp_path / "checkpoints"
    reference = torch_trainer(model_dir)
    for seed in (0, 1):
        reference.train_step(random_batch(seed=seed))
    node = start_node(rendezvous, tmp_path / "node1.log")
    try:
        first = two_nodes(model_dir, tmp_path, rendezvous)
        group = first.group
        remote = next(rank for rank, place in group.places.items() if not place.local)
        agent, launcher = group.places[remote].agent, group.process.pid
        pids = dict(group.pids)
        try:
            first.train_step(random_batch(seed=0))
            save_checkpoint(root, first, {"cursor": 1})
            first.begin_step()
            first.accumulate(random_batch(seed=1))
            os.kill(agent, signal.SIGKILL)  # node 1's torchrun agent, between two messages: its rank dies with it
            # Noticed at once, not at the next message (by then node 1 may have joined again, and
            # torchrun here would have restarted node 0's rank for it).
            wait_for(lambda: not group.alive, "the group to fail without a message in flight", timeout_s=10)
            message = rf"trainer node 1 \(host \S+, rank {remote}, pid {pids[remote]}\) failed during 'idle'"
            with pytest.raises(RankFailure, match=message) as failure:
                first.finish_step()
            print(failure.value)
        finally:
            first.close()
        gone = [*pids.values(), agent, launcher]
        wait_for(lambda: not any(alive(pid) for pid in gone), "every rank and agent of the failed group to end")
        assert node.poll() is None  # the operator's command waits for the re-run

        resumed = two_nodes(model_dir, tmp_path, rendezvous)  # the driver run again
        try:
            assert load_checkpoint(latest_checkpoint(root), resumed) == {"cursor": 1}
            resumed.train_step(random_batch(seed=1))
            assert max_difference(resumed.policy_state(), reference.policy_state()) <= 1e-5
            second = [*resumed.group.pids.values(), resumed.group.places[remote].agent]
        finally:
            resumed.close()
        code, out = finish(node)
        assert code == 0, out
        assert out.count("joining run") == 2 and "Traceback" not in out
        assert not any(alive(pid) for pid in second)
    finally:
        node.kill()
