"""Whether the run that launched a cloud VM is alive, from durable state only: the pure verdict of
the VM sweep (`infra.run.sweep`; docs/internals.md §9, "No VM outlives its run").

A run is alive while its ledger row has no `ended_at` and its driver's last heartbeat
(`runs.heartbeat_at`, else `started_at`) is younger than `stale_after_s`: a driver killed by any
signal stops beating, so its run stops being alive `stale_after_s` later. The driver lock
(`infra.run.driver_lock`) makes that heartbeat one driver's. A VM's run is named by its
`rlboost-run` label (`label_value` of the run id); several run ids with one label are alive if any is.

`judge` returns a `Verdict`: `adopt` (the VM belongs to the run that sweeps, a resumed run: its
provider takes it back, nothing is deleted), `keep` (its run is alive, or unknown to this ledger
and `delete_unknown` is off or the VM is younger than `stale_after_s`) or `delete` (its run ended,
its heartbeat is stale, or it is unknown and old with `delete_unknown`). The table, with the
settings: docs/cloud-pools.md ("Sweeping VMs").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Action = Literal["adopt", "keep", "delete"]


@dataclass(frozen=True)
class RunLife:
    """What the ledger says of one run (epoch seconds)."""

    run_id: str
    started_at: float
    ended_at: float | None
    heartbeat_at: float | None

    @property
    def last_sign_of_life(self) -> float:
        return self.heartbeat_at if self.heartbeat_at is not None else self.started_at


@dataclass(frozen=True)
class Verdict:
    action: Action
    why: str


def judge(
    runs: Sequence[RunLife],
    *,
    own: bool,
    created_at: float | None,
    now: float,
    stale_after_s: float,
    delete_unknown: bool,
) -> Verdict:
    """The verdict on one VM: `runs` are the ledger's runs whose label is the VM's; `own` says the
    VM is the sweeping run's own."""
    if own:
        return Verdict("adopt", "this run's own VM (a resumed run adopts it)")
    if not runs:
        age = None if created_at is None else now - created_at
        if not delete_unknown:
            return Verdict("keep", "its run is not in this ledger (kept: fabric.cloud.sweep.delete_unknown is off)")
        if age is not None and age < stale_after_s:
            return Verdict(
                "keep", f"its run is not in this ledger, and the VM is {age:.0f} s old: a run may be starting"
            )
        return Verdict("delete", "its run is not in this ledger" + ("" if age is None else f" (VM {age:.0f} s old)"))
    live = [r for r in runs if r.ended_at is None and now - r.last_sign_of_life < stale_after_s]
    if live:
        newest = max(live, key=lambda r: r.last_sign_of_life)
        return Verdict("keep", f"run {newest.run_id} is alive (heartbeat {now - newest.last_sign_of_life:.0f} s ago)")
    running = [r for r in runs if r.ended_at is None]
    if not running:
        last = max(runs, key=lambda r: r.ended_at or 0.0)
        return Verdict("delete", f"run {last.run_id} ended {now - (last.ended_at or now):.0f} s ago")
    newest = max(running, key=lambda r: r.last_sign_of_life)
    return Verdict(
        "delete",
        f"run {newest.run_id}'s driver is gone: last heartbeat {now - newest.last_sign_of_life:.0f} s ago "
        f"(more than stale_after_s {stale_after_s:g})",
    )
