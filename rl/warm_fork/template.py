"""The fork template: a process that imports a program's modules once, then forks each process of
it from that warm state instead of starting a new interpreter (docs/internals.md §3).

`python -m rl.warm_fork.template --fd N --preload mod[,mod...]` imports the modules, says
`Ready` on the socket at fd N, then serves its owner (`rl.warm_fork.client.ForkTemplate`),
one request at a time. `Start` forks a child that becomes a new session and runs `python -m
<module> <args>` as a new interpreter would: its environment, `sys.argv` and `sys.orig_argv`, stdin
from /dev/null, stdout and stderr to its log; the reply is its pid. `Reap` waits for an exited child
and replies its exit code (negative: the signal that ended it); the template never reaps on its own,
so a pid and its process group are not reused before the owner has read the exit. The template
exits when the owner's end of the socket closes (the owner exited, or was killed), while it imports
too. Functions registered with `os.register_at_fork(after_in_child=...)` run with the child's
environment, command line and streams in place; Python's `random` and NumPy's global generator are
reseeded. The child's process title (`ps`, /proc/<pid>/cmdline) is its command line, joined by spaces.
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import select
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from setproctitle import setproctitle

from rl.warm_fork.protocol import TEMPLATE_MODULE, Channel, Ready, Reap, Reaped, Refused, Start, Started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {TEMPLATE_MODULE}")
    parser.add_argument("--fd", type=int, required=True, help="the socket to its owner")
    parser.add_argument("--preload", default="", help="modules to import before forking, comma-separated")
    args = parser.parse_args(argv)
    setproctitle(f"{sys.executable} -m {TEMPLATE_MODULE} --fd {args.fd}")  # `ps` needs not list what it imported
    channel = Channel(socket.socket(fileno=args.fd))
    began = time.monotonic()
    with _exit_when_the_owner_goes(channel.sock):
        for module in filter(None, args.preload.split(",")):
            importlib.import_module(module)
    os.register_at_fork(after_in_child=_reseed_numpy)
    channel.send(Ready(preload_s=round(time.monotonic() - began, 3)))
    start = serve(channel)
    if start is None:
        return 0
    module = start.command[2]
    sys.modules.pop(module, None)  # preloaded or not, it runs once, as `__main__` (its imports stay)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def serve(channel: Channel) -> Start | None:
    """Answer the owner's requests until it closes the socket (None); in a forked child, return
    its `Start` (the child then runs the module)."""
    while (request := channel.receive()) is not None:
        if isinstance(request, Start):
            try:
                pid = _fork(request, channel)
            except OSError as exc:
                channel.send(Refused(f"cannot fork {request.command[2]}: {exc}"))
                continue
            if pid == 0:
                return request
            channel.send(Started(pid))
        elif isinstance(request, Reap):
            try:
                _, status = os.waitpid(request.pid, 0)
            except ChildProcessError as exc:
                channel.send(Refused(f"cannot wait for {request.pid}: {exc}"))
                continue
            channel.send(Reaped(request.pid, os.waitstatus_to_exitcode(status)))
        else:
            channel.send(Refused(f"unexpected request {request!r}"))
    return None


@contextmanager
def _exit_when_the_owner_goes(sock: socket.socket) -> Iterator[None]:
    """While the block runs, a thread waits on `sock`: when the owner's end closes (it exited or was
    killed), the template exits at once. The owner sends nothing before `Ready`; were something
    there, the thread leaves it for `serve` and stops watching."""
    wake_read, wake_write = os.pipe()

    def watch() -> None:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        poller.register(wake_read, select.POLLIN)
        ready = {fd for fd, _ in poller.poll()}
        if wake_read in ready:
            return
        try:
            gone = sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            gone = True
        if gone:
            print("fork template: its owner is gone while it imports its modules; exiting", file=sys.stderr, flush=True)
            os._exit(0)

    watcher = threading.Thread(target=watch, name="owner-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        os.write(wake_write, b"x")
        watcher.join()
        os.close(wake_read)
        os.close(wake_write)


def _fork(start: Start, channel: Channel) -> int:
    """Fork with the child's streams, environment and command line in place (the template's own
    are restored in the parent): the child's pid, or 0 in the child."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = _Saved()
    try:
        _redirect(start.log_path)
        os.environ.clear()
        os.environ.update(start.env)
        sys.argv = ["-m", *start.command[3:]]  # as `python -m` leaves it before the module runs
        sys.orig_argv = list(start.command)
        pid = os.fork()
    except BaseException:
        saved.restore()
        raise
    if pid == 0:
        os.setsid()
        setproctitle(" ".join(start.command))  # what `ps` and /proc/<pid>/cmdline show
        channel.close()
        saved.discard()
        return 0
    saved.restore()
    return pid


class _Saved:
    """The template's streams, environment and command line, put back after a fork."""

    def __init__(self) -> None:
        self.fds = [os.dup(fd) for fd in (0, 1, 2)]
        self.env = dict(os.environ)
        self.argv = sys.argv
        self.orig_argv = sys.orig_argv

    def restore(self) -> None:
        for target, fd in enumerate(self.fds):
            os.dup2(fd, target)
        self.discard()
        os.environ.clear()
        os.environ.update(self.env)
        sys.argv = self.argv
        sys.orig_argv = self.orig_argv

    def discard(self) -> None:
        for fd in self.fds:
            os.close(fd)


def _redirect(log_path: str | None) -> None:
    """stdin from /dev/null; stdout and stderr appended to `log_path` (None: left as they are)."""
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    if log_path is None:
        return
    out = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)


def _reseed_numpy() -> None:
    """A forked child's NumPy global generator, seeded afresh as in a new interpreter (Python's own
    `random` reseeds itself after a fork)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


if __name__ == "__main__":
    sys.exit(main())
