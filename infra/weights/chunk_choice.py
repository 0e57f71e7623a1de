"""Which chunk a puller asks for next, and from whom: rarest first (a pure policy).

A puller's sources are the live holders of the version: complete ones (seeds: the trainer, and
instances that hold all of it) and partial ones (instances still pulling, serving the chunks they
have verified and advertising those they are fetching). `plan` orders the chunks the puller still
wants by how many usable sources hold them or are fetching them, fewest first, ties in random
order, and gives each the least busy usable source that holds it and has a request slot left.
With `spare_seeds`, a seed is asked only for chunks that no partial holder holds or is fetching:
the seeds' uplinks (the trainer's is the scarce one) carry bytes the swarm lacks, and receivers
that start together ask the trainer for different chunks and trade them among themselves. A
chunk no usable source holds is planned with source None (the caller's fallback: the object
store). No I/O, no clock: the caller passes its view of the sources and its own request counts.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterable, Mapping, Set


def plan(
    wanted: Iterable[int],
    sources: Mapping[str, Set[int] | None],
    fetching: Mapping[int, int],
    in_flight: Mapping[str, int],
    per_source_limit: int,
    excluded: Mapping[int, Set[str]],
    rng: random.Random,
    spare_seeds: bool = False,
) -> list[tuple[int, str | None]]:
    """The chunks of `wanted` that can be requested now, rarest first, each with its source.

    `sources`: source -> the chunks it holds (None: all of them, a seed); `fetching`: chunk -> how
    many partial holders are fetching it; `in_flight`: requests already outstanding per source (at
    most `per_source_limit` each, counting the ones planned here); `excluded`: chunk -> sources not
    to ask for it (they failed it, or lacked it). A chunk whose usable holders are all at their
    limit (or spared seeds) is left out: it waits. One that no usable source holds comes with None."""
    seeds = [source for source, chunks in sources.items() if chunks is None]
    partial_holders: dict[int, list[str]] = defaultdict(list)
    for source, chunks in sources.items():
        if chunks is not None:
            for chunk in chunks:
                partial_holders[chunk].append(source)
    candidates: dict[int, list[str]] = {}
    rarity: dict[int, int] = {}
    for chunk in wanted:
        avoid = excluded.get(chunk, ())
        partial = [s for s in partial_holders.get(chunk, ()) if s not in avoid]
        whole = [s for s in seeds if s not in avoid]
        rarity[chunk] = len(partial) + len(whole) + fetching.get(chunk, 0)
        if not partial and not whole:
            candidates[chunk] = []
        elif spare_seeds and (partial or fetching.get(chunk, 0)):
            candidates[chunk] = partial
        else:
            candidates[chunk] = partial + whole
    load = dict(in_flight)
    planned: list[tuple[int, str | None]] = []
    for chunk in sorted(rarity, key=lambda chunk: (rarity[chunk], rng.random())):
        if rarity[chunk] - fetching.get(chunk, 0) == 0:
            planned.append((chunk, None))
            continue
        free = [s for s in candidates[chunk] if load.get(s, 0) < per_source_limit]
        if free:
            source = min(free, key=lambda s: (load.get(s, 0), rng.random()))
            load[source] = load.get(source, 0) + 1
            planned.append((chunk, source))
    return planned
