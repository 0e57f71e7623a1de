"""The training process's side of the DeepSpeed trainer: launching its ranks, talking to them,
and telling what happened when one dies.

`RankGroup.start` creates the channel (`rl.distributed.protocol`), launches ``torchrun
--standalone --nproc-per-node N -m rl.distributed.rank`` as a process group of its own with its
output in `log_path` (on CPU the agent forks the ranks: `rl.distributed.agent`), waits for every rank's hello, and sends each the `TrainSpec`. `call(op,
payloads)` sends one message to every rank and gathers every reply, watching torchrun while it
waits, up to a deadline (the start's, or `reply_timeout_s`) whose failure names the message and the
ranks silent. When a rank's channel closes, or torchrun exits, or a rank reports an exception, the
group is failed for good: torchrun stops the other ranks (any left, those still starting included,
are killed), and `RankFailure` names the rank, its pid and its exit (torchrun's report in the log,
e.g. ``exitcode: -9``: SIGKILL). Later calls raise the same failure; the run's last checkpoint is
what a re-run resumes from. With `nodes` > 1 the channel is TCP and torchrun hosts a c10d
rendezvous that other nodes join (`rl.distributed.node`); a failure names the node and host
(docs/trainers.md, "Several nodes").
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import Any, cast

from rl.distributed.agent import FORK_RANKS, RANK_COMMAND
from rl.distributed.protocol import AUTHKEY_ENV, CHANNEL_ENV
from rl.driver_watch import EXIT_DRIVER_GONE, driver_environment
from rl.warm_fork.client import ForkedProcess, TemplateUnavailable, shared_template, template_environment, warm_command

log = logging.getLogger(__name__)

STOP_GRACE_S = 20.0
"""How long torchrun may take to stop the other ranks after one died, before they are killed."""
CLOSE_TIMEOUT_S = 30.0
"""How long the ranks may take to answer `close`."""
IDLE_CHECK_S = 0.5
"""With several nodes: how often the channels are looked at between messages (a rank lost then)."""
AGENT_PRELOAD = ("rl.distributed.agent_preload",)
"""What a CPU group's agent template imports before it forks each torchrun agent."""
GROUP_VARIABLES = (CHANNEL_ENV, AUTHKEY_ENV)
"""What differs between the agents of one template: their group's channel and key."""
SETTLE_S = 2.0
"""With several nodes: how long a failure waits for the other ranks' channels, to tell the rank
that died (its channel closed) from ranks whose collectives failed because it did."""


class RankFailure(RuntimeError):
    """A trainer rank died or failed; the message names it and says what to do."""


def describe_exit(code: int) -> str:
    """`-9` -> "killed by SIGKILL (signal 9)", `1` -> "exited with code 1"."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (signal {-code})"
    if code == EXIT_DRIVER_GONE:
        return "exited because the training process was gone"
    return f"exited with code {code}"


_ROOT_CAUSE = re.compile(r"rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)", re.S)


def root_cause(log_text: str) -> tuple[int, int, int] | None:
    """(rank, exit code, pid) of the first failure torchrun observed, from its report in the log."""
    _, marker, tail = log_text.rpartition("Root Cause")
    found = _ROOT_CAUSE.search(tail) if marker else None
    return None if found is None else (int(found[1]), int(found[2]), int(found[3]))


@dataclass(frozen=True)
class RankPlace:
    """Where a rank runs, from its hello."""

    node: int
    """0: the driver's node; 1, 2, ...: the others, in torchrun's node order (GROUP_RANK)."""
    host: str
    local: bool
    agent: int
    """Its torchrun agent's pid (on its node)."""


