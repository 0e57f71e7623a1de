"""Store retention, as a pure policy: which versions to delete.

Given every version present in the store (complete or not), the versions being pulled right now
(live pull leases), how many complete versions to keep and each complete version's delta base,
`versions_to_delete` returns what the publisher may delete:

* complete versions beyond the `keep` newest, unless leased or needed to rebuild a kept or leased
  one (`with_bases`: the deltas and the whole version down its chain of bases);
* incomplete versions (an upload that died before its manifest) older than the newest complete
  one, unless leased. An incomplete version newer than that may be an upload in progress: kept.

The newest complete version is never deleted (`keep` is at least 1), nor is a leased one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set


def with_bases(versions: Iterable[int], bases: Mapping[int, int | None]) -> set[int]:
    """`versions` and every version their deltas are rebuilt from (a version missing from `bases`,
    or mapped to None, is whole)."""
    needed: set[int] = set()
    for version in versions:
        while version is not None and version not in needed:
            needed.add(version)
            version = bases.get(version)
    return needed


def versions_to_delete(
    versions: Mapping[int, bool], leased: Set[int], keep: int, bases: Mapping[int, int | None] | None = None
) -> list[int]:
    """`versions` maps each version in the store to whether it is complete; `bases` each complete
    version to its delta base (None or missing: whole). Sorted ascending."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the newest complete version is never deleted), got {keep}")
    complete = sorted((v for v, done in versions.items() if done), reverse=True)
    if not complete:
        return []
    kept = with_bases([*complete[:keep], *leased], bases or {})
    newest = complete[0]
    return sorted(v for v, done in versions.items() if v not in kept and (done or v < newest))
