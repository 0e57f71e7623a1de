"""What a fork template (`rl.warm_fork.template`) and its owner
(`rl.warm_fork.client.ForkTemplate`) say to each other: one JSON message per line over a
stream socket, `Start` and `Reap` from the owner, `Ready`, `Started`, `Reaped` or `Refused` back.
"""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass
from typing import BinaryIO

TEMPLATE_MODULE = "rl.warm_fork.template"
"""The template's module, run with `python -m` (imported by nothing else: it runs as `__main__`)."""


@dataclass(frozen=True)
class Start:
    """Fork an instance: `command` is its `python -m <module> <args>` command line."""

    command: list[str]
    env: dict[str, str]
    log_path: str | None
    """Its stdout and stderr (appended); None: the template's own streams."""


@dataclass(frozen=True)
class Reap:
    """Wait for an exited child (the owner saw it exit) and say its exit code."""

    pid: int


@dataclass(frozen=True)
class Ready:
    """The modules are imported: the template forks from now on."""

    preload_s: float


@dataclass(frozen=True)
class Started:
    """The child forked: its pid, which leads its own process group."""

    pid: int


@dataclass(frozen=True)
class Reaped:
    """The child reaped: its exit code (negative: the signal that ended it)."""

    pid: int
    exit_code: int


@dataclass(frozen=True)
class Refused:
    """A request the template could not carry out (a fork or a wait that failed)."""

    error: str


Message = Start | Reap | Ready | Started | Reaped | Refused
_KINDS: dict[str, type[Message]] = {kind.__name__: kind for kind in (Start, Reap, Ready, Started, Reaped, Refused)}


class Channel:
    """One JSON message per line over a stream socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._reader: BinaryIO = sock.makefile("rb")

    def send(self, message: Message) -> None:
        line = json.dumps({"kind": type(message).__name__, **asdict(message)}) + "\n"
        self.sock.sendall(line.encode())

    def receive(self) -> Message | None:
        """The next message; None once the other end closed."""
        line = self._reader.readline()
        if not line:
            return None
        fields = json.loads(line)
        return _KINDS[fields.pop("kind")](**fields)

    def close(self) -> None:
        self._reader.close()
        self.sock.close()