class RankGroup:
    """`world_size` trainer ranks under one torchrun, or `nodes` of them (see the module docstring)."""

    def __init__(
        self,
        world_size: int,
        log_path: Path,
        start_timeout_s: float,
        environment: dict[str, str],
        reply_timeout_s: float = 3600.0,
        *,
        nodes: int = 1,
        rendezvous: str | None = None,
        rendezvous_id: str = "rlboost",
        channel_host: str | None = None,
        channel_port: int | None = None,
        fork_ranks: bool = False,
    ) -> None:
        """`nodes` > 1 needs `rendezvous` (``host:port``); `channel_host` defaults to its host.
        `fork_ranks` (only on CPU): this node's ranks are forked from their agent
        (`rl.distributed.agent`), not started as new interpreters."""
        if nodes > 1 and rendezvous is None:
            raise ValueError("a trainer group over several nodes needs a rendezvous (trainer.rendezvous)")
        self.world_size = world_size
        self.nodes = nodes
        self.rendezvous = rendezvous
        self.rendezvous_id = rendezvous_id
        self.channel_host = channel_host or (rendezvous.rpartition(":")[0].strip("[]") if rendezvous else None)
        self.channel_port = channel_port
        self.fork_ranks = fork_ranks
        self.places: dict[int, RankPlace] = {}
        """Rank -> where it runs, from its hello."""
        self.log_path = Path(log_path)
        self.start_timeout_s = start_timeout_s
        self.reply_timeout_s = reply_timeout_s
        self.environment = environment
        self.pids: dict[int, int] = {}
        """Rank -> pid, from each rank's hello."""
        self._rank_fds: list[int] = []
        """A pidfd of each rank of this node that said hello: what `_stop` kills, never a process that took its pid."""
        self.process: subprocess.Popen | ForkedProcess | None = None
        self._conns: dict[int, Connection] = {}
        self._lock = threading.Lock()
        self._failure: RankFailure | None = None
        self._socket_dir: str | None = None
        self._address = ""
        self._log_offset = 0
        self._closing = threading.Event()

    # -- start ------------------------------------------------------------------------------

    def start(self, spec: dict[str, Any]) -> list[dict]:
        """Launch the ranks, wait for their hellos, send them `spec`; returns their init replies.
        All of it within `start_timeout_s`."""
        deadline = time.monotonic() + self.start_timeout_s
        key = secrets.token_bytes(32)
        if self.nodes == 1:
            self._socket_dir = tempfile.mkdtemp(prefix="rlboost-trainer-")  # 0700: only this user connects
            address = self._address = os.path.join(self._socket_dir, "channel")
            listener = Listener(address, family="AF_UNIX", authkey=key)
        else:  # the other nodes' ranks reach it over the network; the key keeps others out
            host = self.channel_host
            assert host is not None, "set from the rendezvous"
            listener = Listener((host, self.channel_port or 0), family="AF_INET", authkey=key)
            port = cast(tuple[str, int], listener.address)[1]
            address = self._address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        env = {
            **os.environ,
            **self.environment,
            CHANNEL_ENV: address,
            AUTHKEY_ENV: key.hex(),
            **driver_environment(),
        }
        command = [
            sys.executable,
            "-m",
            "rl.distributed.agent",  # torchrun, ended with this process
            *([FORK_RANKS] if self.fork_ranks else []),
            *self._launch_arguments(),
            *RANK_COMMAND,
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._log_offset = log.tell()
            forked = self._forked_agent(command, env) if self.fork_ranks else None
            self.process = forked or subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        try:
            self._accept(listener, deadline)
        finally:
            listener.close()
        replies = self.call("init", [spec] * self.world_size, timeout_s=max(deadline - time.monotonic(), 0.0))
        if self.nodes > 1:
            threading.Thread(target=self._watch_between_messages, name="trainer-watch", daemon=True).start()
        return replies

    def _forked_agent(self, command: list[str], env: dict[str, str]) -> ForkedProcess | None:
        """torchrun forked from this process's agent template (`rl.warm_fork`: it imported torchrun,
        the rank's modules and DeepSpeed once, for every CPU group of this process; the group's
        channel and key reach the agent as it forks); None when it cannot (it then starts fresh)."""
        if not warm_command(command):
            return None
        try:
            template = shared_template(AGENT_PRELOAD, template_environment(env, GROUP_VARIABLES), self.log_path)
            return template.start(command, env, self.log_path)
        except (TemplateUnavailable, OSError) as error:  # (OSError: the template could not be started)
            log.debug("torchrun starts fresh: %s", error)
            return None

    def _watch_between_messages(self) -> None:
        """With several nodes, fail the group as soon as a rank's channel closes between messages:
        when a lost node's `rlboost trainer-node` joins again, torchrun here would restart (SIGTERM)
        this node's ranks for the newcomer, and the failure would name them instead."""
        while not self._closing.wait(IDLE_CHECK_S):
            with self._lock:
                if self._failure is not None or self._closing.is_set():
                    return
                ranks = {conn: rank for rank, conn in self._conns.items()}
                ready = cast(list[Connection], wait(list(ranks), timeout=0))  # no rank speaks unasked: closed
                if not ready:
                    continue
                lost = min((ranks[conn] for conn in ready), key=lambda rank: (self.places[rank].local, rank))
                try:
                    self._fail(lost, "idle", "its channel closed between messages")
                except RankFailure:
                    return

    def _launch_arguments(self) -> list[str]:
        """torchrun's arguments: one node standalone, or node 0 of a c10d rendezvous (its store here)."""
        if self.nodes == 1:
            return ["--standalone", "--nnodes=1", f"--nproc-per-node={self.world_size}", "--max-restarts=0"]
        per_node = self.world_size // self.nodes
        return [
            *node_arguments(
                self.nodes,
                per_node,
                str(self.rendezvous),
                self.rendezvous_id,
                is_host=True,
                join_timeout_s=self.start_timeout_s,
            ),
            f"--local-addr={self.channel_host}",
        ]

    def _accept(self, listener: Listener, deadline: float) -> None:
        process = self.process
        assert process is not None, "_accept runs once torchrun has started"
        accepted: list[Connection] = []
        errors: list[BaseException] = []

        def accept_all() -> None:
            try:
                while len(accepted) < self.world_size:
                    try:
                        accepted.append(listener.accept())
                    except AuthenticationError as exc:  # on TCP: something else than a rank connected
                        if self.nodes == 1:
                            raise
                        log.warning("refused a connection to the trainer's channel: %s", exc)
            except BaseException as exc:  # the listener closed on a timeout, or a bad key
                errors.append(exc)

        thread = threading.Thread(target=accept_all, name="trainer-accept", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            if (code := process.poll()) is not None and thread.is_alive():
                self._fail(None, "start", f"torchrun {describe_exit(code)} before every rank connected")
            if time.monotonic() > deadline:
                self._fail(
                    None,
                    "start",
                    f"{self._connected(len(accepted))} within {self.start_timeout_s:.0f} s (trainer.start_timeout_s)",
                    grace_s=0.0,
                )
        if errors:
            self._fail(None, "start", f"accepting the ranks failed: {errors[0]}")
        hellos = {}
        for conn in accepted:
            _, rank, pid, place = conn.recv()
            self._conns[rank] = conn
            self.pids[rank] = pid
            hellos[rank] = place
            if place["local"]:
                self._rank_fds.extend(_pidfds([pid]))
        self._place(hellos)

    def _connected(self, count: int) -> str:
        """What a start that timed out saw: with several nodes, how many ranks and what to check."""
        if self.nodes == 1:
            return "the ranks did not connect"
        return (
            f"{count} of {self.world_size} ranks connected; the others (trainer.nodes={self.nodes}) did not "
            f"connect: is `rlboost trainer-node --rendezvous {self.rendezvous} --run-id {self.rendezvous_id} "
            f"--nproc-per-node {self.world_size // self.nodes}` running on every other node, and can its "
            f"ranks reach {self._address}"
        )

    def _place(self, hellos: dict[int, dict]) -> None:
        """Number the nodes (this one 0, the others by torchrun's node order) and check each node's
        ranks agree on the world size."""
        remote = sorted({hello["node"] for hello in hellos.values() if not hello["local"]})
        for rank, hello in hellos.items():
            node = 0 if hello["local"] else 1 + remote.index(hello["node"])
            self.places[rank] = RankPlace(node, hello["host"], hello["local"], hello["agent"])
        for rank, hello in sorted(hellos.items(), key=lambda item: (item[1]["local"], item[0])):  # others first
            if hello["world_size"] != self.world_size:
                place = self.places[rank]
                self._fail(
                    None,
                    "start",
                    f"node {place.node} (host {place.host}) joined a group of {hello['world_size']} ranks, this "
                    f"run has trainer.world_size={self.world_size}: start every `rlboost trainer-node` with "
                    f"--nproc-per-node {self.world_size // self.nodes}",
                    grace_s=0.0,
                )

    # -- calls ------------------------------------------------------------------------------

    def call(self, op: str, payloads: list[Any] | None = None, timeout_s: float | None = None) -> list[Any]:
        """Send `op` (with `payloads[rank]`) to every rank; their reply values, by rank. Fails the
        group when a rank has not replied within `timeout_s` (default `reply_timeout_s`)."""
        with self._lock:
            if self._failure is not None:
                raise self._failure
            process = self.process
            if process is None:
                raise RuntimeError(f"{op}: the ranks are not started (start() first)")
            payloads = payloads if payloads is not None else [None] * self.world_size
            for rank, conn in sorted(self._conns.items()):
                try:
                    conn.send((op, payloads[rank]))
                except OSError:
                    self._fail(rank, op, "its channel closed")
            replies: dict[int, Any] = {}
            if op == "init":  # what the failure names: the whole start's deadline
                waited, setting = self.start_timeout_s, "trainer.start_timeout_s"
            elif timeout_s is None:
                waited, setting = self.reply_timeout_s, "trainer.reply_timeout_s"
            else:
                waited, setting = timeout_s, f"the deadline of {op!r}"
            deadline = time.monotonic() + (self.reply_timeout_s if timeout_s is None else timeout_s)
            while len(replies) < self.world_size:
                waiting = {conn: rank for rank, conn in self._conns.items() if rank not in replies}
                # `wait` returns some of the objects it was given: Connections here.
                for conn in cast(list[Connection], wait(list(waiting), timeout=0.5)):
                    rank = waiting[conn]
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError):
                        self._fail(rank, op, "its channel closed")
                    if status == "error":
                        self._fail(rank, op, "it raised an exception:\n" + _last_lines(value, 12))
                    replies[rank] = value
                if (code := process.poll()) is not None and len(replies) < self.world_size:
                    self._fail(None, op, f"torchrun {describe_exit(code)}")
                if time.monotonic() > deadline:
                    silent = [str(rank) for rank in range(self.world_size) if rank not in replies]
                    ranks = f"rank{'s' if len(silent) > 1 else ''} {', '.join(silent)}"
                    self._fail(None, op, f"{ranks} sent no reply within {waited:.0f} s ({setting})", grace_s=0.0)
            return [replies[rank] for rank in range(self.world_size)]

    def _fail(self, rank: int | None, op: str, what: str, grace_s: float = STOP_GRACE_S) -> None:
        """Stop every rank (torchrun may take `grace_s` to stop the others after one died), work out
        who died and how, remember and raise the failure."""
        remote = False
        if self.nodes > 1 and rank is not None:
            rank, what = self._first_lost(rank, what)
            remote = rank in self.places and not self.places[rank].local
            if remote:  # this node's torchrun knows nothing of it: no report to wait for
                grace_s = 0.0
                if what.startswith("its channel closed"):
                    what += " (the rank, its torchrun agent or its machine died)"
        self._stop(grace_s=grace_s)
        for conn in self._conns.values():  # another node's ranks waiting for a message end now
            conn.close()
        cause = None if remote else root_cause(self._log_since_start())
        culprit = cause[0] if cause else rank
        if cause is not None:
            culprit, code, pid = cause
            detail = f"{self._who(culprit, pid)} {describe_exit(code)} during {op!r}"
            if culprit == rank and what.startswith("it raised"):
                detail += f"; {what}\n"
        elif culprit is not None:
            detail = f"{self._who(culprit, self.pids.get(culprit, '?'))} failed during {op!r}: {what}"
        else:
            detail = f"the trainer ranks failed during {op!r}: {what}"
        self._failure = RankFailure(
            f"{detail}; every rank is stopped. The run keeps its last checkpoint: run it again to resume "
            f"from there. Rank output: {self.log_path}"
        )
        raise self._failure

    def _who(self, rank: int, pid: object) -> str:
        place = self.places.get(rank)
        if self.nodes == 1 or place is None:
            return f"trainer rank {rank} (pid {pid})"
        return f"trainer node {place.node} (host {place.host}, rank {rank}, pid {pid})"

    def _first_lost(self, rank: int, what: str) -> tuple[int, str]:
        """With several nodes, one rank's death fails its peers' collectives: when `rank` raised,
        a rank whose channel closes within `SETTLE_S` without a word is the cause instead."""
        if not what.startswith("it raised"):
            return rank, what
        pending = {conn: other for other, conn in self._conns.items() if other != rank}
        deadline = time.monotonic() + SETTLE_S
        while pending and time.monotonic() < deadline:
            for conn in cast(list[Connection], wait(list(pending), timeout=max(deadline - time.monotonic(), 0.0))):
                try:
                    status, _ = conn.recv()
                except (EOFError, OSError):
                    return pending[conn], "its channel closed"
                if status == "error":
                    del pending[conn]  # it raised too
        return rank, what

    def _log_since_start(self) -> str:
        """What torchrun and the ranks wrote since this group started (the log is appended to)."""
        if not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as log:
            log.seek(self._log_offset)
            return log.read().decode(errors="replace")

    # -- stop -------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None and self._failure is None

    def close(self) -> None:
        """Tell the ranks to exit, then make sure torchrun and every rank are gone."""
        self._closing.set()
        if self.alive:
            try:
                self.call("close", timeout_s=CLOSE_TIMEOUT_S)
            except RankFailure:
                pass
        self._stop(grace_s=30.0)
        for conn in self._conns.values():
            conn.close()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def _stop(self, grace_s: float) -> None:
        """Wait `grace_s` for torchrun to exit (it stops its ranks), then kill its process group and
        every rank of this node: those that said hello, and those still starting (torchrun's
        children, found before it dies: a rank killed or stopped before it set its parent-death
        signal would outlive it)."""
        if self.process is None:
            return
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        starting = _pidfds(child_pids(self.process.pid))
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # torchrun's group
        except ProcessLookupError:
            pass
        self.process.wait()
        for pidfd in [*self._rank_fds, *starting]:  # each rank runs in a session of its own (torchrun starts them so)
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.close(pidfd)
        self._rank_fds.clear()


def _pidfds(pids: list[int]) -> list[int]:
    """A pidfd of each process of `pids` still there: it is that process, whatever takes its pid later."""
    pidfds = []
    for pid in pids:
        try:
            pidfds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            continue
    return pidfds


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return children


def node_arguments(
    nodes: int, per_node: int, rendezvous: str, rendezvous_id: str, *, is_host: bool, join_timeout_s: float
) -> list[str]:
    """torchrun's arguments for one node of a trainer group over `nodes` nodes: the driver's
    (`is_host`: its agent hosts the rendezvous store) and each `rlboost trainer-node`'s."""
    conf = f"is_host={str(is_host).lower()},join_timeout={max(int(join_timeout_s), 1)}"
    return [
        f"--nnodes={nodes}",
        f"--nproc-per-node={per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rendezvous}",
        f"--rdzv-id={rendezvous_id}",
        f"--rdzv-conf={conf}",
        "--max-restarts=0",
    ]


def _last_lines(text: str, count: int) -> str:
    return "\n".join(str(text).rstrip().splitlines()[-count:])
