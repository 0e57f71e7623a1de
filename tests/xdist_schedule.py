"""How `make test` hands test files to its pytest-xdist workers: xdist's `--dist loadfile` with one
change, so that the files that train for minutes do not wait behind each other on one worker.

xdist orders the files by their number of tests (most first) and gives a worker a further file as
soon as it has two tests or fewer left, so a worker running a one-test file already holds the next
one or two. The three learning cases are one-test files next to each other in that order: in a run
on a 2-core EPYC (2026-12-07) one worker ran all three, one after the other, for the last 390 s of
the run while the other two workers ran out of files. Here a worker that holds one of
`LONG_TRAINING_FILES` is given the first waiting file that is not one of them, while there is one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController

LONG_TRAINING_FILES = frozenset(
    {"tests/flows/test_learning.py", "tests/flows/test_learning_flipped.py", "tests/flows/test_learning_stale.py"}
)
"""One-test files whose test trains for minutes (each a 40-step demo run: 100 s on an idle 2-core host)."""


def next_file(waiting: Sequence[str], held: Iterable[str], long_files: frozenset[str] = LONG_TRAINING_FILES) -> str:
    """The file a worker holding the unfinished files `held` is given next, of the files `waiting`
    in xdist's order: the first, unless both it and one the worker holds are long, then the first
    waiting file that is not long (the first, when every waiting file is long)."""
    if not any(file in long_files for file in held):
        return waiting[0]
    return next((file for file in waiting if file not in long_files), waiting[0])


class SpreadLongTraining(LoadFileScheduling):
    """xdist's `loadfile` scheduling, with the next file of a worker chosen by `next_file`."""

    def _assign_work_unit(self, node: WorkerController) -> None:
        held = [file for file, tests in self.assigned_work.get(node, {}).items() if not all(tests.values())]
        chosen = next_file(list(self.workqueue), held)
        self.workqueue.move_to_end(chosen, last=False)
        super()._assign_work_unit(node)
