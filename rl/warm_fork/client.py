"""The owner's side of a fork template (`rl.warm_fork.template`): `shared_template(preload, env,
log_path)` is this process's `ForkTemplate` for those modules and that environment (like
multiprocessing's fork server: every owner in the process shares it), started on first use; a new
one for the same preload retires the one before, which ends once the processes forked from it are
reaped. `ForkTemplate.start` forks a process running `python -m <module> ...` (`warm_command`) with
its own environment; its environment at the template's start (`template_environment`) leaves out
what differs between the processes of one template (who each is, its run's address and secrets).
A forked process (`ForkedProcess`) leads its own process group like a fresh one; its exit is seen
through a pidfd and its exit code read from the template, which keeps it unreaped until then.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from rl.warm_fork.protocol import TEMPLATE_MODULE, Channel, Ready, Reap, Reaped, Start, Started

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 180.0
"""The longest wait for a template to import its modules; then the processes start fresh."""
REPLY_TIMEOUT_S = 30.0
"""The longest wait for a template's answer to a fork or a reap."""
EXIT_UNKNOWN = 255
"""The exit code `ForkedProcess.poll` gives a process whose template is gone (with its code)."""
TEST_VARIABLES = frozenset({"PYTEST_CURRENT_TEST"})
"""What pytest sets to the test that runs (it changes with each test of a session; no import reads
it): not a reason for a template of its own."""


class TemplateUnavailable(RuntimeError):
    """The template did not start, or stopped answering: start the process fresh."""


