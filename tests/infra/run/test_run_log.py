"""The run log, `<run>/driver.log`: a record with its traceback, the project's INFO lines, an
exception that ends a thread (logged there, not printed) and the error that ended the run."""

from __future__ import annotations

import logging
import threading

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
