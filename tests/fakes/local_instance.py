"""A local instance for the provider tests, run as `python -m tests.fakes.local_instance OUT MODE`
(started fresh, or forked from a fork template). It reports through files in OUT: `<id>.ready`
(its capacity class) once its SIGTERM disposition is set, `<id>.pid`, `<id>.term` (its pool) from
the SIGTERM handler, `<id>.grandchild` (the pid of a child of its own that ignores SIGTERM), and
`<id>.process.json`: what a new interpreter would have (command line, session, stdin, working
directory, environment).

MODE: `trap` (SIGTERM: exit 0), `ignore` (SIGTERM ignored), `family` (trap, with the grandchild),
`exit3` (prints a line and exits 3 at once), `sleep` (trap).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GRANDCHILD = "import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
GRANDCHILD += "pathlib.Path(sys.argv[1]).touch(); time.sleep(60)"


def main(out: Path, mode: str) -> int:
    me = os.environ["RLBOOST_INSTANCE_ID"]
    if mode == "exit3":
        print("boom: cannot load the model", flush=True)
        return 3

    def on_term(signum: int, frame: object) -> None:
        (out / f"{me}.term").write_text(os.environ["RLBOOST_POOL"])
        sys.exit(0)

    signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignore" else on_term)
    if mode == "family":
        ready = out / f"{me}.grandchild-ready"
        grandchild = subprocess.Popen([sys.executable, "-S", "-c", GRANDCHILD, str(ready)])
        while not ready.exists():
            time.sleep(0.01)
        (out / f"{me}.grandchild").write_text(str(grandchild.pid))
    process = {
        "argv": sys.argv,
        "orig_argv": sys.orig_argv,
        "session_leader": os.getsid(0) == os.getpid(),
        "stdin": os.readlink("/proc/self/fd/0"),
        "cwd": os.getcwd(),
        "main": sys.modules["__main__"].__spec__.name,
        "environment": dict(os.environ),
    }
    (out / f"{me}.process.json").write_text(json.dumps(process))
    (out / f"{me}.pid").write_text(str(os.getpid()))
    (out / f"{me}.ready").write_text(os.environ["RLBOOST_CAPACITY_CLASS"])
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2]))
