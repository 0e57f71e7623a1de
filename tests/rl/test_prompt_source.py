"""Tests for rl/prompt_source.py: cursor-addressed, deterministic prompt streams."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from rl.config import DataConfig
from rl.datasets import PromptRecord
from rl.problems import problem_stream, take
from rl.prompt_source import PromptSource


@pytest.mark.parametrize("family", ["add", "chain"])
def test_take_equals_the_slice_of_one_long_take(family):
    config = DataConfig(family=family, seed=5)
    everything = PromptSource(config).take(0, 200)
    assert len(everything) == 200
    assert [r.prompt for r in everything] == [p.prompt for p in take(problem_stream(family, 5), 200)]
    source = PromptSource(config)
    cursor = 0
    for n in (7, 1, 13, 0, 29, 50):
        assert source.take(cursor, n) == everything[cursor : cursor + n]
        cursor += n


def test_take_with_gaps_and_going_backwards_is_deterministic():
    config = DataConfig(seed=1)
    everything = PromptSource(config).take(0, 300)
    source = PromptSource(config)
    for cursor, n in [(40, 10), (45, 5), (10, 3), (10, 3), (200, 20), (0, 1), (299, 1), (100, 50)]:
        assert source.take(cursor, n) == everything[cursor : cursor + n], (cursor, n)
    # A fresh source (e.g. a resumed run) starting mid-stream agrees as well.
    assert PromptSource(config).take(123, 4) == everything[123:127]


def test_source_lines_are_stream_positions():
    records = PromptSource(DataConfig()).take(10, 3)
    assert [r.source_line for r in records] == [11, 12, 13]


def test_different_seeds_give_different_streams():
    assert PromptSource(DataConfig(seed=0)).take(0, 20) != PromptSource(DataConfig(seed=1)).take(0, 20)


def test_eval_records_never_overlap_train_prompts():
    for family in ("add", "chain"):
        source = PromptSource(DataConfig(family=family))
        held_out = source.eval_records(300)
        assert len(held_out) == 300 and len({r.prompt for r in held_out}) == 300
        train = {r.prompt for r in source.take(0, 3000)}
        assert not train & {r.prompt for r in held_out}
        assert source.eval_records(300) == held_out
        # Answers are right.
        for record in held_out[:50]:
            assert record.answer == str(sum(int(x) for x in record.prompt[:-1].split("+")))


@pytest.fixture
def jsonl_dataset(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(7)))
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"e{i}", "answer": str(i)}) + "\n" for i in range(5)))
    return train, held_out


def test_file_source_covers_every_record_each_epoch_in_a_seeded_shuffle(jsonl_dataset):
    train, held_out = jsonl_dataset
    config = DataConfig(source="file", path=train, eval_path=held_out, seed=3)
    source = PromptSource(config)
    records = source.take(0, 28)  # four epochs of 7
    epochs = [records[i : i + 7] for i in range(0, 28, 7)]
    for epoch in epochs:
        assert sorted(r.prompt for r in epoch) == sorted(f"q{i}" for i in range(7))
        assert all(isinstance(r, PromptRecord) and r.answer == r.prompt[1:] for r in epoch)
    orders = {tuple(r.prompt for r in epoch) for epoch in epochs}
    assert len(orders) > 1, "every epoch in the same order: not reshuffled per epoch"
    # Pure function of (config, cursor, n): out of order, fresh instances, any chunking.
    assert PromptSource(config).take(9, 12) == records[9:21]
    assert source.take(20, 3) == records[20:23]
    assert source.take(2, 3) == records[2:5]
    # Another seed shuffles differently.
    other = PromptSource(DataConfig(source="file", path=train, eval_path=held_out, seed=4)).take(0, 28)
    assert [r.prompt for r in other] != [r.prompt for r in records]
    # A long run visits every record equally often.
    counts = Counter(r.prompt for r in source.take(0, 70))
    assert set(counts.values()) == {10}


def test_file_source_eval_records(jsonl_dataset):
    train, held_out = jsonl_dataset
    source = PromptSource(DataConfig(source="file", path=train, eval_path=held_out))
    assert [r.prompt for r in source.eval_records(3)] == ["e0", "e1", "e2"]
    assert [r.prompt for r in source.eval_records(100)] == [f"e{i}" for i in range(5)]
