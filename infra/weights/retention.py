"""Store retention, as a pure policy: which versions to delete.

Given every version present in the store (complete or not), the versions being pulled right now
(live pull leases) and how many complete versions to keep, `versions_to_delete` returns what the
publisher may delete:

* complete versions beyond the `keep` newest, unless leased;
* incomplete versions (an upload that died before its manifest) older than the newest complete
  one, unless leased. An incomplete version newer than that may be an upload in progress: kept.

The newest complete version is never deleted (`keep` is at least 1), nor is a leased one.
"""

from __future__ import annotations

from collections.abc import Mapping, Set


def versions_to_delete(versions: Mapping[int, bool], leased: Set[int], keep: int) -> list[int]:
    """`versions` maps each version in the store to whether it is complete. Sorted ascending."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the newest complete version is never deleted), got {keep}")
    complete = sorted((v for v, done in versions.items() if done), reverse=True)
    if not complete:
        return []
    kept = set(complete[:keep]) | set(leased)
    newest = complete[0]
    return sorted(v for v, done in versions.items() if v not in kept and (done or v < newest))
