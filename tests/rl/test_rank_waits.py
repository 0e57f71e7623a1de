"""No wait on the DeepSpeed ranks is silent or endless, with real ranks under torchrun and torch's
own extension build lock (`torch.utils.file_baton.FileBaton`, in a temporary `TORCH_EXTENSIONS_DIR`
holding a copy of the built communication op):

* a lock left by a build that was stopped (no process holds it) is cleared: the ranks start, well
  within a minute, and the warning names the file;
* a lock a live build holds is kept, and the start's deadline names it and its holder;
* ranks waiting on that lock die with their torchrun agent when it is SIGKILLed;
* the lock logic itself (`rl.distributed.build_lock`), on plain files and processes, and a process
  that calls `die_with_parent` dies with its parent.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rl.config import GRPOConfig, OptimConfig, TrainerConfig
from rl.distributed import build_lock
from rl.distributed.group import RankFailure
from rl.distributed.protocol import TrainSpec
from rl.distributed.trainer import DistributedTrainer
from rl.models import load_model
from tests.helpers import REPO_ROOT, save_tiny_model, wait_for

pytestmark = pytest.mark.integration

OP = "deepspeed_shm_comm"
"""The op each rank on CPU JIT-builds (DeepSpeed's shared-memory communication op)."""


def _holder(lock: Path) -> subprocess.Popen:
    """A process that takes `lock` as torch's FileBaton does (O_EXCL, the descriptor kept open) and
    holds it: a build in progress."""
    code = (
        f"import os, time; os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL); print('held', flush=True); time.sleep(600)"
    )
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    return process


def _gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


# -- the lock logic, on plain files and processes ------------------------------------------


def test_a_lock_nobody_holds_is_stale_and_cleared_and_a_held_one_is_kept(tmp_path):
    stale, held = tmp_path / "a" / "lock", tmp_path / "b" / "lock"
    stale.parent.mkdir(), held.parent.mkdir()
    stale.touch()
    holder = _holder(held)
    try:
        locks = {lock.path: lock for lock in build_lock.build_locks(tmp_path)}
        assert locks[stale].stale and locks[stale].holders == ()
        assert not locks[held].stale and locks[held].holders == (holder.pid,)
        assert build_lock.clear_stale(tmp_path, confirm_s=0.01) == [stale]
        assert not stale.exists() and held.exists()
        assert build_lock.describe(build_lock.build_locks(tmp_path)) == (
            f"the extension build lock {held} is held by pid {holder.pid} (a build in progress)"
        )
    finally:
        holder.kill()
        holder.wait()
    assert build_lock.clear_stale(tmp_path, confirm_s=0.01) == [held]  # its builder died without releasing it


def test_a_lock_released_or_taken_again_between_the_two_looks_is_not_deleted(tmp_path):
    """The first look finds the lock unheld because its builder is releasing it (closed, not yet
    deleted); by the second look it is gone, or another builder holds a new one: nothing is deleted."""
    lock = tmp_path / "op" / "lock"
    lock.parent.mkdir()
    lock.touch()
    assert build_lock.clear_stale(tmp_path, sleep=lambda _s: lock.unlink()) == []
    lock.touch()
    holders: list[subprocess.Popen] = []

    def taken_again(_seconds: float) -> None:
        lock.unlink()
        holders.append(_holder(lock))

    try:
        assert build_lock.clear_stale(tmp_path, sleep=taken_again) == []
        assert lock.exists()
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()


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
def built_op() -> Path:
    """The build directory of DeepSpeed's communication op in torch's extension cache, built there
    if it is not yet (the first build on a machine takes 64-110 s: every DeepSpeed test pays it once)."""
    code = (
        "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; import os; "
        "print(os.path.dirname(ShareMemCommBuilder().load().__file__))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def extensions(tmp_path, built_op) -> Path:
    """A `TORCH_EXTENSIONS_DIR` holding a copy of the built op (its build is up to date: no compile)."""
    root = tmp_path / "torch-extensions"
    shutil.copytree(built_op, root / OP, ignore=shutil.ignore_patterns("lock"))
    return root


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


def test_ranks_start_past_a_lock_left_by_a_stopped_build(model_dir, extensions, tmp_path, caplog):
    lock = extensions / OP / "lock"
    lock.touch()  # what a build stopped by Ctrl-C leaves: the file, no process holding it
    caplog.set_level(logging.WARNING, logger="rl.distributed.group")
    started = time.monotonic()
    trainer = DistributedTrainer(
        _spec(model_dir, start_timeout_s=60),
        tmp_path / "ranks.log",
        environment={"TORCH_EXTENSIONS_DIR": str(extensions)},
    )
    try:
        seconds = time.monotonic() - started
        print(f"the ranks started in {seconds:.1f} s past a stale build lock")
        assert seconds < 60
        assert len(trainer.ranks) == 2 and trainer.policy_state()
    finally:
        trainer.close()
    assert not lock.exists()
    assert f"removed {lock}: a torch extension build lock that no live process holds" in caplog.text


def test_the_start_deadline_names_the_build_lock_the_ranks_wait_on(model_dir, extensions, tmp_path):
    lock = extensions / OP / "lock"
    holder = _holder(lock)
    try:
        started = time.monotonic()
        with pytest.raises(RankFailure) as failure:
            DistributedTrainer(
                _spec(model_dir, start_timeout_s=25),
                tmp_path / "ranks.log",
                environment={"TORCH_EXTENSIONS_DIR": str(extensions)},
            )
        print(failure.value)
        assert time.monotonic() - started < 60
        message = str(failure.value)
        assert "within 25 s (trainer.start_timeout_s)" in message, message  # to connect, or to answer `init`
        assert f"the extension build lock {lock} is held by pid {holder.pid} (a build in progress)" in message
        assert lock.exists()  # a live build's lock is never taken from it
    finally:
        holder.kill()
        holder.wait()


def test_ranks_waiting_on_a_build_die_with_their_killed_agent(model_dir, extensions, tmp_path):
    """The driver is stopped (SIGSTOP) before the agent is killed, so nothing of it can stop the
    ranks: they die because their agent did."""
    holder = _holder(extensions / OP / "lock")  # the ranks wait for it once they have the spec
    spec = _spec(model_dir).model_dump_json()
    code = textwrap.dedent(
        f"""
        import threading, time
        from pathlib import Path
        from rl.distributed.group import RankGroup
        group = RankGroup(2, Path({str(tmp_path / "ranks.log")!r}), 300.0,
                          {{"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": {str(extensions)!r}}})
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
        time.sleep(2)  # they have the spec and wait on the lock
        assert not any(_gone(pid) for pid in [agent, *ranks])
        os.kill(driver.pid, signal.SIGSTOP)  # the driver can do nothing now (and the ranks see it alive)
        os.kill(agent, signal.SIGKILL)  # the agent alone: each rank runs in a session of its own
        wait_for(lambda: all(_gone(pid) for pid in ranks), "every rank to die with its agent", timeout_s=5)
    finally:
        driver.kill()
        driver.wait()
        holder.kill()
        holder.wait()
