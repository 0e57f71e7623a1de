"""Prompt dataset loading: happy paths for jsonl and parquet, and every rejected row."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl.datasets import DatasetError, PromptRecord, load_prompt_dataset, problems_as_records
from rl.problems import eval_set


def _jsonl(tmp_path: Path, lines: list[str], name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _parquet(tmp_path: Path, columns: dict[str, list], name: str = "data.parquet") -> Path:
    path = tmp_path / name
    pq.write_table(pa.table(columns), path)
    return path


def test_jsonl_happy_path_skips_blank_lines_and_keeps_line_numbers(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path,
        [
            json.dumps({"prompt": "1+2=", "answer": "3", "id": 7}),
            "",
            "   ",
            json.dumps({"prompt": "What is 6*7?", "answer": 42}),
            json.dumps({"prompt": "Half?", "answer": 0.5}),
        ],
    )
    assert load_prompt_dataset(path) == [
        PromptRecord("1+2=", "3", 1),
        PromptRecord("What is 6*7?", "42", 4),
        PromptRecord("Half?", "0.5", 5),
    ]


def test_jsonl_custom_fields_and_limit(tmp_path: Path) -> None:
    rows = [{"question": f"q{i}", "solution": str(i)} for i in range(5)]
    rows[3] = {"question": "", "solution": "bad, but beyond the limit"}
    path = _jsonl(tmp_path, [json.dumps(row) for row in rows])
    records = load_prompt_dataset(path, prompt_field="question", answer_field="solution", limit=2)
    assert records == [PromptRecord("q0", "0", 1), PromptRecord("q1", "1", 2)]


def test_jsonl_with_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "p", "answer": "a"}).encode())
    assert load_prompt_dataset(path) == [PromptRecord("p", "a", 1)]


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"prompt": "p", "answer": ', "invalid JSON"),
        ('["p", "a"]', "not a JSON object"),
        ('"just a string"', "not a JSON object"),
        (
            '{"answer": "1", "text": "p"}',
            r"missing field 'prompt' \(present keys: \['answer', 'text'\]\)",
        ),
        ('{"prompt": "p"}', r"missing field 'answer' \(present keys: \['prompt'\]\)"),
        ('{"prompt": 12, "answer": "1"}', "field 'prompt' must be a string, got int"),
        ('{"prompt": null, "answer": "1"}', "field 'prompt' must be a string, got null"),
        ('{"prompt": "p", "answer": ["1"]}', "field 'answer' must be a string or number, got list"),
        ('{"prompt": "p", "answer": true}', "field 'answer' must be a string or number, got bool"),
        ('{"prompt": "p", "answer": NaN}', "field 'answer' is not finite"),
        ('{"prompt": "  ", "answer": "1"}', "empty prompt"),
        ('{"prompt": "p", "answer": ""}', "empty answer"),
    ],
)
def test_jsonl_bad_row_names_file_line_and_reason(tmp_path: Path, line: str, reason: str) -> None:
    good = json.dumps({"prompt": "p", "answer": "1"})
    path = _jsonl(tmp_path, [good, "", line, good])
    with pytest.raises(DatasetError, match=rf"{re.escape(str(path))}: line 3: {reason}"):
        load_prompt_dataset(path)


def test_jsonl_invalid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "p", "answer": "1"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DatasetError, match=r"line 2: not valid UTF-8"):
        load_prompt_dataset(path)


def test_parquet_happy_path_with_numeric_answers(tmp_path: Path) -> None:
    path = _parquet(tmp_path, {"prompt": ["1+2=", "3+4="], "answer": [3, 7], "extra": [0, 1]})
    assert load_prompt_dataset(path) == [PromptRecord("1+2=", "3", 1), PromptRecord("3+4=", "7", 2)]


def test_parquet_custom_fields_and_limit(tmp_path: Path) -> None:
    path = _parquet(tmp_path, {"q": ["a", "b", "c"], "sol": ["1", "2", "3"]})
    records = load_prompt_dataset(path, prompt_field="q", answer_field="sol", limit=2)
    assert records == [PromptRecord("a", "1", 1), PromptRecord("b", "2", 2)]


def test_parquet_missing_column(tmp_path: Path) -> None:
    path = _parquet(tmp_path, {"question": ["a"], "answer": ["1"]})
    expected = r"row 1: missing field 'prompt' \(present keys: \['answer', 'question'\]\)"
    with pytest.raises(DatasetError, match=rf"{re.escape(str(path))}: {expected}"):
        load_prompt_dataset(path)


@pytest.mark.parametrize(
    ("columns", "reason"),
    [
        (
            {"prompt": ["a", None], "answer": ["1", "2"]},
            "field 'prompt' must be a string, got null",
        ),
        ({"prompt": ["a", ""], "answer": ["1", "2"]}, "empty prompt"),
        (
            {"prompt": ["a", "b"], "answer": ["1", None]},
            "field 'answer' must be a string or number, got null",
        ),
    ],
)
def test_parquet_bad_row_names_row_number(tmp_path: Path, columns: dict, reason: str) -> None:
    path = _parquet(tmp_path, columns)
    with pytest.raises(DatasetError, match=rf"{re.escape(str(path))}: row 2: {reason}"):
        load_prompt_dataset(path)


def test_unreadable_parquet(tmp_path: Path) -> None:
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match="not a readable parquet file"):
        load_prompt_dataset(path)


def test_missing_file_and_unsupported_extension(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetError, match=rf"{re.escape(str(missing))}: dataset file not found"):
        load_prompt_dataset(missing)
    csv = tmp_path / "data.csv"
    csv.write_text("prompt,answer\np,1\n")
    unsupported = rf"{re.escape(str(csv))}: unsupported dataset format '\.csv'"
    with pytest.raises(DatasetError, match=unsupported):
        load_prompt_dataset(csv)


def test_empty_file_is_an_error(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, ["", "  "])
    with pytest.raises(DatasetError, match="contains no records"):
        load_prompt_dataset(path)


def test_limit_must_be_positive(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, [json.dumps({"prompt": "p", "answer": "1"})])
    with pytest.raises(ValueError, match="limit"):
        load_prompt_dataset(path, limit=0)


def test_dataset_error_is_a_value_error() -> None:
    assert issubclass(DatasetError, ValueError)


def test_problems_as_records() -> None:
    problems = eval_set("chain", 3)
    records = problems_as_records(problems)
    assert [(r.prompt, r.answer, r.source_line) for r in records] == [
        (p.prompt, p.answer, i + 1) for i, p in enumerate(problems)
    ]