class ForkTemplate:
    """One template process and the processes forked from it."""

    def __init__(self, preload: Sequence[str], env: Mapping[str, str], log_path: Path | None) -> None:
        """Start the template with `env` (`template_environment` of a forked process's) in this working
        directory; its own output goes to `log_path` (None: this process's streams)."""
        self.preload = tuple(preload)
        self.env = dict(env)
        self.cwd = os.getcwd()
        self._log_hint = "its output is this process's" if log_path is None else f"its log: {log_path}"
        self._lock = threading.Lock()
        self._ready = False
        self._failed: str | None = None
        self._retired = False
        self._children: set[int] = set()
        """Processes forked and not yet reaped: a retired template ends once there are none."""
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-m", TEMPLATE_MODULE, "--fd", str(theirs.fileno())]
        command += ["--preload", ",".join(preload)]
        out = None if log_path is None else log_path.open("ab")
        try:
            self._process = subprocess.Popen(
                command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=None if out is None else subprocess.STDOUT,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # no Ctrl-C from the owner's terminal: it ends with the socket
            )
        finally:
            theirs.close()
            if out is not None:
                out.close()
        self._channel = Channel(ours)

    def matches(self, preload: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether a process whose template preloads `preload`, with environment `env`
        (`template_environment`), forks from here."""
        return self.usable() and tuple(preload) == self.preload and dict(env) == self.env and os.getcwd() == self.cwd

    def start(self, command: Sequence[str], env: Mapping[str, str], log_path: Path | None) -> ForkedProcess:
        """Fork a process running `command` (`python -m <module> ...`) with `env`; raises
        `TemplateUnavailable` when the template cannot (the process then starts fresh)."""
        with self._lock:
            self._await_ready()
            reply = self._call(Start(list(command), dict(env), None if log_path is None else str(log_path)))
            if not isinstance(reply, Started):
                raise TemplateUnavailable(f"the fork template refused a process: {reply}")
            self._children.add(reply.pid)
            return ForkedProcess(reply.pid, self)

    def reap(self, pid: int) -> int | None:
        """The exit code of an exited process (None: the template is gone, and with it the code)."""
        with self._lock:
            self._children.discard(pid)
            try:
                reply = self._call(Reap(pid))
            except TemplateUnavailable:
                return None
            finally:
                if self._retired and not self._children:
                    self._end()
            return reply.exit_code if isinstance(reply, Reaped) and reply.pid == pid else None

    def usable(self) -> bool:
        """Whether it forks new processes: it has neither failed nor been retired."""
        return self._failed is None and not self._retired

    def retire(self) -> None:
        """Fork nothing more; end once the processes forked from it are reaped (at once if none)."""
        with self._lock:
            self._retired = True
            if not self._children:
                self._end()

    def _end(self) -> None:
        """End the template process (with the lock held; the processes forked from it run on)."""
        self._failed = self._failed or "retired"
        self._channel.close()
        try:
            self._process.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _await_ready(self) -> None:
        if self._failed is not None:
            raise TemplateUnavailable(self._failed)
        if self._ready:
            return
        self._channel.sock.settimeout(READY_TIMEOUT_S)
        try:
            reply = self._channel.receive()
        except (OSError, ValueError) as exc:
            self._give_up(f"the fork template did not get ready in {READY_TIMEOUT_S:.0f} s: {exc}")
        if not isinstance(reply, Ready):
            self._give_up(f"the fork template exited while importing its modules ({self._log_hint})")
        log.info("fork template ready: its modules imported in %.1f s", reply.preload_s)
        self._ready = True

    def _call(self, request: Start | Reap) -> object:
        if self._failed is not None:
            raise TemplateUnavailable(self._failed)
        self._channel.sock.settimeout(REPLY_TIMEOUT_S)
        try:
            self._channel.send(request)
            reply = self._channel.receive()
        except (OSError, ValueError) as exc:
            self._give_up(f"the fork template stopped answering: {exc}")
        if reply is None:
            self._give_up(f"the fork template exited (exit {self._process.poll()})")
        return reply

    def _give_up(self, why: str) -> NoReturn:
        self._failed = why
        log.warning("%s; processes start fresh from now on", why)
        self._process.kill()
        raise TemplateUnavailable(why)


class ForkedProcess:
    """A process forked from a template: a grandchild of this process that leads its own group.
    `exited`, `wait_exited` and `reap` see its exit without reaping it first (`LocalProvider`);
    `poll`, `wait` and `returncode` read as `subprocess.Popen`'s."""

    def __init__(self, pid: int, template: ForkTemplate) -> None:
        self.pid = pid
        self.returncode: int | None = None
        """Its exit code once `poll` or `wait` saw it exit (`EXIT_UNKNOWN` when its template is gone)."""
        self._template = template
        try:
            self._pidfd: int | None = os.pidfd_open(pid)  # the process itself, whatever reuses its pid later
        except ProcessLookupError:
            self._pidfd = None  # already gone and reaped (its template died): exited

    def exited(self) -> bool:
        return self.exited_within(0)

    def exited_within(self, timeout: float | None) -> bool:
        """Whether it has exited within `timeout` seconds (None: waits until it has), not reaped."""
        return self._pidfd is None or bool(select.select([self._pidfd], [], [], timeout)[0])

    def wait_exited(self) -> None:
        self.exited_within(None)

    def reap(self) -> int | None:
        code = self._template.reap(self.pid)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return code

    def poll(self) -> int | None:
        if self.returncode is None and self.exited():
            code = self.reap()
            self.returncode = EXIT_UNKNOWN if code is None else code
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.exited_within(timeout):
            raise subprocess.TimeoutExpired(f"process {self.pid}", timeout or 0.0)
        code = self.poll()
        assert code is not None, "it has exited"
        return code


_shared: list[ForkTemplate] = []
_shared_lock = threading.Lock()


def shared_template(preload: Sequence[str], env: Mapping[str, str], log_path: Path | None) -> ForkTemplate:
    """This process's template that imports `preload` with environment `env` in this working
    directory, started now unless one runs (its output to `log_path`: the log of its first owner).
    A new one retires the template of the same `preload` before it; a template that failed is left."""
    with _shared_lock:
        _shared[:] = [template for template in _shared if template.usable()]
        for template in _shared:
            if template.matches(preload, env):
                return template
        for template in [template for template in _shared if template.preload == tuple(preload)]:
            template.retire()
            _shared.remove(template)
        template = ForkTemplate(preload, env, log_path)
        _shared.append(template)
        return template


def retire_templates() -> None:
    """Retire this process's templates (each ends once its processes are reaped; all end with the
    process anyway): for a program that wants their memory back, or their CPU in its own count."""
    with _shared_lock:
        for template in _shared:
            template.retire()
        _shared.clear()


def warm_command(command: Sequence[str]) -> bool:
    """Whether a template can run `command`: `python -m <module> ...` of this interpreter, on a
    system with pidfds (Linux 5.3 and later; elsewhere every process starts fresh)."""
    forks = hasattr(os, "pidfd_open")
    return forks and len(command) >= 3 and command[0] == sys.executable and command[1] == "-m"


def template_environment(env: Mapping[str, str], run_variables: Iterable[str]) -> dict[str, str]:
    """A forked process's environment less pytest's `TEST_VARIABLES` and `run_variables` (what differs
    between the processes of one template: who each is, its run's address and secrets; but for
    `PYTHON*`, which an interpreter reads as it starts): what a template's imports see."""
    left_out = TEST_VARIABLES | {name for name in run_variables if not name.startswith("PYTHON")}
    return {name: value for name, value in env.items() if name not in left_out}
