"""`infra.cli.failures.ending`: the exit status and the one line of each failure the program names
(2: the user's to fix; 3: a service or a process the run needs is gone), and None for a bug."""

from __future__ import annotations

import errno

from infra.cli.failures import ending
from infra.fleet.instance_watch import PoolFailure
from rl.distributed.group import RankFailure
from rl.scoring import NothingToTrain

RESUME = "rlboost train --config c.yaml"


def test_a_lost_trainer_rank_is_a_lost_service():
    lost = RankFailure("trainer rank 1 (pid 4242) killed by SIGKILL (signal 9) during 'accumulate'")
    named = ending(lost, RESUME)
    assert named is not None and named.code == 3
    assert named.line == f"the run stopped: {lost}"


def test_a_failing_pool_names_its_last_instance_and_the_resume_command():
    named = ending(PoolFailure("spot", 3, "spot-2", "exited with code 1"), RESUME)
    assert named is not None and named.code == 3
    assert named.line.startswith("the run stopped: pool spot: 3 instances in a row failed")
    assert named.line.endswith(f"resume with: {RESUME}")


def test_a_full_disk_is_the_users_to_fix_and_a_bug_is_not_named(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "trainer.pt"))
    named = ending(full, RESUME)
    assert named is not None and named.code == 2 and str(tmp_path / "trainer.pt") in named.line
    assert ending(ValueError("a bug"), RESUME) is None


def test_a_step_whose_every_sample_failed_stops_the_run_with_the_resume_command():
    named = ending(NothingToTrain(4), RESUME)
    assert named is not None and named.code == 3
    assert named.line.startswith("the run stopped: every sample of step 4 failed for an infrastructure reason")
    assert named.line.endswith(f"then resume with: {RESUME}") and "\n" not in named.line
