"""How `rlboost train` ends on a failure it can name, and what its console shows meanwhile.

`claim_run_directory(directory)` makes the run directory, takes its driver lock for the session
(`infra.run.driver_lock.hold_for_session`) before anything else starts, and opens its `driver.log`
(`infra.run.run_log`); `check_run_directory(directory)` names one that plainly cannot be made or
written before the command imports anything heavy. `ending(error, resume)` is the exit status and
the one line of a failure the program names: 2 for what the user fixes (bad input, local state), 3
for a service the run needs that is gone (a trainer rank that died among them); None for anything
else (a bug keeps its traceback). `quiet_console(run_log)` makes Prefect's console handlers print
no traceback (the run log keeps them), no record of a named failure (its one line ends the command)
and none of the co-located rollout instances' own lines (in the run log, as a local instance's are
in its log).
"""

from __future__ import annotations

import copy
import errno
import logging
import os
from pathlib import Path

from infra.run.driver_lock import RunLocked, hold_for_session
from infra.run.run_log import RUN_LOG_FILE, RunLog
from rl.disk_space import describe_free, full_path, out_of_space

INSTANCE_LOGGERS = ("rlboost.worker",)
"""Loggers of a rollout instance's own lines: in the training process, the co-located instances'."""


class NamedFailure(Exception):
    """A failure the command reports as one line, `line`, ending with exit status `code`."""

    def __init__(self, code: int, line: str) -> None:
        super().__init__(line)
        self.code, self.line = code, line


def claim_run_directory(directory: Path) -> RunLog:
    """Make `directory`, take its driver lock for this process's session and open its run log;
    `NamedFailure` (exit 2) when it cannot be written or another driver holds it."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        hold_for_session(directory)
        return RunLog.open(directory)
    except RunLocked as error:
        _note_in_the_run_log(directory, f"a second driver was refused: {error}")
        raise NamedFailure(2, str(error)) from None
    except OSError as error:
        if out_of_space(error):
            raise _full_disk(str(full_path(error) or directory)) from None
        raise _unwritable(directory, error) from None


def check_run_directory(directory: Path) -> None:
    """`NamedFailure` (exit 2), as `claim_run_directory` would end, when `directory` plainly cannot
    be made or written: its nearest existing ancestor is not a directory, lies on a read-only file
    system or is not writable by this user. Nothing is written: the check runs before the command
    imports anything heavy, and `claim_run_directory` still names what it misses."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():  # mkdir names the whole path
        raise _unwritable(directory, OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(directory)))
    made = directory if existing == directory else existing / directory.relative_to(existing).parts[0]
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise _unwritable(directory, OSError(errno.EROFS, os.strerror(errno.EROFS), str(made)))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise _unwritable(directory, OSError(errno.EACCES, os.strerror(errno.EACCES), str(made)))


def _unwritable(directory: Path, error: OSError) -> NamedFailure:
    """The failure naming a run directory that `error` kept from being made or written."""
    what = f"{error.strerror}: {error.filename}" if error.strerror and error.filename else str(error)
    return NamedFailure(
        2,
        f"cannot write the run directory {directory} ({what}): set run.output_dir to a directory "
        f"this user can write (it is {directory.parent})",
    )


def _note_in_the_run_log(directory: Path, line: str) -> None:
    try:
        with (directory / RUN_LOG_FILE).open("a", encoding="utf-8") as log:
            log.write(f"{line}\n")
    except OSError:
        pass


def _named_classes() -> dict[type[BaseException], tuple[int, str]]:
    """Failures named by their class: (exit status, how the line begins: `{}` is the message)."""
    from infra.fleet.instance_watch import PoolFailure
    from infra.rollout.tokenlog import ShardCountMismatch
    from infra.run.redis_outage import RunStopped
    from infra.services.prefect_api import PrefectApiUnreachable, PrefectServerCannotStart
    from infra.services.redis_embedded import RedisUnavailable
    from rl.checkpoint import CorruptCheckpoint, OutOfSpace
    from rl.datasets import DatasetError
    from rl.distributed.group import RankFailure
    from rl.scoring import NothingToTrain
    from rl.trainer import CheckpointMismatch

    return {
        RunStopped: (3, "the run stopped: {}; resume with: "),  # its Redis is gone: what was kept, how to go on
        PoolFailure: (3, "the run stopped: {}; fix that, then resume with: "),  # its instances keep failing
        NothingToTrain: (3, "the run stopped: {}, then resume with: "),  # a whole step failed
        RedisUnavailable: (3, "cannot run: {}"),
        PrefectApiUnreachable: (3, "{}"),
        PrefectServerCannotStart: (3, "{}"),  # 2 when its database is the cause
        RunLocked: (2, "{}"),
        ShardCountMismatch: (2, "cannot run: {}"),  # a run resumed with another fabric.tokenlog_shards
        RankFailure: (3, "the run stopped: {}"),  # a trainer rank (or node) lost: the message says how to resume
        CheckpointMismatch: (2, "the run stopped: {}"),  # the user's to fix: another trainer's checkpoint,
        CorruptCheckpoint: (2, "the run stopped: {}"),  # a damaged one,
        OutOfSpace: (2, "the run stopped: {}"),  # a full disk
        DatasetError: (2, "{}"),  # a bad record past those checked before the run started: the same line
    }


