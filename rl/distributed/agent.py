"""A trainer group's torchrun agent that ends with the process that started it, and on CPU forks
its ranks from its own warm state.

``python -m rl.distributed.agent [--fork-ranks] ARGS`` is torchrun (``torch.distributed.run``)
with ARGS, plus a watchdog on the pid in `RLBOOST_DRIVER_PID` (`rl.driver_watch`): when the
training process (or `rlboost trainer-node`) is gone, the agent exits at once, and its ranks die
with it (their parent-death signal). This matters while the agent has no ranks yet: waiting in a
rendezvous for the other nodes, nothing else would end it.

`--fork-ranks` (a group on CPU, `trainer.fork_ranks`): the agent has the rank's modules and
DeepSpeed imported (about 6 s of CPU; its group forks it from a template that imported them,
`rl.distributed.agent_preload`) and torchrun forks each rank from it (``--start-method=fork
--run-path``) instead of starting ``python -u -m rl.distributed.rank``, which imports them again;
the fork is made what that interpreter would be (`_as_a_new_rank`). Never with CUDA, which does not
survive a fork: ranks on GPUs start fresh.
"""

from __future__ import annotations

import os
import signal
import sys

from rl.driver_watch import watch_driver

FORK_RANKS = "--fork-ranks"
RANK_MODULE = "rl.distributed.rank"
RANK_COMMAND = ["-m", RANK_MODULE]
"""How ARGS end: torchrun runs the rank module."""


def main() -> None:
    watch_driver(lambda: None, grace_s=0.0)
    from torch.distributed.run import main as torchrun

    arguments = sys.argv[1:]
    if arguments[:1] == [FORK_RANKS]:
        arguments = forked_rank_arguments(arguments[1:])
    torchrun(arguments)


def forked_rank_arguments(arguments: list[str]) -> list[str]:
    """torchrun's `arguments` (ending with `RANK_COMMAND`) made to fork the ranks from this process,
    once it has imported the rank module."""
    if arguments[-2:] != RANK_COMMAND:
        raise ValueError(f"{FORK_RANKS} needs torchrun arguments ending with {' '.join(RANK_COMMAND)}: {arguments}")
    from rl.distributed import rank

    rank.import_deepspeed()  # as each rank imports it (without MLflow), once here
    os.register_at_fork(after_in_child=_as_a_new_rank)
    return [*arguments[:-2], "--start-method=fork", "--run-path", str(rank.__file__)]


def _as_a_new_rank() -> None:
    """In a forked rank, what a new ``python -u -m rl.distributed.rank`` would have: a session of its
    own, the default signal handlers (not torchrun's), line-buffered output, NumPy's generator
    reseeded, that command line as its process title."""
    from setproctitle import setproctitle

    os.setsid()  # as torchrun starts a rank: a session of its own, out of reach of a signal to the agent's group
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):  # torchrun's handlers raise in the agent
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # pyright: ignore[reportAttributeAccessIssue]
    setproctitle(" ".join([sys.executable, "-u", *RANK_COMMAND]))
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # Python's `random` reseeds itself after a fork; NumPy's global generator does not
        numpy.random.seed()


if __name__ == "__main__":
    main()
