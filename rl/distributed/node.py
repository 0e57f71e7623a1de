"""Another node of a DeepSpeed trainer group: what `rlboost trainer-node` runs.

`serve_node` launches this node's torchrun agent (``torchrun --nnodes N --rdzv-backend c10d
--rdzv-endpoint <rendezvous> --rdzv-id <run id>``, `rl.distributed.group.node_arguments`), whose
ranks (`rl.distributed.rank`) find the training process's channel in torchrun's store. The agent's
output goes to `log_path`. When the agent exits 0 the training process closed the trainer: done.
When it fails (the group failed: a node or the training process died, a step failed) a new agent
joins again for the resumed run, until `join_timeout_s` pass without any of its ranks reaching a
training process (they touch a file, `TRAINER_NODE_JOINED`): then `NoTrainerGroup`. A stop of the
command (SIGTERM, SIGINT) ends the agent's process group first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rl.distributed.group import describe_exit, node_arguments
from rl.driver_watch import driver_environment
from rl.env_vars import TRAINER_NODE_JOINED

RETRY_S = 2.0
"""Pause between a failed agent and the next join."""
STOP_GRACE_S = 10.0
"""How long a stopped command's agent may take to stop its ranks before its group is killed."""


class NoTrainerGroup(RuntimeError):
    """No training process's trainer group was there to join within the join timeout."""


def agent_command(
    rendezvous: str, run_id: str, nodes: int, nproc_per_node: int, join_timeout_s: float, local_addr: str | None
) -> list[str]:
    """This node's torchrun agent (it does not host the rendezvous store: the driver's node does)."""
    arguments = node_arguments(nodes, nproc_per_node, rendezvous, run_id, is_host=False, join_timeout_s=join_timeout_s)
    if local_addr:
        arguments.append(f"--local-addr={local_addr}")
    return [sys.executable, "-m", "rl.distributed.agent", *arguments, "-m", "rl.distributed.rank"]


def serve_node(
    rendezvous: str,
    run_id: str,
    *,
    nodes: int,
    nproc_per_node: int,
    join_timeout_s: float,
    log_path: Path,
    local_addr: str | None = None,
    environment: dict[str, str] | None = None,
    say: Callable[[str], None] = print,
) -> int:
    """Join the run's trainer group until the training process closes it (returns 0); see the
    module docstring. Raises `NoTrainerGroup` after `join_timeout_s` without a group."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    marker_dir = tempfile.mkdtemp(prefix="rlboost-node-")
    joined = Path(marker_dir) / "joined"
    # The agent and its ranks end with this command (`rl.distributed.agent`, `rl.driver_watch`).
    env = {**os.environ, **(environment or {}), TRAINER_NODE_JOINED: str(joined), **driver_environment()}
    last_group = time.monotonic()
    agent: subprocess.Popen | None = None
    previous = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            remaining = join_timeout_s - (time.monotonic() - last_group)
            if remaining <= 0:
                raise NoTrainerGroup(
                    f"no trainer group of run {run_id!r} at {rendezvous} within {join_timeout_s:.0f} s (--join-timeout): "
                    f"is `rlboost train` running with trainer.nodes={nodes} and trainer.rendezvous={rendezvous}? "
                    f"Agent output: {log_path}"
                )
            command = agent_command(rendezvous, run_id, nodes, nproc_per_node, remaining, local_addr)
            with open(log_path, "ab") as log:
                agent = subprocess.Popen(
                    command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
            say(f"trainer node: agent {agent.pid} joining run {run_id} at {rendezvous} ({nproc_per_node} ranks)")
            code = _wait(agent, joined, deadline=last_group + join_timeout_s)
            if code is None:  # still no group at the deadline: the next turn says so
                _end(agent)
                continue
            if joined.exists():  # it was in a group: the timeout counts from the group's end
                last_group = time.monotonic()
                joined.unlink()
            if code == 0:
                say("trainer node: the training process closed the trainer; done")
                return 0
            say(f"trainer node: the group ended (agent {describe_exit(code)}); joining again for the resumed run")
            time.sleep(RETRY_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if agent is not None:
            _end(agent)
        joined.unlink(missing_ok=True)
        os.rmdir(marker_dir)


def _wait(agent: subprocess.Popen, joined: Path, deadline: float) -> int | None:
    """The agent's exit status; None if it has not joined a group (`joined` absent) by `deadline`."""
    while True:
        try:
            return agent.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline and not joined.exists():
                return None


def _exit_on_signal(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def _end(agent: subprocess.Popen) -> None:
    """Stop a running agent (it stops its ranks), then kill its process group."""
    if agent.poll() is None:
        try:
            os.killpg(agent.pid, signal.SIGTERM)
            agent.wait(STOP_GRACE_S)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(agent.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    agent.wait()