def ending(error: BaseException, resume: str) -> NamedFailure | None:
    """The exit status and one line of `error` if the program names it (see the module docstring);
    `resume` is the command that resumes the run."""
    from infra.fleet.instance_watch import PoolFailure
    from infra.run.redis_outage import RunStopped
    from infra.services.prefect_api import PrefectServerCannotStart
    from rl.scoring import NothingToTrain

    if isinstance(error, NamedFailure):
        return error
    for kind, (code, line) in _named_classes().items():
        if isinstance(error, kind):
            if isinstance(error, PrefectServerCannotStart) and error.bad_database:
                code = 2
            resumable = isinstance(error, (RunStopped, PoolFailure, NothingToTrain))
            return NamedFailure(code, line.format(error) + (resume if resumable else ""))
    if isinstance(error, OSError) and out_of_space(error):
        return _full_disk(full_path(error) or "the run directory")
    return None


def _full_disk(written: str) -> NamedFailure:
    """The line of a write that ran out of space (`written`: the file, or the run directory)."""
    return NamedFailure(
        2,
        f"the run stopped: no space left on the device writing {written}: {describe_free(written)}. Free "
        "some space (or set run.output_dir on a larger disk) and run the same command again to resume "
        "from the last checkpoint",
    )


def named(error: BaseException) -> bool:
    """Whether `error` ends the command as one line (`ending`)."""
    return ending(error, "") is not None


class _QuietConsole(logging.Filter):
    """Leaves out of the console the records of named failures (their tracebacks, and Prefect's
    `Finished in state Failed(... <Name>: ...)` lines about them) and the co-located instances' lines."""

    def __init__(self) -> None:
        super().__init__()
        self.names = tuple(kind.__name__ for kind in _named_classes())

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith(INSTANCE_LOGGERS):
            return False
        error = record.exc_info[1] if record.exc_info else None
        if error is not None:
            return not named(error)
        if record.levelno >= logging.ERROR and record.name.startswith(("prefect.flow_runs", "prefect.task_runs")):
            message = record.getMessage()
            return not any(f"{name}:" in message or f"{name}(" in message for name in self.names)
        return True


class _WithoutTracebacks(logging.Formatter):
    """A console formatter that prints a record's exception as one line, pointing at the run log."""

    def __init__(self, inner: logging.Formatter, run_log: Path) -> None:
        super().__init__()
        self.inner, self.run_log = inner, run_log

    def format(self, record: logging.LogRecord) -> str:
        if not record.exc_info or record.exc_info[1] is None:
            return self.inner.format(record)
        error = record.exc_info[1]
        quiet = copy.copy(record)  # the record is shared with the other handlers (the run log's)
        quiet.exc_info, quiet.exc_text, quiet.stack_info = None, None, None
        summary = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        quiet.msg, quiet.args = f"{record.getMessage()} ({summary}; traceback in {self.run_log})", None
        return self.inner.format(quiet)


def quiet_console(run_log: RunLog) -> None:
    """Make Prefect's console handlers (this process's console logging) as the module docstring says."""
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if not isinstance(handler, PrefectConsoleHandler):
            continue
        if not any(isinstance(f, _QuietConsole) for f in handler.filters):  # once per process
            handler.addFilter(_QuietConsole())
        formatter = handler.formatter or logging.Formatter()
        if isinstance(formatter, _WithoutTracebacks):
            formatter.run_log = run_log.path  # this command's run
        else:
            handler.setFormatter(_WithoutTracebacks(formatter, run_log.path))
