"""A fault injected through the environment: rollout workers that fail at start.

With this directory on `PYTHONPATH` and `START_FAULT_DIR` naming a directory, a Python
process that runs the rollout worker (`python -m infra.rollout.worker`, how a local instance
starts) takes one file from that directory, if there is one, and exits with status 1 before
anything else, its last line saying so: a worker that fails at start, before it registers. Each
file fails one start (a test or the chaos bench arms the fault by writing files there); every
other process, and every worker start once the directory is empty, is untouched. A worker forked
from a fork template (`rl.warm_fork.template`, which runs this file at its own start) is
checked the same way as it forks, with its command line, environment and log already in place.
"""

from __future__ import annotations

import os
import sys

ARMED = "START_FAULT_DIR"  # not an `RLBOOST_` variable: a fault of the tests and benches, no setting of rlboost


def _fail_if_armed() -> None:
    armed = os.environ.get(ARMED)
    if not armed:
        return
    if "infra.rollout.worker" not in sys.orig_argv:
        return
    for name in sorted(os.listdir(armed)):
        try:
            os.unlink(os.path.join(armed, name))  # one process takes each file
        except FileNotFoundError:
            continue
        sys.stderr.write(f"worker cannot start: the injected instance_start fault {name} failed it\n")
        sys.stderr.flush()
        os._exit(1)


if "rl.warm_fork.template" in sys.orig_argv:
    os.register_at_fork(after_in_child=_fail_if_armed)
else:
    _fail_if_armed()
