"""Where each RL step's prompts come from, addressed by a cursor so that a resumed run continues
with exactly the prompts an uninterrupted run would have seen.

`PromptSource.take(cursor, n)` is a pure function of (config, cursor, n): the arithmetic stream is
deterministic in its seed, and a file dataset is walked in a seeded per-epoch shuffle.
"""

from __future__ import annotations

import itertools
import random

from rl.config import DataConfig
from rl.datasets import PromptRecord, load_prompt_dataset, problems_as_records
from rl.problems import eval_set, problem_stream


class PromptSource:
    def __init__(self, config: DataConfig) -> None:
        self.config = config
        self._records: list[PromptRecord] | None = None
        if config.source == "file":
            assert config.path is not None, "DataConfig requires path for source 'file'"
            self._records = load_prompt_dataset(
                config.path, prompt_field=config.prompt_field, answer_field=config.answer_field
            )
        self._stream = None
        self._position = 0

    def take(self, cursor: int, n: int) -> list[PromptRecord]:
        """The `n` training prompts starting at position `cursor` of the stream."""
        if self._records is not None:
            return [self._record_at(i) for i in range(cursor, cursor + n)]
        if self._stream is None or self._position > cursor:
            self._stream, self._position = problem_stream(self.config.family, self.config.seed), 0
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
            assert self.config.eval_path is not None, "DataConfig requires eval_path for source 'file'"
            return load_prompt_dataset(
                self.config.eval_path,
                prompt_field=self.config.prompt_field,
                answer_field=self.config.answer_field,
                limit=size,
            )
        return problems_as_records(eval_set(self.config.family, size))
