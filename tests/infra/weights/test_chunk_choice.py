"""The rarest-first chunk choice, on hand-made holder maps, and the seeds' upload share in a swarm
of receivers that plan with it in rounds."""

from __future__ import annotations

import random

from infra.weights.chunk_choice import plan
from infra.weights.holders import chunk_bitmap, chunks_in, mark_chunk


def _plan(wanted, sources, in_flight=None, limit=4, excluded=None, fetching=None, seed=0):
    return plan(wanted, sources, fetching or {}, in_flight or {}, limit, excluded or {}, random.Random(seed))


def test_the_rarest_chunks_come_first():
    sources = {"trainer": None, "a": {0, 1, 2}, "b": {1, 2}, "c": {2}}
    planned = _plan(range(5), sources, limit=10)
    rarity = {chunk: 1 + sum(chunk in held for held in sources.values() if held is not None) for chunk in range(5)}
    order = [rarity[chunk] for chunk, _ in planned]
    assert order == sorted(order)  # 3 and 4 (the trainer only), then 0, then 1, then 2
    assert {chunk for chunk, _ in planned[:2]} == {3, 4}


def test_chunks_other_pullers_are_fetching_count_as_less_rare():
    for seed in range(20):
        planned = _plan(range(4), {"trainer": None}, fetching={0: 1, 1: 3, 3: 1}, seed=seed)
        assert [chunk for chunk, _ in planned][0] == 2 and [chunk for chunk, _ in planned][-1] == 1


def test_a_chunk_goes_to_a_source_that_holds_it_and_the_least_busy_one():
    sources = {"trainer": None, "a": {0, 1}, "b": {1}}
    for seed in range(20):
        planned = dict(_plan([0, 1], sources, in_flight={"trainer": 3, "a": 1, "b": 0}, seed=seed))
        assert planned == {0: "a", 1: "b"}


def test_ties_are_broken_at_random_so_receivers_ask_for_different_chunks():
    firsts = {_plan(range(16), {"trainer": None}, seed=seed)[0][0] for seed in range(20)}
    assert len(firsts) > 5


def test_a_source_at_its_limit_is_not_asked_and_its_chunks_wait():
    planned = _plan(range(6), {"trainer": None, "a": {0, 1, 2}}, in_flight={"a": 1}, limit=2)
    by_source = [source for _, source in planned]
    assert by_source.count("a") == 1 and by_source.count("trainer") == 2
    assert len(planned) == 3  # the other chunks wait for a slot


def test_excluded_sources_are_not_asked_and_a_chunk_nobody_holds_goes_to_the_fallback():
    sources = {"a": {0, 1}, "b": {1}}
    planned = dict(_plan(range(3), sources, excluded={0: {"a"}, 1: {"a"}}))
    assert planned == {0: None, 1: "b", 2: None}
    assert _plan([0], {}) == [(0, None)]


def test_bitmaps_round_trip():
    bitmap = chunk_bitmap(20)
    assert len(bitmap) == 3 and chunks_in(bytes(bitmap)) == frozenset()
    for index in (0, 7, 8, 19):
        mark_chunk(bitmap, index)
    mark_chunk(bitmap, 8, present=False)
    assert chunks_in(bytes(bitmap)) == {0, 7, 19}


def test_spared_seeds_are_asked_only_for_chunks_no_partial_holder_has_or_fetches():
    sources = {"trainer": None, "a": {0, 1}}
    for seed in range(20):
        planned = dict(plan(range(4), sources, {2: 1}, {}, 4, {}, random.Random(seed), spare_seeds=True))
        assert planned == {0: "a", 1: "a", 3: "trainer"}  # 2 waits for the puller fetching it


def _swarm(chunks: int, receivers: list[str], seed: int, parallel: int = 2) -> dict[str, int]:
    """Receivers that start together pull `chunks` from one seed (the trainer) and from each other,
    in rounds: each, in turn, plans as `WeightPuller` does (sparing the seeds, unless that plans
    nothing) with what the others hold and are fetching, and takes `parallel` chunks that arrive
    by the round's end. Returns the chunks each source uploaded."""
    rng = random.Random(seed)
    held: dict[str, set[int]] = {r: set() for r in receivers}
    uploads = dict.fromkeys(["trainer", *receivers], 0)
    while any(len(h) < chunks for h in held.values()):
        fetching: dict[str, set[int]] = {r: set() for r in receivers}
        for receiver in receivers:
            sources = {"trainer": None, **{o: set(held[o]) for o in receivers if o != receiver and held[o]}}
            elsewhere: dict[int, int] = {}
            for other in receivers:
                for chunk in fetching[other] if other != receiver else ():
                    elsewhere[chunk] = elsewhere.get(chunk, 0) + 1
            wanted = [c for c in range(chunks) if c not in held[receiver]]
            planned = plan(wanted, sources, elsewhere, {}, 2, {}, rng, spare_seeds=True)
            planned = planned or plan(wanted, sources, elsewhere, {}, 2, {}, rng)
            for chunk, source in planned[:parallel]:
                assert source is not None
                fetching[receiver].add(chunk)
                uploads[source] += 1
        for receiver, chunks_fetched in fetching.items():
            held[receiver] |= chunks_fetched
    return uploads


def test_with_spare_seeds_the_trainer_uploads_about_one_copy_and_the_receivers_trade_the_rest():
    chunks, receivers = 32, ["a", "b", "c", "d"]
    for seed in range(5):
        uploads = _swarm(chunks, receivers, seed)
        assert sum(uploads.values()) == chunks * len(receivers)  # every receiver got every chunk once
        # Each chunk leaves the trainer about once; asking seeds as any holder sends ~2 copies.
        assert uploads["trainer"] < 1.25 * chunks, uploads
        assert all(uploads[r] > 0 for r in receivers)
