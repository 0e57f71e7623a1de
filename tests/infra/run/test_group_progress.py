"""A step's rollout reports its complete groups only once it has run a second, then at most once a
second and for the last group; a shorter rollout makes no report (each is a Prefect API call)."""

from __future__ import annotations

from infra.run.group_progress import GroupProgress
from tests.helpers import Clock


def _progress(clock: Clock, total: int = 4) -> tuple[GroupProgress, list[tuple[int, int]]]:
    reports: list[tuple[int, int]] = []
    return GroupProgress(total, lambda done, of: reports.append((done, of)), 1.0, clock), reports


def test_a_rollout_shorter_than_a_second_reports_nothing():
    clock = Clock()
    progress, reports = _progress(clock)
    for _ in range(4):
        clock.advance(0.2)
        progress.advance()
    progress.finish()
    assert reports == []


def test_a_long_rollout_reports_after_a_second_then_each_second_and_its_last_group():
    clock = Clock()
    progress, reports = _progress(clock, total=5)
    for step_s in (0.5, 0.6, 0.3, 0.8, 0.1):  # groups complete at 0.5, 1.1, 1.4, 2.2, 2.3 s
        clock.advance(step_s)
        progress.advance()
    assert reports == [(2, 5), (4, 5), (5, 5)]
    progress.finish()
    assert reports[-1] == (5, 5) and len(reports) == 3


def test_a_rollout_that_reported_says_where_it_ended_when_groups_were_dropped():
    clock = Clock()
    progress, reports = _progress(clock)
    clock.advance(1.5)
    progress.advance()
    progress.finish()
    assert reports == [(1, 4), (1, 4)]
