"""Which chunk a puller asks for next, and from whom: rarest first (a pure policy).

A puller's sources are the live holders of the version: complete ones (the trainer, instances that
hold all of it) and partial ones (instances still pulling, serving the chunks they have verified).
`plan` orders the chunks the puller still wants by how many usable sources hold them, fewest first
(ties in random order), and gives each the least busy usable source that holds it and has a request
slot left. Receivers that start together thus ask the trainer for different chunks and then trade
them among themselves, and a chunk only one source holds is copied before the common ones: the
trainer's upload slots, the scarce resource, go to bytes nobody else can serve. A chunk no usable
source holds is planned with source None (the caller's fallback: the object store). No I/O, no
clock: the caller passes its view of the sources and its own request counts.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterable, Mapping, Set


def plan(
    wanted: Iterable[int],
    sources: Mapping[str, Set[int] | None],
    in_flight: Mapping[str, int],
    per_source_limit: int,
    excluded: Mapping[int, Set[str]],
    rng: random.Random,
) -> list[tuple[int, str | None]]:
    """The chunks of `wanted` that can be requested now, rarest first, each with its source.

    `sources`: source -> the chunks it holds (None: all of them); `in_flight`: requests already
    outstanding per source (at most `per_source_limit` each, counting the ones planned here);
    `excluded`: chunk -> sources not to ask for it (they failed it, or lacked it). A chunk whose
    usable holders are all at their limit is left out (it waits); one that no usable source holds
    comes with None."""
    complete = [source for source, chunks in sources.items() if chunks is None]
    partial_holders: dict[int, list[str]] = defaultdict(list)
    for source, chunks in sources.items():
        if chunks is not None:
            for chunk in chunks:
                partial_holders[chunk].append(source)
    candidates: dict[int, list[str]] = {}
    for chunk in wanted:
        avoid = excluded.get(chunk, ())
        candidates[chunk] = [s for s in (*complete, *partial_holders.get(chunk, ())) if s not in avoid]
    order = sorted(candidates, key=lambda chunk: (len(candidates[chunk]), rng.random()))
    load = dict(in_flight)
    planned: list[tuple[int, str | None]] = []
    for chunk in order:
        holders = candidates[chunk]
        if not holders:
            planned.append((chunk, None))
            continue
        free = [s for s in holders if load.get(s, 0) < per_source_limit]
        if free:
            source = min(free, key=lambda s: (load.get(s, 0), rng.random()))
            load[source] = load.get(source, 0) + 1
            planned.append((chunk, source))
    return planned
