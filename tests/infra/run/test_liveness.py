"""The VM sweep's verdict (`infra.run.liveness.judge`): pure, on a given clock."""

from __future__ import annotations

from infra.run.liveness import RunLife, judge

NOW = 1_750_000_000.0
STALE = 900.0


def verdict(runs, *, own=False, created_at=None, delete_unknown=False):
    return judge(runs, own=own, created_at=created_at, now=NOW, stale_after_s=STALE, delete_unknown=delete_unknown)


def test_a_run_is_alive_while_unended_with_a_recent_heartbeat():
    alive = RunLife("r-1", NOW - 5000, None, NOW - 60)
    assert verdict([alive]).action == "keep" and "heartbeat 60 s ago" in verdict([alive]).why
    just_started = RunLife("r-1", NOW - 30, None, None)  # no beat yet: its start counts
    assert verdict([just_started]).action == "keep"


def test_an_ended_run_or_a_gone_driver_gets_its_vms_deleted():
    ended = verdict([RunLife("r-1", NOW - 5000, NOW - 100, NOW - 120)])
    assert (ended.action, ended.why) == ("delete", "run r-1 ended 100 s ago")
    gone = verdict([RunLife("r-1", NOW - 5000, None, NOW - STALE - 1)])
    assert gone.action == "delete" and "driver is gone: last heartbeat 901 s ago" in gone.why


def test_the_sweeping_run_adopts_its_own_vms_whatever_the_ledger_says():
    assert verdict([RunLife("r-1", NOW - 5000, NOW - 100, None)], own=True).action == "adopt"


def test_one_live_run_among_those_sharing_a_label_keeps_the_vm():
    runs = [RunLife("a" * 70 + "-1", NOW - 9000, NOW - 8000, None), RunLife("a" * 70 + "-2", NOW - 10, None, NOW - 5)]
    assert verdict(runs).action == "keep"


def test_unknown_runs_are_kept_unless_asked_and_then_only_once_old():
    assert verdict([], created_at=NOW - 10 * STALE).action == "keep"
    assert verdict([], created_at=NOW - 60, delete_unknown=True).action == "keep"
    old = verdict([], created_at=NOW - STALE - 5, delete_unknown=True)
    assert old.action == "delete" and "not in this ledger" in old.why
