"""A real `mlflow server` on loopback (`MlflowServer`): started on a free port over a SQLite store,
killed (its whole process group) and restarted on the same port and store. The tests, the
`bench/tracking.py` benchmark and the docs' MLflow UI screenshot use it; a run reaches it as
`tracking: [{kind: mlflow, uri: <url>}]`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

START_TIMEOUT_S = 180.0
"""MLflow's server imports for tens of seconds on a busy 2-core machine."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class MlflowServer:
    """`mlflow server` over `directory/mlflow.db`, artifacts in `directory/artifacts`."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.directory, self.port = directory, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> MlflowServer:
        """Start the server and return once `/health` answers."""
        self.directory.mkdir(parents=True, exist_ok=True)
        command = [
            *(sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port)),
            *("--workers", "1", "--backend-store-uri", f"sqlite:///{(self.directory / 'mlflow.db').resolve()}"),
            *("--artifacts-destination", str((self.directory / "artifacts").resolve())),
        ]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job runner processes
        log = (self.directory / "server.log").open("ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=log, env=env, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mlflow server did not start: see {self.directory / 'server.log'}")
            time.sleep(0.2)
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        """Kill the server's process group (SIGKILL: a server gone, not one shutting down)."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)
        self.process = None

    def __enter__(self) -> MlflowServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
