"""The run log, `<run>/driver.log`: a record with its traceback, the project's INFO lines, an
exception that ends a thread (logged there, not printed) and the error that ended the run."""

from __future__ import annotations

import errno
import logging
import os
import sys
import threading
import warnings

import pytest

from infra.run.run_log import RUN_LOG_FILE, RunLog


def test_tracebacks_go_to_the_run_log(tmp_path, capfd):
    hook = threading.excepthook
    run_log = RunLog.open(tmp_path)
    try:
        logging.getLogger("rlboost.worker").info("worker w-1 registered")
        try:
            raise ConnectionError("Redis went away")
        except ConnectionError:
            logging.getLogger("infra.run.fabric").exception("the step failed")

        def fail() -> None:
            raise RuntimeError("a thread's own failure")

        thread = threading.Thread(target=fail, name="flusher")
        thread.start()
        thread.join()
        try:
            raise ValueError("the run's end")
        except ValueError as error:
            run_log.keep(error)
    finally:
        run_log.close()
    text = (tmp_path / RUN_LOG_FILE).read_text()
    assert "INFO    MainThread rlboost.worker: worker w-1 registered" in text
    assert "infra.run.fabric: the step failed\nTraceback (most recent call last):" in text
    assert "ConnectionError: Redis went away" in text
    assert "rlboost.driver: thread flusher ended with RuntimeError: a thread's own failure" in text
    assert 'raise RuntimeError("a thread\'s own failure")' in text
    assert 'the run ended with: ValueError("the run\'s end")' in text
    assert "Traceback" not in capfd.readouterr().err  # the thread's exception was not printed
    assert threading.excepthook is hook and run_log.handler not in logging.getLogger().handlers  # closed


def test_engine_logs_and_warnings_go_to_the_file_not_the_console(tmp_path, capfd, monkeypatch):
    """vLLM gives its logger a console handler at import (unless VLLM_CONFIGURE_LOGGING=0): one
    attached before the run log opened is taken off; a library's FutureWarning is not printed."""
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    engine_logger = logging.getLogger("vllm")
    engine_logger.addHandler(logging.StreamHandler(sys.stdout))
    engine_logger.propagate = False
    run_log = RunLog.open(tmp_path)
    try:
        assert os.environ["VLLM_CONFIGURE_LOGGING"] == "0"  # a later import of vLLM adds no handler
        logging.getLogger("vllm.engine").info("Automatically detected platform cpu.")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("`torch_dtype` is deprecated! Use `dtype` instead!", FutureWarning, stacklevel=1)
    finally:
        run_log.close()
    console = capfd.readouterr()
    assert "detected platform" not in console.out + console.err
    assert "deprecated" not in console.out + console.err
    text = (tmp_path / RUN_LOG_FILE).read_text()
    assert "vllm.engine: Automatically detected platform cpu." in text
    assert "FutureWarning: `torch_dtype` is deprecated!" in text
    assert "VLLM_CONFIGURE_LOGGING" not in os.environ  # restored on close


def test_on_a_full_disk_the_run_log_drops_what_it_cannot_write_and_never_raises(tmp_path, capfd):
    """Every write fails with ENOSPC (the log file is /dev/full): the error that ended the run is
    kept where it can be, and neither `keep` nor `close` raises (the run names the full disk itself)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    (tmp_path / RUN_LOG_FILE).symlink_to("/dev/full")
    run_log = RunLog.open(tmp_path)
    try:
        logging.getLogger("rlboost.driver").info("a line longer than the file's buffer: %s", "x" * 100_000)
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "trainer.pt"))
        except OSError as error:
            run_log.keep(error)
    finally:
        run_log.close()
    assert capfd.readouterr().err == ""
