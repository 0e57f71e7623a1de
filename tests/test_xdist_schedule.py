"""The suite's xdist scheduling (`tests.xdist_schedule`): a worker holding a long training file is
given the next file that is not one, and the long files named are files of this suite."""

from __future__ import annotations

import pytest

from tests.helpers import REPO_ROOT
from tests.xdist_schedule import LONG_TRAINING_FILES, next_file

LONG = frozenset({"long_a.py", "long_b.py"})


@pytest.mark.parametrize(
    ("waiting", "held", "given"),
    [
        (["long_a.py", "b.py"], [], "long_a.py"),  # xdist's order when the worker holds no long file
        (["long_b.py", "b.py"], ["c.py"], "long_b.py"),
        (["long_b.py", "b.py", "d.py"], ["long_a.py"], "b.py"),  # not two long files on one worker
        (["long_b.py"], ["long_a.py"], "long_b.py"),  # nothing else waits: the long one
        (["b.py", "long_b.py"], ["long_a.py"], "b.py"),
    ],
)
def test_a_worker_holding_a_long_file_is_given_the_first_other_file(waiting, held, given):
    assert next_file(waiting, held, LONG) == given


def test_the_long_training_files_are_files_of_the_suite():
    assert all((REPO_ROOT / file).is_file() for file in LONG_TRAINING_FILES)
