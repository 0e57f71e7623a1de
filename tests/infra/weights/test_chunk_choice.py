"""The rarest-first chunk choice, on hand-made holder maps."""

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
