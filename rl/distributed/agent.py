"""A trainer group's torchrun agent that ends with the process that started it.

``python -m rl.distributed.agent ARGS`` is torchrun (``torch.distributed.run``) with ARGS, plus a
watchdog on the pid in `RLBOOST_DRIVER_PID` (`rl.driver_watch`): when the training process (or
`rlboost trainer-node`) is gone, the agent exits at once, and its ranks die with it (their
parent-death signal). This matters while the agent has no ranks yet: waiting in a rendezvous for
the other nodes, nothing else would end it.
"""

from __future__ import annotations

import sys

from rl.driver_watch import watch_driver


def main() -> None:
    watch_driver(lambda: None, grace_s=0.0)
    from torch.distributed.run import main as torchrun

    torchrun(sys.argv[1:])


if __name__ == "__main__":
    main()
