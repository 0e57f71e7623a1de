"""Where each RL step's prompts come from, addressed by a cursor so that a resumed run continues
with exactly the prompts an uninterrupted run would have seen.

`PromptSource.take(cursor, n)` is a pure function of (config, cursor, n): the arithmetic stream is
deterministic in its seed, and a file dataset is walked in a seeded per-epoch shuffle.
`check_data_files(config, eval_size)` opens both files of a `file` source and validates their
first records before a run starts any work (`rlboost train`); a bad file or record, then or when
the session loads the whole file, is a `DatasetError` naming the setting, the file, the line and
the field, and the fix.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from rl.config import DataConfig
from rl.datasets import SUPPORTED_SUFFIXES, DatasetError, PromptRecord, load_prompt_dataset, problems_as_records
from rl.families import eval_set, problem_stream

CHECKED_RECORDS = 1000
"""Records of each dataset file that `check_data_files` validates: the first ones (reading them
takes milliseconds; a bad record past them is named when the session loads the whole file)."""


def check_data_files(config: DataConfig, eval_size: int, records: int = CHECKED_RECORDS) -> None:
    """Open `data.path` and `data.eval_path` of a `file` source and validate the first `records`
    records of each (of the held-out file: at most the `eval_size` the run evaluates on)."""
    if config.source == "file":
        _load(config, "path", config.path, limit=records)
        _load(config, "eval_path", config.eval_path, limit=min(eval_size, records))


def _load(config: DataConfig, setting: str, path: Path | None, limit: int | None = None) -> list[PromptRecord]:
    """The records of `path` (`data.<setting>`); a `DatasetError` whose message begins with the
    setting and ends with the fix."""
    assert path is not None, "DataConfig requires path and eval_path for source 'file'"
    try:
        return load_prompt_dataset(
            path, prompt_field=config.prompt_field, answer_field=config.answer_field, limit=limit
        )
    except DatasetError as error:
        raise DatasetError(f"data.{setting}: {error}; {_fix(config, setting, path, error)}", error.missing) from None


def _fix(config: DataConfig, setting: str, path: Path, error: DatasetError) -> str:
    prompt, answer = config.prompt_field, config.answer_field
    if error.missing is not None:
        which = "prompt" if error.missing == prompt else "answer"
        return f"set data.{which}_field to the key that holds the {which}, or add {error.missing!r} to every record"
    if path.suffix not in SUPPORTED_SUFFIXES or not path.is_file():
        return f"point data.{setting} at a .jsonl or .parquet file"
    if path.suffix == ".jsonl":
        shape = f"UTF-8, one JSON object per line with a non-empty string {prompt!r} and a string or number {answer!r}"
    else:
        shape = f"a table with a non-empty string column {prompt!r} and a string or number column {answer!r}"
    return f"fix the file ({shape}), or point data.{setting} at another"


class PromptSource:
    def __init__(self, config: DataConfig, chat: bool = False) -> None:
        """The prompts of `config`; `chat`: a tool family's problems written for an instruct model
        (`prompt.chat_template`)."""
        self.config, self.chat = config, chat
        self._records: list[PromptRecord] | None = None
        if config.source == "file":
            self._records = _load(config, "path", config.path)
        self._stream = None
        self._position = 0

    def take(self, cursor: int, n: int) -> list[PromptRecord]:
        """The `n` training prompts starting at position `cursor` of the stream."""
        if self._records is not None:
            return [self._record_at(i) for i in range(cursor, cursor + n)]
        if self._stream is None or self._position > cursor:
            self._stream, self._position = problem_stream(self.config.family, self.config.seed, chat=self.chat), 0
        if cursor > self._position:
            next(itertools.islice(self._stream, cursor - self._position - 1, None), None)
        self._position = cursor + n
        problems = list(itertools.islice(self._stream, n))
        return [PromptRecord(p.prompt, p.answer, cursor + i + 1) for i, p in enumerate(problems)]

    def _record_at(self, index: int) -> PromptRecord:
        assert self._records is not None, "take() calls it for a file source only"
        epoch, offset = divmod(index, len(self._records))
        order = list(range(len(self._records)))
        random.Random(f"{self.config.seed}:{epoch}").shuffle(order)
        return self._records[order[offset]]

    def eval_records(self, size: int) -> list[PromptRecord]:
        """The held-out evaluation prompts (never produced by `take`)."""
        if self.config.source == "file":
            return _load(self.config, "eval_path", self.config.eval_path, limit=size)
        return problems_as_records(eval_set(self.config.family, size, chat=self.chat))
