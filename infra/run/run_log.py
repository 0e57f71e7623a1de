"""The driver's log of a run: `<run>/driver.log` (docs/internals.md §9).

`RunLog.open(directory)` appends, for the life of the training process, every record of the
project's loggers at INFO and up and every other record at WARNING and up (Prefect's INFO too),
each with its traceback, to the run directory's `driver.log`; an exception that ends a thread of
the process is logged there too (`threading.excepthook`) instead of printed, and so are warnings
and vLLM's own log (which would print to the console). `keep(error)` writes the error that ended
the run, with its traceback, to the file alone; on a full disk neither it nor `close()` raises.
The console shows none of these tracebacks (`infra.cli.failures`): this file is where they are. It
is opened under the run's driver lock, so one driver writes it at a time (a second driver refused
by the lock appends only the line saying so).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

RUN_LOG_FILE = "driver.log"
PROJECT_LOGGERS = ("rlboost", "infra", "rl", "flows", "tasks")
"""Loggers of the project's own modules (`logging.getLogger(__name__)`, and `rlboost.*`): INFO reaches the file."""
ENGINE_LOGGERS = ("vllm",)
"""Libraries that give themselves a console handler (vLLM, at import, unless VLLM_CONFIGURE_LOGGING=0):
their INFO goes to the file instead."""
_VLLM_CONSOLE = "VLLM_CONFIGURE_LOGGING"

log = logging.getLogger("rlboost.driver")


class _QuietFileHandler(logging.FileHandler):
    """A file handler that drops a record it cannot write (a full disk) instead of printing
    logging's own traceback to the console, and whose flush and close never raise: the run names a
    full disk itself, and the handler of its failure writes here."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass

    def flush(self) -> None:
        try:
            super().flush()
        except OSError:
            pass

    def close(self) -> None:
        try:
            super().close()  # it flushes what the file took no more of, then closes it all the same
        except OSError:
            pass


class RunLog:
    """The open `driver.log` of one run and the logging it is attached to."""

    def __init__(self, path: Path, handler: logging.FileHandler) -> None:
        self.path, self.handler = path, handler
        self._previous_hook = threading.excepthook
        self._previous_vllm_console = os.environ.get(_VLLM_CONSOLE)

    @classmethod
    def open(cls, directory: Path) -> RunLog:
        """Attach `<directory>/driver.log` to this process's logging (an OSError if it cannot be written)."""
        path = Path(directory) / RUN_LOG_FILE
        handler = _QuietFileHandler(path, encoding="utf-8", delay=False)
        handler.setLevel(logging.INFO)
        handler.setFormatter(
            logging.Formatter(
                "%(asctime)s.%(msecs)03d %(levelname)-7s %(threadName)s %(name)s: %(message)s", "%H:%M:%S"
            )
        )
        root = logging.getLogger()
        root.addHandler(handler)
        for name in PROJECT_LOGGERS:
            logger = logging.getLogger(name)
            if logger.getEffectiveLevel() > logging.INFO:
                logger.setLevel(logging.INFO)
        run_log = cls(path, handler)
        os.environ[_VLLM_CONSOLE] = "0"  # read by vLLM's import, here and in the processes started from here
        for name in ENGINE_LOGGERS:
            _to_file(logging.getLogger(name))
        logging.captureWarnings(True)  # a library's FutureWarning goes to the file, not the console
        threading.excepthook = _log_thread_failure
        return run_log

    def keep(self, error: BaseException, what: str = "the run ended with") -> None:
        """Write `error` and its traceback to the file alone (the console has its one line)."""
        record = log.makeRecord(log.name, logging.ERROR, __file__, 0, f"{what}: %r", (error,), None)
        record.exc_info = (type(error), error, error.__traceback__)
        self.handler.handle(record)
        self.handler.flush()

    def close(self) -> None:
        """Detach and close the file; threads' exceptions are printed again as before."""
        logging.getLogger().removeHandler(self.handler)
        self.handler.close()
        threading.excepthook = self._previous_hook
        logging.captureWarnings(False)
        if self._previous_vllm_console is None:
            os.environ.pop(_VLLM_CONSOLE, None)
        else:
            os.environ[_VLLM_CONSOLE] = self._previous_vllm_console


def _to_file(logger: logging.Logger) -> None:
    """Let `logger`'s records reach the file at INFO instead of its own console handlers (a library
    imported before the run log opened has them already)."""
    for handler in list(logger.handlers):
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            logger.removeHandler(handler)
    logger.propagate = True
    logger.setLevel(logging.INFO)


def _log_thread_failure(args: threading.ExceptHookArgs) -> None:
    """`threading.excepthook`: an exception that ended a thread is logged (its traceback in the run
    log), not printed to the console."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "a thread"
    log.error(
        "thread %s ended with %s: %s",
        name,
        args.exc_type.__name__,
        args.exc_value,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),  # pyright: ignore[reportArgumentType]
    )
