"""Prompt datasets: loading (prompt, answer) records from real files, strictly.

Owns `PromptRecord`, the loader for ``.jsonl`` and ``.parquet`` files and the adapter from the
procedural arithmetic problems (`rl.problems`). Every row either becomes a record or raises a
`DatasetError` naming the file, the 1-based line (jsonl) or row (parquet) and the reason;
nothing is silently dropped (blank jsonl lines are not rows).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rl.problems import Problem

SUPPORTED_SUFFIXES = (".jsonl", ".parquet")


class DatasetError(ValueError):
    """A dataset file that cannot be read, or a row in it that is not a valid record; `missing`:
    the record field a row lacks (None for any other fault)."""

    def __init__(self, message: str, missing: str | None = None) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class PromptRecord:
    """One training or evaluation prompt with its reference answer."""

    prompt: str
    answer: str
    source_line: int
    """1-based line (jsonl) or row (parquet) of the record in its source; index + 1 otherwise."""


def load_prompt_dataset(
    path: str | Path,
    *,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    limit: int | None = None,
) -> list[PromptRecord]:
    """Records of a ``.jsonl`` or ``.parquet`` file, in file order.

    The prompt must be a non-empty string; the answer a non-empty string or a finite number
    (converted with ``str``). ``limit`` keeps the first ``limit`` records and reads no further.
    Raises `DatasetError` for a missing file, an unsupported extension, a file with no records
    and the first bad row.
    """
    path = Path(path)
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be a positive number of records, got {limit}")
    if path.suffix not in SUPPORTED_SUFFIXES:
        raise DatasetError(f"{path}: unsupported dataset format {path.suffix!r}; expected one of {SUPPORTED_SUFFIXES}")
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    if path.suffix == ".jsonl":
        rows = _jsonl_rows(path)
    else:
        rows = _parquet_rows(path, (prompt_field, answer_field))
    records: list[PromptRecord] = []
    for number, row in rows:
        records.append(_record(path, number, row, prompt_field, answer_field))
        if len(records) == limit:
            break
    if not records:
        raise DatasetError(f"{path}: contains no records")
    return records


def problems_as_records(problems: list[Problem]) -> list[PromptRecord]:
    """The arithmetic problems as records (``source_line`` is the 1-based index)."""
    return [PromptRecord(problem.prompt, problem.answer, index + 1) for index, problem in enumerate(problems)]


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DatasetError(f"{path}: line {number}: not valid UTF-8 ({error})") from None
            if number == 1:
                text = text.removeprefix("\ufeff")
            if not text.strip():
                continue
            try:
                yield number, json.loads(text)
            except json.JSONDecodeError as error:
                raise DatasetError(f"{path}: line {number}: invalid JSON ({error})") from None


def _parquet_rows(path: Path, fields: tuple[str, ...]) -> Iterator[tuple[int, Any]]:
    try:
        parquet = pq.ParquetFile(path)
        columns = parquet.schema_arrow.names
    except (pa.ArrowException, OSError) as error:
        raise DatasetError(f"{path}: not a readable parquet file ({error})") from None
    for field in fields:
        if field not in columns:
            raise DatasetError(f"{path}: row 1: missing field {field!r} (present keys: {sorted(columns)})", field)
    number = 0
    try:
        for batch in parquet.iter_batches(columns=list(dict.fromkeys(fields))):
            for row in batch.to_pylist():
                number += 1
                yield number, row
    except (pa.ArrowException, OSError) as error:
        raise DatasetError(f"{path}: row {number + 1}: unreadable ({error})") from None


def _record(path: Path, number: int, row: Any, prompt_field: str, answer_field: str) -> PromptRecord:
    where = f"{path}: {'line' if path.suffix == '.jsonl' else 'row'} {number}"
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: not a JSON object (got {type(row).__name__})")
    for field in (prompt_field, answer_field):
        if field not in row:
            raise DatasetError(f"{where}: missing field {field!r} (present keys: {sorted(row)})", field)
    prompt, answer = row[prompt_field], row[answer_field]
    if not isinstance(prompt, str):
        raise DatasetError(f"{where}: field {prompt_field!r} must be a string, got {_describe(prompt)}")
    if not prompt.strip():
        raise DatasetError(f"{where}: empty prompt in field {prompt_field!r}")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        if not math.isfinite(answer):
            raise DatasetError(f"{where}: field {answer_field!r} is not finite ({answer})")
        answer = str(answer)
    if not isinstance(answer, str):
        raise DatasetError(f"{where}: field {answer_field!r} must be a string or number, got {_describe(answer)}")
    if not answer.strip():
        raise DatasetError(f"{where}: empty answer in field {answer_field!r}")
    return PromptRecord(prompt, answer, number)


def _describe(value: Any) -> str:
    return "null" if value is None else type(value).__name__
