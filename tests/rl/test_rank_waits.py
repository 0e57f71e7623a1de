"""No wait on the DeepSpeed ranks is silent or endless, with real ranks under torchrun:

* a rank that does not start (stopped by SIGSTOP as soon as it exists): the start's deadline
  (`trainer.start_timeout_s`) says so, and no rank is left;
* ranks die with their torchrun agent when it is SIGKILLed (their driver stopped meanwhile);
* a process that calls `die_with_parent` dies with its parent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rl.config import GRPOConfig, OptimConfig, TrainerConfig
from rl.distributed.group import RankFailure, child_pids
from rl.distributed.protocol import TrainSpec
from rl.distributed.trainer import DistributedTrainer
from rl.models import load_model
from tests.helpers import REPO_ROOT, cmdline, process_state, save_tiny_model, wait_for

pytestmark = pytest.mark.integration


def _gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie waiting for its reaper counts as gone)."""
    return process_state(pid) in (None, "Z", "X")


# -- the lock logic, on plain files and processes ------------------------------------------


def test_a_process_that_dies_with_its_parent_dies_when_the_parent_is_killed(tmp_path):
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import subprocess, sys, time
                child = subprocess.Popen([sys.executable, "-c", "from rl.driver_watch import die_with_parent; "
                    "die_with_parent(); print('set', flush=True); import time; time.sleep(600)"],
                    stdout=subprocess.PIPE, text=True)
                assert child.stdout.readline().strip() == "set"
                print(child.pid, flush=True)
                time.sleep(600)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert not _gone(child)
    parent.kill()
    parent.wait()
    wait_for(lambda: _gone(child), "the child to die with its parent", timeout_s=5)


# -- real ranks ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("waits") / "base")


def _spec(model_dir: Path, start_timeout_s: float = 600.0) -> TrainSpec:
    return TrainSpec(
        model_path=model_dir,
        device="cpu",
        pad_token_id=load_model(model_dir)[1].pad_token_id,
        temperature=1.0,
        grpo=GRPOConfig(),
        optim=OptimConfig(micro_batch_size=2),
        trainer=TrainerConfig(backend="deepspeed", world_size=2, threads_per_rank=1, start_timeout_s=start_timeout_s),
    )


def _ranks_of(pid: int) -> list[int]:
    """The trainer ranks that process `pid` started: the children of its torchrun agents, its
    children, or its grandchildren where they were forked from its agent template."""
    near = child_pids(pid)
    near += [grandchild for child in near for grandchild in child_pids(child)]
    agents = [process for process in near if b"rl.distributed.agent" in cmdline(process)]
    return [rank for agent in agents for rank in child_pids(agent) if b"rl.distributed.rank" in cmdline(rank)]


def test_the_start_deadline_names_the_ranks_that_did_not_start_and_leaves_none(model_dir, tmp_path):
    """A rank stopped (SIGSTOP) as soon as it exists: the start ends at `trainer.start_timeout_s`
    saying so, and no rank is left."""
    stopped: list[int] = []

    def stop_a_rank() -> None:
        wait_for(lambda: bool(_ranks_of(os.getpid())), "a rank to start", timeout_s=60)
        stopped.append(_ranks_of(os.getpid())[0])
        os.kill(stopped[0], signal.SIGSTOP)

    stopper = threading.Thread(target=stop_a_rank, daemon=True)
    stopper.start()
    started = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        DistributedTrainer(_spec(model_dir, start_timeout_s=25), tmp_path / "ranks.log")
    stopper.join()
    print(failure.value)
    assert time.monotonic() - started < 60
    message = str(failure.value)
    assert "within 25 s (trainer.start_timeout_s)" in message, message  # to connect, or to answer `init`
    wait_for(lambda: _gone(stopped[0]) and not _ranks_of(os.getpid()), "no rank left", timeout_s=10)


@pytest.mark.parametrize("fork_ranks", [False, True], ids=["fresh", "forked"])
def test_ranks_die_with_their_killed_agent(model_dir, tmp_path, fork_ranks):
    """The driver is stopped (SIGSTOP) before the agent is killed, so nothing of it can stop the
    ranks: they die because their agent did. Ranks forked from their agent (on CPU) show the
    command line a fresh one has."""
    spec = _spec(model_dir).model_dump_json()
    code = textwrap.dedent(
        f"""
        import threading, time
        from pathlib import Path
        from rl.distributed.group import RankGroup
        group = RankGroup(2, Path({str(tmp_path / "ranks.log")!r}), 300.0, {{"DS_ACCELERATOR": "cpu"}}, fork_ranks={fork_ranks})
        import json
        threading.Thread(target=group.start, args=(json.loads({spec!r}),), daemon=True).start()
        while len(group.pids) < 2:
            time.sleep(0.05)
        print(group.process.pid, *group.pids.values(), flush=True)
        time.sleep(600)
        """
    )
    driver = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        assert driver.stdout is not None
        agent, *ranks = (int(pid) for pid in driver.stdout.readline().split())
        assert len(ranks) == 2
        assert not any(_gone(pid) for pid in [agent, *ranks])
        fresh = f"{sys.executable} -u -m rl.distributed.rank".encode()  # what torchrun starts
        assert all(cmdline(rank).replace(b"\0", b" ").split() == fresh.split() for rank in ranks)
        os.kill(driver.pid, signal.SIGSTOP)  # the driver can do nothing now (and the ranks see it alive)
        os.kill(agent, signal.SIGKILL)  # the agent alone: each rank runs in a session of its own
        wait_for(lambda: all(_gone(pid) for pid in ranks), "every rank to die with its agent", timeout_s=5)
    finally:
        driver.kill()
        driver.wait()
